"""The search: branch and bound over closed forms that bound the simulation, partial recompute, the
data-parallel tail."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpformer.autoconfig.candidates import Pins, SearchResult
from mpformer.autoconfig.cluster import load_cluster
from mpformer.autoconfig.cost import _dp_time, iteration_time
from mpformer.autoconfig.fit import recompute_choice
from mpformer.autoconfig.memory import Workload, plan_memory
from mpformer.autoconfig.runtimes import MEGATRON, MEGATRON_CORE, MPFORMER
from mpformer.autoconfig.search import _retime, search
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig

SMALL = ModelConfig(arch="llama", num_layers=16, hidden_size=2048, num_attention_heads=16, num_kv_heads=8,
                    ffn_hidden_size=5632, vocab_size=32000, max_position_embeddings=4096)


@pytest.mark.parametrize("nodes,gbs,seq", [(2, 64, 2048), (4, 256, 4096), (1, 32, 8192)])
def test_branch_and_bound_finds_what_simulating_every_plan_finds(nodes, gbs, seq):
    """Every structure the search enumerated evaluated (memory, recompute) and its plan simulated on
    its schedule: the top k are the search's; every plan the search evaluated but did not simulate has
    a closed form no better than the plans it returned and no lower than its simulation."""
    c, w = load_cluster("dgx-h100", nodes=nodes), Workload(gbs, 1, seq, "bf16")
    res = search(SMALL, c, w, top_k=3)
    assert res.top and all(x.time.extra["estimate"] == "simulated" for x in res.top)
    every = SearchResult([], [])
    for bases, mbs in res.structures:
        recompute_choice(SMALL, c, w, every, Pins({}), "cuda", bases, mbs)
    assert len(every.feasible) > len(res.feasible) or res.pruned == 0
    everything = sorted(_retime(SMALL, x, w, c).iteration_s for x in every.feasible)
    assert [x.time.iteration_s for x in res.top] == pytest.approx(everything[:3], rel=1e-12)
    kth = res.top[-1].time.iteration_s
    for x in res.feasible:
        if x.time.extra["estimate"] == "bound":
            assert x.time.iteration_s >= kth * (1 - 1e-12)
            assert _retime(SMALL, x, w, c).iteration_s >= x.time.iteration_s * (1 - 1e-12)


def test_the_fewest_recomputed_layers_that_fit():
    """Memory between full recompute and none: the search recomputes the first K layers of each chunk,
    K the fewest that fit (K - 1 does not)."""
    c = replace(load_cluster("dgx-h100"), memory_gb=10.5)  # 7.1 usable; none needs 8.0 GB, full 3.5
    w = Workload(64, 1, 8192, "bf16")
    fixed = {"tp": 2, "pp": 2, "dp": 2, "cp": 1, "zero": 1, "micro_batch_size": 1, "vpp": 1, "schedule": "1f1b"}
    res = search(SMALL, c, w, fixed=fixed, top_k=1)
    L = res.top[0].layout
    assert L.recompute != "none" and L.recompute_layers is not None and L.recompute_layers >= 1
    worst = max(s.total for s in plan_memory(SMALL, L, replace(w, micro_batch_size=1)))
    fewer = replace(L, recompute_layers=L.recompute_layers - 1) if L.recompute_layers > 1 else replace(
        L, recompute="none", recompute_layers=None)
    assert worst <= c.usable_bytes < max(s.total for s in plan_memory(SMALL, fewer, w))
    pinned = search(SMALL, c, w, fixed={**fixed, "recompute": "full"}, top_k=1).top[0].layout
    assert pinned.recompute_layers is None  # a pinned mode recomputes every layer, as its source did


def test_data_parallel_tail():
    """Buckets reduced behind the backward: the last bucket always shows; a run that reduces after the
    backward (Megatron-LM before --overlap-grad-reduce) shows it all."""
    c, w = load_cluster("dgx-h100", nodes=4), Workload(256, 1, 4096, "bf16")
    L = ParallelLayout(dp=32, zero=0)
    params = SMALL.num_params()
    long_bwd = _dp_time(SMALL, L, w, c, params, 8, 1.0, 10.0, False)
    no_overlap = _dp_time(SMALL, L, replace(w, runtime=replace(MPFORMER, overlap_grad_reduce=False)), c, params, 8,
                          1.0, 10.0, False)
    no_time = _dp_time(SMALL, L, w, c, params, 8, 0.0, 0.0, False)
    assert 0 < long_bwd < no_time == pytest.approx(no_overlap)
    # Megatron-LM without overlap reduces its whole buffer in one collective: one latency, not one a bucket
    one = _dp_time(SMALL, L, replace(w, runtime=MEGATRON), c, params, 8, 1.0, 10.0, False)
    assert one < no_overlap
    b = iteration_time(SMALL, L, w, c, params_per_rank=params)
    assert b.dp_comm_exposed_s > 0 and b.optimizer_s > 0


def test_runtime_buckets_and_capabilities():
    """Gradient buckets as each runtime makes them (mpformer's train.grad_bucket_mb, Megatron-Core's
    max(4e7, 1e6 dp) parameters, Megatron-LM's one buffer), and the search offers a published run only
    the schedules and ZeRO stages its software had: Megatron never ran zero-bubble schedules or ZeRO-3."""
    assert MPFORMER.buckets(25 * 2**20, 4, 8) == 4 and MPFORMER.buckets(1, 4, 8) == 1
    assert MEGATRON_CORE.buckets(4e8, 4, 8) == 10 and MEGATRON_CORE.buckets(4e8, 4, 100) == 4
    assert MEGATRON.buckets(1e12, 4, 64) == 1
    c = load_cluster("dgx-h100", nodes=2)
    w = Workload(64, 1, 2048, "bf16", runtime=MEGATRON_CORE)
    res = search(SMALL, c, w, fixed={"cp": 1}, top_k=50)
    plans = [p.plan() for p in res.top]
    assert plans and all(p["schedule"] in ("1f1b", "interleaved") and p["zero"] in (0, 1) for p in plans)
    free = search(SMALL, c, Workload(64, 1, 2048, "bf16"), fixed={"cp": 1}, top_k=200)
    assert {p.plan()["zero"] for p in free.top} - {0, 1}  # mpformer's own runtime has ZeRO-2/3 too


def test_megatron_splits_pipeline_sends_over_tensor_parallel_ranks():
    """Megatron-LM's scatter/gather: without sequence parallelism each tensor-parallel rank still sends
    1/t of the boundary (less pipeline traffic than mpformer, which sends all of it then)."""
    from mpformer.autoconfig.cost import iteration_time

    c = load_cluster("dgx-a100-80gb", nodes=2)
    L = ParallelLayout(dp=1, tp=8, pp=2, sequence_parallel=False)
    big = ModelConfig(arch="gpt2", num_layers=8, hidden_size=4096, num_attention_heads=32, vocab_size=51200,
                      activation="gelu_tanh", max_position_embeddings=2048)
    own = iteration_time(big, L, Workload(16, 1, 2048, "bf16"), c, params_per_rank=10**9)
    megatron = iteration_time(big, L, Workload(16, 1, 2048, "bf16", runtime=replace(MPFORMER, p2p_split=True)), c,
                              params_per_rank=10**9)
    assert megatron.p2p_s == pytest.approx(own.p2p_s / 8, rel=0.2) and megatron.iteration_s < own.iteration_s



def test_v_schedules_are_searched_up_to_16_stages():
    """ZB-V and DualPipeV (vpp 2, two layers a rank at least) are enumerated at every pipeline depth
    up to V_SEARCH_MAX_PP and priced like the rest; deeper only when pinned."""
    from mpformer.autoconfig.search import V_SEARCH_MAX_PP
    from mpformer.core.layout import V_SCHEDULES

    c, w = load_cluster("dgx-h100", nodes=2), Workload(64, 1, 2048, "bf16")
    res = search(SMALL, c, w, top_k=3)
    seen = {(L.schedule, L.pp, L.vpp) for bases, _ in res.structures for L in bases}
    assert {(s, pp, 2) for s in V_SCHEDULES for pp in (2, 4, 8)} <= seen
    assert not {x for x in seen if x[0] in V_SCHEDULES and x[2] != 2}
    deep = replace(SMALL, num_layers=2 * 2 * V_SEARCH_MAX_PP)
    c32 = load_cluster("dgx-h100", nodes=4)
    unpinned = search(deep, c32, w, fixed={"pp": 2 * V_SEARCH_MAX_PP, "tp": 1}, top_k=1)
    assert not {L.schedule for bases, _ in unpinned.structures for L in bases} & set(V_SCHEDULES)
    pinned = search(deep, c32, w, fixed={"pp": 2 * V_SEARCH_MAX_PP, "tp": 1, "schedule": "zb-v"}, top_k=1)
    assert {L.schedule for bases, _ in pinned.structures for L in bases} == {"zb-v"}
