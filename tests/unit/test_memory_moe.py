"""The memory and cost models for a mixture of experts (autoconfig/expert_memory.py, expert_cost.py).

Formula checks: a sparse layer's expert parameters per rank at several ep / etp, their ZeRO state over
the expert-data group (dp cp / ep) against the ZeRO table; a dense model unchanged; a sparse layer's
saved activations against autograd's saved tensors (the oracle: torch's saved-tensor hooks on one MoE
block); the search choosing ep > 1 when the experts' state does not fit at ep = 1; a bad pin refused.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpformer.autoconfig.expert_cost import dispatch_time, dp_share, moe_gemms
from mpformer.autoconfig.expert_memory import expert_params, moe_saved_bytes
from mpformer.autoconfig.layer_memory import layer_bytes
from mpformer.autoconfig.memory import Workload, plan_memory, stage_params
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.optim.memory import zero_formula_bytes
from mpformer.testing.memory import saved_layer_bytes

S, B = 128, 2
MOE = ModelConfig(arch="mixtral", num_layers=2, hidden_size=128, num_attention_heads=8, num_kv_heads=2,
                  ffn_hidden_size=96, vocab_size=512, max_position_embeddings=S, mlp_kind="moe", num_experts=8,
                  num_experts_per_tok=2, moe_ffn_hidden_size=96)
DENSE = ModelConfig(arch="llama", num_layers=2, hidden_size=128, num_attention_heads=8, num_kv_heads=2,
                    ffn_hidden_size=96, vocab_size=512, max_position_embeddings=S)


@pytest.mark.parametrize("ep,etp,tp", [(1, 1, 1), (2, 1, 1), (4, 1, 1), (8, 1, 1), (2, 2, 2), (2, 1, 2), (4, 4, 4)])
def test_expert_params_per_rank(ep, etp, tp):
    """E/ep experts each 3 h f / etp: 8 experts of 3 x 128 x 96."""
    L = ParallelLayout(dp=8 // tp if tp < 8 else 1, tp=tp, ep=ep, etp=etp)
    assert expert_params(MOE, L, "moe") == (8 // ep) * 3 * 128 * (96 // etp)
    assert expert_params(MOE, L, "dense") == 0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_state_is_sharded_over_the_expert_data_group(zero, ep):
    """Model state = the ZeRO table for the dense parameters over dp cp, and for the experts over dp cp / ep."""
    L = ParallelLayout(dp=4, zero=zero, ep=ep)
    w = Workload(8, 2, S, "fp32")
    (st,) = plan_memory(MOE, L, w, device="cuda")
    n = stage_params(MOE, L, 2, True, True, [0, 1])
    n_e = 2 * (8 // ep) * 3 * 128 * 96
    want = sum(zero_formula_bytes(zero, k, d, w=4, g=4, m=0, k=8) for k, d in ((n - n_e, 4), (n_e, 4 // ep)))
    assert st.model_state == pytest.approx(want)
    assert st.params == n


def test_dense_model_unchanged():
    """A dense model's state and its plans read as before: no expert fields, no expert parameters."""
    from mpformer.autoconfig.candidates import Candidate
    from mpformer.autoconfig.cost import Breakdown

    L = ParallelLayout(dp=4, zero=1)
    (st,) = plan_memory(DENSE, L, Workload(8, 2, S, "fp32"))
    n = stage_params(DENSE, L, 2, True, True)
    assert st.model_state == pytest.approx(zero_formula_bytes(1, n, 4, w=4, g=4, m=0, k=8))
    assert "ep" not in Candidate(L, 2, 0.0, Breakdown()).plan()
    assert Candidate(replace(L, ep=2, etp=1), 2, 0.0, Breakdown()).plan()["ep"] == 2


@pytest.mark.parametrize("precision,recompute,want", [
    ("fp32", "none", 2329600), ("fp32", "selective", 1567744), ("fp32", "full", 131072),
    ("bf16", "none", 1330176), ("bf16", "selective", 945152), ("bf16", "full", 65536)])
def test_saved_bytes_match_autograd(precision, recompute, want):
    """What autograd saves for one MoE block (saved-tensor hooks, measured as tests/unit/test_layer_memory.py
    does for dense blocks; the values here were taken so and are re-measured below for fp32)."""
    assert layer_bytes(MOE, ParallelLayout(recompute=recompute), S, B, precision, kind="moe").saved == want


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_saved_bytes_measured(recompute, monkeypatch):
    import torch

    from mpformer.core.model_options import ModelOptions
    from mpformer.models.transformer import Transformer
    from mpformer.parallel import kernels

    monkeypatch.setenv("MPFORMER_CPU_DGRAD", "nn")
    monkeypatch.setenv("MPFORMER_CPU_ATTENTION", "native")
    kernels.process_kernels.cache_clear()
    kernels.process_attention.cache_clear()
    model = Transformer(MOE, ModelOptions(recompute=recompute), seed=1)
    tokens = torch.randint(0, MOE.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    seq = model.sequence(tokens)
    x = model.embed_tokens(tokens, seq).detach().requires_grad_()
    got = saved_layer_bytes(model, seq, x)
    kernels.process_kernels.cache_clear()
    kernels.process_attention.cache_clear()
    assert got == layer_bytes(MOE, ParallelLayout(recompute=recompute), S, B, "fp32", kind="moe").saved


def test_expert_rows_scale_with_ep_and_capacity():
    """The dispatched rows and the experts' activations do not shrink with ep (T k rows on average per rank);
    a capacity factor below 1 bounds them."""
    a = moe_saved_bytes(MOE, ParallelLayout(dp=2), S, B, 4, "none")
    assert moe_saved_bytes(MOE, ParallelLayout(dp=2, ep=2), S, B, 4, "none") == a
    assert moe_saved_bytes(replace(MOE, capacity_factor=0.5), ParallelLayout(dp=2), S, B, 4, "none") < a


def test_expert_gemms_and_exchange():
    """E/ep grouped GEMMs of T k ep / E rows; the all-to-all priced 4 times, inside a node or across."""
    from mpformer.autoconfig.cluster import load_cluster

    L = ParallelLayout(dp=4, ep=4)
    router, up, down = moe_gemms(MOE, L, S, B)
    assert router == (S * B, 8, 128, 1)
    assert up == (S * B * 2 * 4 // 8, 2 * 96, 128, 2) and down == (S * B * 2 * 4 // 8, 128, 96, 2)
    c = load_cluster("dgx-h100")
    inside = dispatch_time(MOE, L, S, B, 2, c)
    assert inside > 0 and dispatch_time(MOE, ParallelLayout(dp=4), S, B, 2, c) == 0
    across = dispatch_time(MOE, ParallelLayout(dp=4, tp=4, ep=4), S, B, 2, c)  # tp x ep = 16 > 8 devices
    assert across > inside
    assert dp_share(ParallelLayout(dp=4, ep=4), 100, 60) == 40  # expert-data group of one rank: no reduction


def test_search_picks_ep_when_the_experts_do_not_fit():
    """Many large experts: their state alone at ep = 1 exceeds a device; the search splits them."""
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.search import search

    m = ModelConfig(arch="mixtral", num_layers=4, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, vocab_size=32000, max_position_embeddings=4096, mlp_kind="moe",
                    num_experts=16, num_experts_per_tok=2, moe_ffn_hidden_size=14336)
    c = load_cluster("dgx-h100")
    res = search(m, c, Workload(64, 1, 4096, "bf16"), fixed={"pp": 1, "tp": 1, "cp": 1, "zero": 1}, top_k=3)
    assert res.top and all(t.layout.ep > 1 for t in res.top)
    assert "ep=" in res.top[0].overrides()
    at_one = plan_memory(m, ParallelLayout(dp=8, zero=1, recompute="full", ep=1, etp=1), Workload(64, 1, 4096, "bf16"))
    assert at_one[0].total > c.usable_bytes  # even fully recomputed, ep = 1 does not fit


def test_bad_ep_pin_is_refused():
    """An ep that does not divide the experts: no valid layout, and the reason names the rule."""
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.search import no_plan_error, search

    res = search(MOE, load_cluster("dgx-h100"), Workload(64, 1, S, "bf16"), fixed={"ep": 3, "tp": 1, "pp": 1})
    assert not res.top
    assert "parallel.ep=3" in str(no_plan_error(res, load_cluster("dgx-h100")))


@pytest.mark.parametrize("edp", [1, 2, 8])
def test_expert_buckets_reduce_over_the_expert_data_group(edp):
    """The engine buckets each mesh view apart (optim/engine.py _plan): the routed experts' gradients fill
    buckets of their own, reduced and sharded over the expert-data group (dp cp / ep ranks); over a group
    of one rank (ep = dp cp) the engine only divides in place (optim/bucket.py launch), so the reduction
    holds nothing beside its buffer. (Was: every bucket's shard over dp cp: a Mixtral 8x7B last stage at
    ep = dp = 8, ZeRO-1, held 5.6 GB of expert shards the model read as 0.7 GB.)"""
    from mpformer.autoconfig.step_memory import ReductionSpec, Unit, buckets, comm_bytes

    layer = Unit("layer", [10, 40, 20, 5], 0.0, expert=(40, 20))  # norms, experts' gate|up and down, router
    red = ReductionSpec(1, 8, 4, 4, 60, 2, False, edp=edp)
    plan = buckets([layer, layer], red)
    assert [(b.elems, b.expert, b.first, b.last) for b in plan] == [
        (60.0, True, 0, 0), (30.0, False, 0, 1), (60.0, True, 1, 1)]  # the experts' last first, capped at 60
    assert comm_bytes(60.0, red, expert=True) == (0.0 if edp == 1 else 60 * 4 / edp)
    assert comm_bytes(30.0, red) == 30 * 4 / 8
    assert comm_bytes(30.0, replace(red, dp=1)) == 0.0  # a dense group of one: nothing either


def test_a_group_of_one_only_divides_in_place():
    """optim/bucket.py: a bucket whose group has one rank launches no collective and takes no buffer; its
    shard (the whole buffer at ZeRO-1) holds the division."""
    import torch

    from mpformer.core.buffers import plan_buckets
    from mpformer.optim.bucket import Bucket

    (lay,) = plan_buckets([6, 2], dp=1, cap=100)
    grads = torch.arange(8, dtype=torch.float32)

    class One:  # a Comm of one rank: reaching a collective is the failure
        size = 1

    b = Bucket(lay, [], torch.zeros(8), None, grads[0:8], grads)
    b.launch(One(), 1, torch.bfloat16, True, replicas=4)
    assert b.pending[0] is None and b.pending[2] is b.grad_shard
    b.complete(1, True)
    assert torch.equal(grads, torch.arange(8, dtype=torch.float32) / 4)
