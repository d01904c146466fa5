"""Context parallelism in the auto-configurator: every cp kind of CP_KINDS priced (traffic, overlap,
memory) as the runtime runs it, and the search choosing among them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpformer.autoconfig.cluster import load_cluster
from mpformer.autoconfig.cost import _collective, _p2p, cp_layer_times, iteration_time, layer_times_parts
from mpformer.autoconfig.memory import Workload, plan_memory
from mpformer.autoconfig.search import cp_kinds, cp_values, no_plan_error, search
from mpformer.core.config import FixedPlan
from mpformer.core.errors import ConfigError
from mpformer.core.layout import CP_KINDS, ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.optim.memory import zero_formula_bytes

# Llama 3 8B (configs/model/llama3-8b.yaml): 32 heads, 8 kv heads of 128.
LLAMA8B = ModelConfig(arch="llama", num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                      ffn_hidden_size=14336, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
LONG = Workload(global_batch_size=8, micro_batch_size=1, seq_length=131072, precision="bf16")
H100 = load_cluster("dgx-h100")


def _cp(kind: str, cp: int = 8, u: int = 1, **kw) -> ParallelLayout:
    return ParallelLayout(dp=8 // cp if cp <= 8 else 1, cp=cp, cp_kind=kind, cp_ulysses=u, **kw)


def test_every_kind_is_priced_and_only_those():
    for kind, u in cp_kinds(8, {}):
        fwd, bwd = cp_layer_times(LLAMA8B, _cp(kind, u=u), LONG, H100)
        assert 0 <= fwd <= bwd and 0 < bwd < 1.0, kind  # backward moves at least the forward's bytes
    assert cp_layer_times(LLAMA8B, ParallelLayout(dp=8), LONG, H100) == (0.0, 0.0)
    with pytest.raises(ValueError, match="cp_kind='p2p' has no cost model; priced: ring, allgather, ulysses, hybrid"):
        cp_layer_times(LLAMA8B, _cp("p2p"), LONG, H100)


def test_ring_formula_with_and_without_overlap():
    """Hop = 2 S b k d B over the link (dK/dV hops: the same elements in fp32); forward (cp-1) times the
    part of a hop its block cannot cover; backward: K/V in at the first step, dK/dV out at the last,
    both at the cp-2 between, each step behind the block's backward (2 blocks), then dK/dV home
    exposed; block = attention / cp. A hidden hop still takes the share of the SMs NCCL holds
    (comm_sms / sm_count: 24 of 132 on the H100 preset) from the block it runs beside."""
    L = _cp("ring")
    attn = layer_times_parts(LLAMA8B, L, LONG, H100)[4]
    share = 24 / 132
    assert (H100.comm_sms, H100.sm_count) == (24, 132)
    hop = _p2p(H100, 2 * (131072 // 8) * 1 * 8 * 128 * 2, False)
    dhop = _p2p(H100, 2 * (131072 // 8) * 1 * 8 * 128 * 4, False)
    assert dhop < attn / 8  # 128k tokens: every hop hides behind its block
    assert cp_layer_times(LLAMA8B, L, LONG, H100) == pytest.approx(
        (7 * share * hop, share * (hop + dhop + 6 * (hop + dhop)) + dhop))
    free = replace(H100, comm_sms=0)  # a device whose collectives hold no SMs: hidden hops are free
    assert cp_layer_times(LLAMA8B, L, LONG, free) == pytest.approx((0.0, dhop))
    slow = replace(H100, intra_bandwidth=2e9)  # hops longer than blocks
    hop, block = _p2p(slow, 2 * 16384 * 8 * 128 * 2, False), attn / 8
    dhop = _p2p(slow, 2 * 16384 * 8 * 128 * 4, False)
    assert hop > 2 * block
    fwd, bwd = cp_layer_times(LLAMA8B, L, LONG, slow)
    assert fwd == pytest.approx(7 * (hop - block + share * block))
    held = 2 * block * share  # each backward step overlaps its whole window
    assert bwd == pytest.approx((hop - 2 * block + held) + (dhop - 2 * block + held)
                                + 6 * (hop + dhop - 2 * block + held) + dhop)
    sel = cp_layer_times(LLAMA8B, replace(L, recompute="selective"), LONG, slow)
    assert sel == pytest.approx((fwd, bwd + fwd))  # the checkpointed core runs its ring again
    cpu = replace(load_cluster("local-cpu"), measured={}, devices_per_node=8)  # shared cores: nothing hides
    hop, dhop = _p2p(cpu, 2 * 16384 * 8 * 128 * 2, False), _p2p(cpu, 2 * 16384 * 8 * 128 * 4, False)
    assert cp_layer_times(LLAMA8B, L, LONG, cpu) == pytest.approx((7 * hop, 7 * hop + 8 * dhop))


def test_allgather_exposes_what_the_ring_hides():
    """Same layout, cp=8 in a node: the ring hides its hops behind attention, the all-gather (and the
    backward's reduce-scatter) of the whole sequence's K/V is exposed; across nodes too."""
    gathered = 2 * 131072 * 1 * 8 * 128 * 2
    ag = cp_layer_times(LLAMA8B, _cp("allgather"), LONG, H100)
    assert ag == pytest.approx((_collective(H100, "all_gather", gathered, 8, False),
                                _collective(H100, "reduce_scatter", gathered, 8, False)))
    assert sum(ag) > 2 * sum(cp_layer_times(LLAMA8B, _cp("ring"), LONG, H100))
    two = load_cluster("dgx-h100", nodes=2)
    L = ParallelLayout(dp=1, cp=16, cp_kind="allgather")
    assert sum(cp_layer_times(LLAMA8B, L, LONG, two)) > sum(cp_layer_times(LLAMA8B, replace(L, cp_kind="ring"),
                                                                           LONG, two))
    b_ring = iteration_time(LLAMA8B, replace(_cp("ring"), recompute="full"), LONG, H100, params_per_rank=10**9)
    b_ag = iteration_time(LLAMA8B, replace(_cp("allgather"), recompute="full"), LONG, H100, params_per_rank=10**9)
    assert 0 < b_ring.cp_comm_s < b_ag.cp_comm_s and b_ring.compute_s == pytest.approx(b_ag.compute_s)
    assert iteration_time(LLAMA8B, ParallelLayout(dp=8), LONG, H100, params_per_rank=10**9).cp_comm_s == 0.0


def test_ulysses_volume_and_kv_replication():
    """All-to-all of a tensor of H heads per rank moves (U-1)/U of S b max(H, U) d B: q and the output
    (32 heads), k and v (8 kv heads, repeated to U=16 at cp=16). No latency, so bytes / bandwidth."""
    c = replace(load_cluster("dgx-h100", nodes=2), intra_latency=0.0, inter_latency=0.0)

    def a2a(u: int, heads: int, spans: bool) -> float:
        bw = (c.inter_bandwidth if spans else c.intra_bandwidth) * c.bus_fraction[spans]  # NCCL's share of the link
        return (u - 1) / u * (131072 // u) * max(heads, u) * 128 * 2 / bw

    for u in (8, 16):
        want = 2 * a2a(u, 32, u > 8) + 2 * a2a(u, 8, u > 8)
        L = ParallelLayout(dp=16 // u, cp=u, cp_kind="ulysses")
        assert cp_layer_times(LLAMA8B, L, LONG, c) == pytest.approx((want, want))
    # replication: at U=16 each rank receives a whole kv head, twice the bytes of 8 kv heads cut 16 ways
    assert a2a(16, 8, False) == pytest.approx(2 * (15 / 16) * (131072 // 16) * 8 * 128 * 2
                                              / (c.intra_bandwidth * c.bus_fraction[0]))


def test_hybrid_is_ulysses_inside_a_ring():
    """cp=16 over two nodes, U=8 in a node: all-to-all over 8 ranks, then a ring of 2 across the nodes
    carrying the post-all-to-all K/V (8 times the positions, 1 kv head)."""
    c = replace(load_cluster("dgx-h100", nodes=2), inter_bandwidth=1e9)
    L = ParallelLayout(dp=1, cp=16, cp_kind="hybrid", cp_ulysses=8)
    attn = layer_times_parts(LLAMA8B, L, LONG, c)[4]
    s = 131072 // 16
    a2a = 2 * _collective(c, "all_to_all", s * 32 * 128 * 2, 8, False) + \
        2 * _collective(c, "all_to_all", s * 8 * 128 * 2, 8, False)
    hop, block = _p2p(c, 2 * 8 * s * 1 * 128 * 2, True), attn / 2
    dhop = _p2p(c, 2 * 8 * s * 1 * 128 * 4, True)  # dK/dV in fp32
    fwd, bwd = cp_layer_times(LLAMA8B, L, LONG, c)
    share = c.comm_sms / c.sm_count  # a hidden hop still holds NCCL's SMs (links.beside)

    def beside(comm: float, window: float) -> float:
        return max(comm - window, 0.0) + share * min(comm, window)

    assert fwd == pytest.approx(a2a + beside(hop, block))
    assert bwd == pytest.approx(a2a + beside(hop, 2 * block) + beside(dhop, 2 * block) + dhop)
    ring = sum(cp_layer_times(LLAMA8B, replace(L, cp_kind="ring", cp_ulysses=1), LONG, c))
    assert fwd + bwd < ring  # the slow link carries one hop instead of fifteen


def test_memory_per_rank_falls_as_one_over_cp():
    # The unfused head (fp32 logits) scales with the tokens too; the fused one keeps a weight-sized
    # gradient buffer that cp does not divide (test_autoconfig_memory's head test).
    w = replace(LONG, seq_length=32768, fused_cross_entropy=False)
    one = plan_memory(LLAMA8B, ParallelLayout(dp=8, recompute="selective"), w)[0]
    for kind in ("ring", "ulysses"):
        for cp in (2, 4, 8):
            L = ParallelLayout(dp=8 // cp, cp=cp, cp_kind=kind, recompute="selective")
            assert plan_memory(LLAMA8B, L, w)[0].activations == pytest.approx(one.activations / cp, rel=1e-9)
    # ZeRO shards over dp x cp (the cp ranks hold the same weights)
    z1 = plan_memory(LLAMA8B, ParallelLayout(dp=2, cp=4, zero=1, recompute="selective"), w)[0]
    assert z1.model_state == pytest.approx(zero_formula_bytes(1, z1.params, 8, w=2, g=4, m=4, k=8))


def test_allgather_keeps_the_whole_sequence_kv():
    """Without recompute each layer keeps the gathered K/V, 2 s b k d B, of which this rank's own
    2 (s/cp) b k d B is counted with the layer; Ulysses keeps kv heads repeated to U (U > k). With
    selective recompute only the layer recomputing holds it, in its backward (with a small vocabulary the
    peak falls there; with Llama 3's the head's gradients are the peak, and the K/V is gone by then)."""
    w = replace(LONG, seq_length=32768)
    ring = plan_memory(LLAMA8B, _cp("ring"), w)[0].activations
    ag = plan_memory(LLAMA8B, _cp("allgather"), w)[0].activations
    assert ag - ring == pytest.approx(32 * 2 * (32768 - 32768 // 8) * 8 * 128 * 2)
    small = replace(LLAMA8B, vocab_size=1024)
    sel = [plan_memory(small, _cp(k, recompute="selective"), w)[0] for k in ("ring", "allgather")]
    assert sel[0].phase == sel[1].phase == "layer backward"
    assert sel[1].activations - sel[0].activations == pytest.approx(2 * (32768 - 32768 // 8) * 8 * 128 * 2)
    u16 = ParallelLayout(dp=1, cp=16, cp_kind="ulysses")  # U = 16 > 8 kv heads: each repeated twice
    r16 = plan_memory(LLAMA8B, replace(u16, cp_kind="ring"), w)[0].activations
    assert plan_memory(LLAMA8B, u16, w)[0].activations - r16 == pytest.approx(32 * 2 * (32768 // 16) * 8 * 128 * 2)


def test_cp_values_and_kinds():
    assert cp_values(8, 131072) == [1, 2, 4, 8]
    assert cp_values(512, 2048) == [1]  # a rank's share would fall under MIN_CP_TOKENS
    assert cp_values(12, 8192) == [1, 2, 4]
    assert cp_kinds(8, {}) == [("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2), ("hybrid", 4)]
    assert {k for k, _ in cp_kinds(16, {})} == set(CP_KINDS)
    assert cp_kinds(2, {}) == [("ring", 1), ("allgather", 1), ("ulysses", 1)]  # no hybrid degree at cp=2
    assert cp_kinds(1, {}) == [("ring", 1)]
    assert cp_kinds(8, {"cp_kind": "hybrid"}) == [("hybrid", 2), ("hybrid", 4)]
    assert cp_kinds(8, {"cp_ulysses": 4}) == [("hybrid", 4)]
    assert cp_kinds(2, {"cp_kind": "hybrid"}) == [("hybrid", 1)]  # validate() explains


def test_search_picks_cp_for_a_long_sequence():
    """Llama 3 8B at 128k tokens on one 8 x H100 node: cp > 1 wins; without cp only tp=8 with full
    recompute fits, slower. At 256k without cp only full recompute fits (each layer's input, s b h / t
    under sequence parallelism, and one layer recomputed) and cp still wins unless activations are
    offloaded (a tp=4 pp=2 interleaved pipeline offloading every layer's input is then 1% faster than
    cp=8: the host takes what cp would split); at 1M nothing without cp."""
    res = search(LLAMA8B, H100, LONG)
    best = res.top[0]
    assert best.layout.cp > 1 and best.memory_bytes <= H100.usable_bytes
    assert all(c.layout.cp_kind in CP_KINDS for c in res.feasible)
    no_cp = search(LLAMA8B, H100, LONG, fixed={"cp": 1})
    assert not no_cp.top or no_cp.top[0].time.iteration_s > best.time.iteration_s
    longer = replace(LONG, seq_length=262144)
    full = search(LLAMA8B, H100, longer, fixed={"cp": 1})
    assert full.feasible and {c.layout.recompute for c in full.feasible} == {"full"}
    assert search(LLAMA8B, H100, longer, fixed={"offload": "none"}).top[0].layout.cp > 1
    none = search(LLAMA8B, H100, replace(LONG, seq_length=1048576), fixed={"cp": 1})
    assert not none.top and "no layout fits dgx-h100" in str(no_plan_error(none, H100))


@pytest.mark.parametrize("fixed", [{"cp_kind": "allgather"}, {"cp_kind": "ulysses"},
                                   {"cp_kind": "hybrid", "cp_ulysses": 2}, {"cp_ulysses": 4}])
def test_pinned_cp_kind(fixed):
    pinned = FixedPlan(cp=8, **fixed).pinned()
    res = search(LLAMA8B, H100, LONG, fixed=pinned, top_k=3)
    assert res.top
    for c in res.top:
        assert c.layout.cp == 8 and all(c.plan()[k] == v for k, v in pinned.items())
        assert c.plan()["cp_kind"] == fixed.get("cp_kind", "hybrid")
        assert c.time.cp_comm_s > 0
        assert f"parallel.cp_kind={c.layout.cp_kind}" in c.overrides()


def test_pinned_kinds_that_cannot_run_are_explained():
    with pytest.raises(ConfigError, match=r"parallel\.cp_kind='p2p' is unknown; valid: ring, allgather, ulysses"):
        raise no_plan_error(search(LLAMA8B, H100, LONG, fixed={"cp": 8, "cp_kind": "p2p"}), H100)
    with pytest.raises(ConfigError, match=r"parallel\.cp_ulysses=1 at cp=2: hybrid needs a Ulysses degree"):
        raise no_plan_error(search(LLAMA8B, H100, LONG, fixed={"cp": 2, "cp_kind": "hybrid"}), H100)
    # Ulysses over 8 ranks at tp=8 would split 4 heads per tp rank 8 ways: validate() rejects it
    eight = load_cluster("dgx-h100", nodes=8)
    res = search(LLAMA8B, eight, LONG, fixed={"tp": 8, "cp": 8, "cp_kind": "ulysses"})
    assert not res.top and "parallel.cp=8 with cp_kind=ulysses does not divide the 4 attention heads per tp rank" \
        in str(no_plan_error(res, eight))
    assert search(LLAMA8B, eight, LONG, fixed={"tp": 8, "cp": 8}).top[0].layout.cp_kind != "ulysses"


def test_recompute_of_the_first_layers_is_priced_layer_by_layer():
    """parallel.recompute_layers=K: K layers of each chunk at the recompute mode's memory and time, the
    others as without recompute; K = 0 is no recompute, K = all layers is the mode everywhere."""
    w = replace(LONG, seq_length=8192)
    base = ParallelLayout(dp=2, pp=4, schedule="1f1b")
    per = {}
    for k in (None, 0, 2, 4, 6, 8):
        L = replace(base, recompute="full", recompute_layers=k)
        per[k] = (plan_memory(LLAMA8B, L, w)[0].activations,
                  iteration_time(LLAMA8B, L, w, H100, params_per_rank=10**9).compute_s)
    none = (plan_memory(LLAMA8B, base, w)[0].activations,
            iteration_time(LLAMA8B, base, w, H100, params_per_rank=10**9).compute_s)
    assert per[0] == pytest.approx(none)
    assert per[8] == pytest.approx(per[None])  # 8 layers per stage: all of them
    for i in (0, 1):  # memory falls and compute rises by the same step for every further layer
        assert per[2][i] - per[4][i] == pytest.approx(per[4][i] - per[6][i])
        assert (per[2][i] - per[4][i]) * (none[i] - per[None][i]) > 0
