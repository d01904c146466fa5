"""Iteration time of a plan: per-layer compute from FLOPs and shape-dependent GEMM efficiency,
alpha-beta collectives on the link the rank order implies, the pipeline timeline from simulate.py
on the schedule itself, data-parallel reduction with its overlap, and the optimizer step.

    compute   every GEMM of a layer (qkv, o, mlp up/down, the two attention products) timed as
              FLOPs / (peak x efficiency(m, n, k)); efficiency from the cluster's measured matmul
              table when it has one (local-cpu), else ``GEMM_EFFICIENCY`` x the size term below;
              elementwise work (norms, activations, dropout, residuals) as memory traffic over HBM
    TP / SP   2 all-reduces (or all-gather + reduce-scatter) of s b h per layer in forward and 2 in
              backward, not overlapped (Megatron)
    PP        per-stage F / B / W costs into ``simulate`` with the actual schedule; p2p over the link
              between stages
    DP / ZeRO gradient reduce-scatter or all-reduce overlapped with the backward of the last
              micro-batch; parameter all-gather after the step (stages 1-2) or per layer (stage 3)
    step      the optimizer reads and writes its shard's state, masters and gradients: HBM-bound

Rank order (topology.py): tp fastest, then cp, dp, pp; a group whose ranks span more than one node
runs at the inter-node link's rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.memory import BYTES, Workload, activation_bytes_per_layer
from mpformer.models.config import ModelConfig
from mpformer.parallel.layout import ParallelLayout
from mpformer.pipeline.actions import Schedule
from mpformer.pipeline.simulate import Costs
from mpformer.pipeline.stage import stage_counts

# Fraction of the data-sheet peak a large, well-shaped 16-bit GEMM reaches (cuBLAS on A100/H100
# class parts), and the GEMM size (FLOPs) at which half of that is reached: small GEMMs are
# launch- and tile-bound. Both are device-class constants, not fitted to any run.
GEMM_EFFICIENCY = 0.85
GEMM_HALF_FLOPS = 2.0e9
ELEMENTWISE_PASSES = 4.0  # reads + writes of the layer's activation bytes by non-GEMM kernels, fwd


@dataclass
class Breakdown:
    compute_s: float = 0.0
    tp_comm_s: float = 0.0
    pp_bubble_s: float = 0.0
    p2p_s: float = 0.0
    dp_comm_exposed_s: float = 0.0
    optimizer_s: float = 0.0
    iteration_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra


def gemm_efficiency(cluster: Cluster, dtype: str, m: int, n: int, k: int) -> float:
    table = [r for r in cluster.measured.get("matmul", []) if r["dtype"] == dtype]
    if table:  # nearest measured shape by log FLOPs
        target = math.log(2.0 * m * n * k)
        best = min(table, key=lambda r: abs(math.log(2.0 * r["m"] * r["n"] * r["k"]) - target))
        return best["flops_per_s"] / cluster.peak(dtype)
    flops = 2.0 * m * n * k
    return GEMM_EFFICIENCY * flops / (flops + GEMM_HALF_FLOPS)


def _gemm_time(c: Cluster, dtype: str, m: int, n: int, k: int, batch: int = 1) -> float:
    return batch * 2.0 * m * n * k / (c.peak(dtype) * gemm_efficiency(c, dtype, m, n, k))


def _collective(c: Cluster, kind: str, nbytes: float, n: int, spans_nodes: bool) -> float:
    """Ring time: all-reduce moves 2 (n-1)/n of the buffer, all-gather / reduce-scatter (n-1)/n."""
    if n <= 1:
        return 0.0
    bw, lat = c.link(spans_nodes)
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * ((n - 1) * lat + nbytes * (n - 1) / n / bw)


def layer_times(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster) -> tuple[float, float, float, float]:
    """(F, BI, BW, TP communication) seconds of one layer for one micro-batch on one rank."""
    dt = w.precision if w.precision != "fp32" else "fp32"
    t, s, b, h = L.tp, w.seq_length // L.cp, w.micro_batch_size, m.hidden_size
    d, tokens = m.head_size, s * b
    q, kv = m.num_attention_heads * d // t, max(m.kv_heads // t, 1) * d
    ffn_in = (2 if m.gated_mlp else 1) * m.ffn_size // t
    gemms = [(tokens, q + 2 * kv, h), (tokens, h, q), (tokens, ffn_in, h), (tokens, h, m.ffn_size // t)]
    heads = m.num_attention_heads // t
    attn = 2 * _gemm_time(c, dt, s, s * L.cp, d, batch=b * heads)  # QK^T and AV: local queries, all keys
    f_gemm = sum(_gemm_time(c, dt, *g) for g in gemms)
    elementwise = ELEMENTWISE_PASSES * activation_bytes_per_layer(m, replace(L, recompute="selective"), w)
    if not w.flash_attention:  # scores written, scale-mask-softmax read/write, dropout and its mask
        elementwise += 9.0 * heads * s * s * L.cp * b / L.cp * BYTES[w.precision] / 2
    elementwise /= c.memory_bandwidth
    f = f_gemm + attn + elementwise
    bi = f_gemm + 2 * attn + 2 * elementwise  # input gradients: one GEMM each, attention's two
    bw_ = f_gemm  # weight gradients: one GEMM each
    if L.recompute == "selective":
        bi += attn
    elif L.recompute == "full":
        bi += f
    spans = t > c.devices_per_node
    act = tokens * h * BYTES[w.precision]
    kinds = ("all_gather", "reduce_scatter") if L.sequence_parallel else ("all_reduce", None)
    per = sum(_collective(c, k, act, t, spans) for k in kinds if k)  # one AR, or one AG + one RS
    tp_comm = (6 if L.recompute == "full" else 4) * per  # 2 in forward, 2 in backward, 2 more to recompute
    if L.cp > 1:  # ring attention: cp-1 K/V blocks in, overlapped with the blocks' attention compute
        kv_block = 2 * s * b * kv * BYTES[w.precision]
        bw_cp, lat_cp = c.link(t * L.cp > c.devices_per_node)
        ring = (L.cp - 1) * (lat_cp + kv_block / bw_cp)
        tp_comm += max(ring - attn, 0.0) + max(2 * ring - 2 * attn, 0.0)  # forward; backward (dK, dV too)
    return f, bi, bw_, tp_comm


def head_time(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster) -> float:
    tokens = w.seq_length // L.cp * w.micro_batch_size
    dt = w.precision
    return 3 * _gemm_time(c, dt, tokens, -(-m.vocab_size // L.tp), m.hidden_size)  # forward + 2 backward


@lru_cache(maxsize=64)
def _schedule(name: str, pp: int, microbatches: int, vpp: int) -> Schedule:
    from mpformer.pipeline.schedules import build_schedule

    return build_schedule(name, pp, microbatches, vpp)


def pipeline_time(schedule: str, pp: int, microbatches: int, vpp: int, costs: Costs) -> float:
    """simulate()'s step time of the schedule. Past p micro-batches every schedule here is in its
    steady state, where each further micro-batch adds the same time: the timelines at p and 2p
    micro-batches are simulated and extended linearly (tests check this against the full timeline),
    so a 64-stage pipeline of 512 micro-batches costs two small simulations."""
    from mpformer.pipeline.schedules import min_microbatches
    from mpformer.pipeline.simulate import simulate

    lo, hi = pp, 2 * pp
    if microbatches <= hi or lo < min_microbatches(schedule, pp):
        return simulate(_schedule(schedule, pp, microbatches, vpp), costs, verified=True).step_time
    t_lo = simulate(_schedule(schedule, pp, lo, vpp), costs, verified=True).step_time
    t_hi = simulate(_schedule(schedule, pp, hi, vpp), costs, verified=True).step_time
    return t_hi + (microbatches - hi) * (t_hi - t_lo) / (hi - lo)


def iteration_time(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, *,
                   params_per_rank: int, simulate_pipeline: bool = True) -> Breakdown:
    from mpformer.pipeline.simulate import Costs

    out = Breakdown()
    micro = w.global_batch_size // (w.micro_batch_size * L.dp)
    f, bi, bw_, tp_comm = layer_times(m, L, w, c)
    counts = stage_counts(m, L, w.seq_length)
    split = L.schedule in ("zb-h1", "zb-h2")
    fs = [n * (f + tp_comm / 2) for n in counts]
    bs = [n * (bi + tp_comm / 2 + (0 if split else bw_)) for n in counts]
    ws = [n * bw_ if split else 0.0 for n in counts]
    head = head_time(m, L, w, c)
    fs[-1] += head / 3
    bs[-1] += 2 * head / 3
    boundary = w.seq_length // L.cp * w.micro_batch_size * m.hidden_size * BYTES[w.precision]
    boundary /= L.tp if L.sequence_parallel else 1
    pp_spans = L.tp * L.cp * L.dp >= c.devices_per_node
    bwp, latp = c.link(pp_spans)
    p2p = latp + boundary / bwp if L.pp > 1 else 0.0
    compute_per_micro = sum(fs) + sum(bs) + sum(ws)
    if L.pp > 1 and simulate_pipeline:
        pipe = pipeline_time(L.schedule, L.pp, micro, L.vpp, Costs(f=fs, b=bs, w=ws, p2p=p2p))
    else:  # closed form: (m + p - 1) slots of a stage's work, interleaving shrinks the fill by vpp
        stage_work = (sum(fs) + sum(bs) + sum(ws)) / L.pp
        pipe = (micro + (L.pp - 1) / L.vpp) * stage_work / 1 + (L.pp - 1) * 2 * p2p
    out.compute_s = micro * compute_per_micro / L.pp
    out.tp_comm_s = micro * max(counts) * L.vpp * tp_comm
    out.pp_bubble_s = max(pipe - micro * compute_per_micro / L.pp, 0.0)
    # Data parallel: fp32 gradients reduced, 16-bit (or fp32) parameters gathered.
    dp_spans = L.tp * L.cp * L.dp > c.devices_per_node  # gradients reduce over dp x cp (same weights)
    dp_ranks = L.dp * L.cp
    grads = params_per_rank * 4.0
    wbytes = params_per_rank * BYTES[w.precision]
    if L.zero == 0:
        dp = _collective(c, "all_reduce", grads, dp_ranks, dp_spans)
    elif L.zero in (1, 2):
        dp = _collective(c, "reduce_scatter", grads, dp_ranks, dp_spans) + \
            _collective(c, "all_gather", wbytes, dp_ranks, dp_spans)
        if L.zero == 2:
            dp += (micro - 1) * _collective(c, "reduce_scatter", grads, dp_ranks, dp_spans)
    else:
        dp = micro * (_collective(c, "reduce_scatter", grads, dp_ranks, dp_spans)
                      + 2 * _collective(c, "all_gather", wbytes, dp_ranks, dp_spans))
    overlap = (bs[-1] + ws[-1]) * (micro if L.zero == 3 else 1)  # backward the reduction hides behind
    out.dp_comm_exposed_s = max(dp - 0.8 * overlap, 0.05 * dp) if dp_ranks > 1 else 0.0
    shard = params_per_rank / (L.dp if L.zero >= 1 else 1)
    out.optimizer_s = shard * (2 * (4 + 4 + 8) + 4 + BYTES[w.precision]) / c.memory_bandwidth
    out.p2p_s = p2p
    out.iteration_s = pipe + out.dp_comm_exposed_s + out.optimizer_s
    out.extra["microbatches"] = micro
    return out
