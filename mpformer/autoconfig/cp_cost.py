"""The context-parallel traffic of one layer that attention does not hide, per cp kind.

Every kind shares the zigzag split (core/sequence.py): s/cp positions per rank and the same attention
FLOPs (one rank's queries against every key). What differs is the traffic and how much of it hides:

    ring      K/V (kv heads only) hop cp-1 times in forward, each hop behind one block of attention
              (exposed: max(0, hop - block)); in backward K/V hop cp-1 times again and dK/dV cp times,
              behind the blocks' backward, the last dK/dV hop exposed
    allgather one all-gather of K/V over cp in forward, one reduce-scatter of dK/dV in backward, exposed
              (Llama 3)
    ulysses   all-to-all of q, k, v in and of the output back, four more in backward, over U = cp ranks;
              kv heads replicated to U when U exceeds them (more bytes)
    hybrid    Ulysses over U = cp_ulysses ranks inside a ring over cp / U ranks that carries the
              post-all-to-all K/V (heads / U per rank, U s/cp positions)
    selective or full recompute reruns the attention core and with it its forward's traffic

On a CPU host whose ranks share the cores, what the profile measured replaces the traffic model: each
kind's attention at each cp degree, with every rank busy, beyond the fused kernel the compute model
times (``measured_on_host``). There, a ring step's wait is a small part of it: the blockwise kernels
are many small ops on small tensors, and no core is free to hide a wait behind.
"""

from __future__ import annotations

from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.links import _collective, _p2p, beside
from mpformer.autoconfig.memory import BYTES, Workload
from mpformer.autoconfig.sharing import slowdowns
from mpformer.core.layout import CP_KINDS, ParallelLayout, ulysses_degree
from mpformer.core.model_config import ModelConfig


def cp_traffic(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, attn: float) -> tuple[float, float]:
    """Exposed context-parallel communication of one layer for one micro-batch: (forward, backward).
    ``attn``: the rank's attention forward (its queries against every key), which ring hops hide behind
    block by block; on a CPU host whose ranks share the cores nothing hides (no core is free).

    Bytes per rank, S = s/cp positions, b micro-batch, d head size, k and n kv and query heads per tp
    rank, B bytes per activation element. Ring hop: 2 S b k d B (dK/dV hops: 2 S b k d fp32 values,
    exact partial sums).
    All-gather / reduce-scatter: the gathered 2 s b k d B. Ulysses all-to-all of a tensor of H heads:
    S b max(H, U) d B, of which (U-1)/U leaves the rank (kv heads repeated to U when U exceeds them:
    every rank receives whole heads). Megatron-LM's context parallelism (--cp-comm-type p2p |
    allgather | a2a | a2a+p2p) and DeepSpeed-Ulysses (Jacobs et al. 2023: 4 N h / P elements per link
    for q, k, v and the output) move the same volumes; docs/formulas.md derives them (no published cp formula)."""
    if L.cp == 1:
        return 0.0, 0.0
    if L.cp_kind not in _CP_PRICED:
        raise ValueError(f"cp_kind={L.cp_kind!r} has no cost model; priced: {', '.join(_CP_PRICED)}")
    measured = measured_on_host(m, L, w, c)
    if measured is not None:
        fwd, bwd = measured
        return fwd, bwd + (fwd if L.recompute != "none" else 0.0)
    wb, b, d = BYTES[w.precision], w.micro_batch_size, m.head_size
    seq, heads, kv = w.seq_length // L.cp, m.num_attention_heads // L.tp, max(m.kv_heads // L.tp, 1)
    u = ulysses_degree(L)
    spans_cp = L.tp * L.cp > c.devices_per_node
    fwd = bwd = 0.0
    if u > 1:  # q, k, v scattered by heads and gathered by sequence; the output back; the same four in backward
        spans_u = L.tp * u > c.devices_per_node

        def a2a(h: int) -> float:
            return _collective(c, "all_to_all", seq * b * max(h, u) * d * wb, u, spans_u)

        fwd = bwd = 2 * a2a(heads) + 2 * a2a(kv)
        seq, kv = seq * u, max(kv, u) // u  # what the ring (hybrid) then carries
    ring = L.cp // u
    if L.cp_kind == "allgather":
        gathered = 2 * L.cp * seq * b * kv * d * wb
        fwd += _collective(c, "all_gather", gathered, L.cp, spans_cp)
        bwd += _collective(c, "reduce_scatter", gathered, L.cp, spans_cp)
    elif ring > 1:  # ring, or hybrid's ring of Ulysses groups
        hop = _p2p(c, 2 * seq * b * kv * d * wb, spans_cp)
        dhop = _p2p(c, 2 * seq * b * kv * d * 4, spans_cp)  # dK/dV partial sums travel in fp32 (ring.py)
        block = attn / ring if slowdowns(c) is None else 0.0
        fwd += (ring - 1) * beside(c, hop, block)
        # backward step j: K/V in for step j+1 (j < R-1), dK/dV of step j-1 out (j > 0), behind the
        # block's backward (twice its forward); then the last block's dK/dV home, exposed. A hop hidden
        # behind a block still holds SMs of it (links.beside).
        bwd += (beside(c, hop, 2 * block) + beside(c, dhop, 2 * block)
                + (ring - 2) * beside(c, hop + dhop, 2 * block) + dhop)
    if L.recompute != "none":  # the checkpointed attention core runs its forward again, traffic included
        bwd += fwd
    return fwd, bwd


_CP_PRICED = ("ring", "allgather", "ulysses", "hybrid")
assert set(_CP_PRICED) == set(CP_KINDS), "cp_cost.py must price exactly the cp kinds the runtime has (CP_KINDS)"


def measured_on_host(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster) -> tuple[float, float] | None:
    """A CPU host whose profile measured this cp kind at this degree (profile_ranks.py, every rank
    busy): (forward, backward) seconds of one layer's attention beyond the fused kernel the compute
    model times for a cp rank, on the line through the profile's two sequence lengths in the score
    elements per rank (heads / tp x b x s x s / cp), never below zero, split a third to the forward
    as compute.py splits the fused kernel. On shared cores this is mostly not traffic: a ring step's
    wait is short next to the blockwise kernels' many small ops (context_parallel/blockwise.py) and
    the stacking, merging and copying around them, which the fused-kernel table does not see;
    measured, not counted, because they are the implementation's. The line carries the fixed part
    (waits, ops per call) and the part that grows with the scores to other shapes; kv heads and head
    size enter only through it (the reference's are 2 and 64), and it was measured in fp32. None
    elsewhere (accelerators, groups across nodes, kinds or degrees the profile did not run: the
    traffic model above prices them)."""
    fit = c.measured.get("cp_attention", {}).get(f"{L.cp_kind}/{L.cp}")
    if fit is None or slowdowns(c) is None or L.tp * L.cp > c.devices_per_node:
        return None
    rows = sorted(fit["rows"], key=lambda r: r["scores_per_rank"])
    (p0, e0), (p1, e1) = ((r["scores_per_rank"], r["extra_s"]) for r in (rows[0], rows[-1]))
    slope = max((e1 - e0) / (p1 - p0), 0.0) if p1 > p0 else 0.0
    scores = m.num_attention_heads // L.tp * w.micro_batch_size * w.seq_length ** 2 / L.cp
    extra = max(e1 + slope * (scores - p1), 0.0)
    return extra / 3, 2 * extra / 3
