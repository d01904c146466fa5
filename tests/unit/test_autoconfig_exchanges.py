"""A mixture of experts' token exchanges in the cost model (autoconfig/expert_cost.py, cost.py): per stage
into the pipeline's Costs.a2a_f / a2a_b, so DualPipeV's overlapped pairs hide what zb-v, the same V
placement without pairs, waits for. Oracles: the same plan priced with the exchanges taken out (their
gain), the rule dispatch_time documents (forward and backward exchanges), pipeline_bound <= the timeline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpformer.autoconfig import cost
from mpformer.autoconfig.cluster import load_cluster
from mpformer.autoconfig.cost import iteration_time
from mpformer.autoconfig.expert_cost import dispatch_time, dispatch_times, stage_exchanges
from mpformer.autoconfig.memory import Workload
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig

# Mixtral-like: 8 layers, 16 experts; ep=16 with tp=1 leaves the node (8 devices), so the exchanges
# run over InfiniBand and are a good share of a layer's time.
MOE = ModelConfig(arch="mixtral", num_layers=8, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                  ffn_hidden_size=14336, vocab_size=32000, max_position_embeddings=4096, mlp_kind="moe",
                  num_experts=16, num_experts_per_tok=2, moe_ffn_hidden_size=14336)
W = Workload(256, 1, 4096, "bf16")
H100 = replace(load_cluster("dgx-h100"), nodes=8)


def _v(schedule: str, **kw) -> ParallelLayout:
    return ParallelLayout(dp=16, pp=4, vpp=2, ep=16, schedule=schedule, **kw)


def _no_exchanges(monkeypatch: pytest.MonkeyPatch) -> None:
    def zero(m, L, seq, mb, wb, c, counts):
        return [0.0] * len(counts), [0.0] * len(counts)

    monkeypatch.setattr(cost, "stage_exchanges", zero)


def test_dualpipev_gains_less_from_the_exchanges_than_zbv(monkeypatch):
    """Both priced through iteration_time at the same layout: zb-v waits for every exchange, DualPipeV's
    pairs run most beside the other half's compute."""
    with_x = {s: iteration_time(MOE, _v(s), W, H100, params_per_rank=10**9) for s in ("zb-v", "dualpipev")}
    _no_exchanges(monkeypatch)
    without = {s: iteration_time(MOE, _v(s), W, H100, params_per_rank=10**9) for s in ("zb-v", "dualpipev")}
    gain = {s: with_x[s].iteration_s - without[s].iteration_s for s in with_x}
    zbv, dual = with_x["zb-v"], with_x["dualpipev"]
    assert zbv.ep_comm_s > 0.05 * zbv.iteration_s  # significant
    assert gain["zb-v"] >= 0.9 * zbv.ep_comm_s  # all waited for
    assert 0 < gain["dualpipev"] < 0.5 * gain["zb-v"]
    assert zbv.ep_hidden_s == 0 and dual.ep_hidden_s > dual.ep_comm_s > 0
    # the same exchanges on the rank, waited for or hidden; none left in the tensor-parallel term
    assert dual.ep_comm_s + dual.ep_hidden_s == pytest.approx(zbv.ep_comm_s, rel=1e-9)
    assert zbv.tp_comm_s == pytest.approx(without["zb-v"].tp_comm_s) == 0.0
    assert dual.iteration_s < zbv.iteration_s


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev", "1f1b"])
def test_bound_below_the_simulated_timeline_with_exchanges(schedule):
    L = _v(schedule) if schedule != "1f1b" else ParallelLayout(dp=16, pp=4, ep=16)
    sim = iteration_time(MOE, L, W, H100, params_per_rank=10**9)
    bound = iteration_time(MOE, L, W, H100, params_per_rank=10**9, simulate_pipeline=False)
    assert bound.iteration_s <= sim.iteration_s * (1 + 1e-12)


def test_one_stage_waits_for_every_exchange(monkeypatch):
    """pp = 1: no pipeline to overlap with, the exchanges are a plain wait of every micro-batch."""
    L = ParallelLayout(dp=64, ep=16)
    b = iteration_time(MOE, L, W, H100, params_per_rank=10**9)
    micro = W.global_batch_size // L.dp
    per_micro = MOE.num_layers * dispatch_time(MOE, L, W.seq_length, 1, 2, H100)
    assert b.ep_comm_s == pytest.approx(micro * per_micro) and b.ep_hidden_s == 0
    _no_exchanges(monkeypatch)
    bare = iteration_time(MOE, L, W, H100, params_per_rank=10**9)
    # (the data-parallel reduction hides behind the last backward, its exchanges included: apart)
    grown = (b.iteration_s - b.dp_comm_exposed_s) - (bare.iteration_s - bare.dp_comm_exposed_s)
    assert grown == pytest.approx(b.ep_comm_s, rel=1e-9)


@pytest.mark.parametrize("dispatcher,fwd", [("alltoall", 2), ("allgather", 1)])
def test_exchanges_split_forward_and_backward(dispatcher, fwd):
    """Per pass: the all-to-all dispatcher's dispatch and combine (2), the all-gather one's pair (1);
    full recompute runs the forward's again in the backward."""
    L = ParallelLayout(dp=16, ep=16, ep_dispatcher=dispatcher)
    f, b = dispatch_times(MOE, L, 4096, 1, 2, H100)
    assert f == pytest.approx(b) and f > 0
    f2, b2 = dispatch_times(MOE, replace(L, recompute="full"), 4096, 1, 2, H100)
    assert (f2, b2) == pytest.approx((f, 2 * b))
    assert dispatch_time(MOE, L, 4096, 1, 2, H100) == pytest.approx(f + b)
    if dispatcher == "alltoall":  # one exchange: T k h elements over the ep group
        from mpformer.autoconfig.expert_memory import routed_tokens
        from mpformer.autoconfig.links import _collective

        t_r = routed_tokens(MOE, L, 4096, 1)
        assert f == pytest.approx(fwd * _collective(H100, "all_to_all", t_r * 2 * 4096 * 2, 16, True))


def test_stage_exchanges_count_each_stages_sparse_layers():
    """Dense layers (first_k_dense) exchange nothing; recompute_layers=K recomputes the first K of a chunk."""
    m = replace(MOE, first_k_dense=3)
    L = ParallelLayout(dp=16, pp=4, ep=16)
    f, b = stage_exchanges(m, L, 4096, 1, 2, H100, [2, 2, 2, 2])
    one_f, one_b = dispatch_times(m, L, 4096, 1, 2, H100)
    assert f == pytest.approx([0.0, one_f, 2 * one_f, 2 * one_f]) and b == pytest.approx([0.0, one_b, 2 * one_b,
                                                                                          2 * one_b])
    rec = replace(L, recompute="full", recompute_layers=1)
    _, b = stage_exchanges(m, rec, 4096, 1, 2, H100, [2, 2, 2, 2])
    assert b == pytest.approx([0.0, one_b, 3 * one_b, 3 * one_b])  # stage 1's layer 3 is its second: not rerun


def test_dense_model_has_no_exchanges():
    dense = ModelConfig(arch="llama", num_layers=8, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                        ffn_hidden_size=14336, vocab_size=32000, max_position_embeddings=4096)
    b = iteration_time(dense, ParallelLayout(dp=16, pp=4, vpp=2, schedule="dualpipev"), W, H100,
                       params_per_rank=10**9)
    assert b.ep_comm_s == 0 and b.ep_hidden_s == 0
