"""Iteration time of a plan: per-layer compute from FLOPs and shape-dependent GEMM efficiency,
alpha-beta collectives on the link the rank order implies, the pipeline timeline from simulate.py
on the schedule itself, data-parallel reduction with its overlap, and the optimizer step.

    compute   every GEMM of a layer (qkv, o, mlp up/down, the two attention products) timed as
              FLOPs / (peak x efficiency(m, n, k)); efficiency from the cluster's measured matmul
              table when it has one (local-cpu), else ``GEMM_EFFICIENCY`` x the size term below;
              elementwise work (norms, activations, dropout, residuals) as memory traffic over HBM
    TP / SP   2 all-reduces (or all-gather + reduce-scatter) of s b h per layer in forward and 2 in
              backward, not overlapped (Megatron)
    CP        per layer, the traffic each cp kind does not hide behind attention (cp_cost.py); selective
              or full recompute reruns the attention core and with it its forward's traffic
    PP        per-stage F / B / W costs into ``simulate`` with the actual schedule; p2p over the link
              between stages
    DP / ZeRO gradient reduce-scatter or all-reduce overlapped with the backward of the last
              micro-batch; parameter all-gather after the step (stages 1-2) or per layer (stage 3)
    step      the optimizer reads and writes its shard's state, masters and gradients: HBM-bound

Rank order (topology.py): tp fastest, then cp (its Ulysses ranks fastest inside it: cp rank = u + U r),
dp, pp; a group whose ranks span more than one node runs at the inter-node link's rate. Gradients of
the weights (replicated over dp and cp) reduce, and ZeRO shards, over dp x cp ranks.

A CPU host (a cluster with ``cores``, local-cpu) runs several ranks on shared cores. Its measured
profile (profile.py) gives kernel rates by shape, attention's fused kernel, the slowdown of each rank
while k ranks compute at once (sharing.py's ``slowdowns``), collective alpha-beta fits taken with
every rank busy, and a reference model's measurements from which calibration.py takes its
corrections: framework overhead on compute, the split backward, what a pipeline of each depth and
the tensor-parallel waits cost beyond this model. Compute while all ranks are busy runs
slowdown(all) times slower; a pipeline's timeline is the processor-sharing fixed point of
sharing.py's ``shared_step_time`` (an idle rank lends its core) times the depth's correction;
gradient reduction does not overlap compute there (no core is free to run it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

from mpformer.autoconfig.calibration import SPLIT, Calibration, clamp
from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.cp_cost import cp_traffic
from mpformer.autoconfig.links import RING_FACTOR, _collective, _p2p  # noqa: F401  (RING_FACTOR: re-exported)
from mpformer.autoconfig.memory import BYTES, Workload, activation_bytes_per_layer
from mpformer.autoconfig.sharing import interpolate, shared_step_time, slowdowns
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.pipeline_plan import stage_counts
from mpformer.pipeline.actions import Schedule
from mpformer.pipeline.simulate import Costs

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
    cp_comm_s: float = 0.0  # context-parallel traffic not hidden behind attention (on the slowest rank)
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
    if table:  # the nearest measured shape, distance in log m, log n, log k (aspect matters, not just size)
        def dist(r: dict) -> float:
            return sum(abs(math.log(a / r[key])) for a, key in ((m, "m"), (n, "n"), (k, "k")))

        return min(table, key=dist)["flops_per_s"] / cluster.peak(dtype)
    flops = 2.0 * m * n * k
    return GEMM_EFFICIENCY * flops / (flops + GEMM_HALF_FLOPS)


def _gemm_time(c: Cluster, dtype: str, m: int, n: int, k: int, batch: int = 1) -> float:
    return batch * 2.0 * m * n * k / (c.peak(dtype) * gemm_efficiency(c, dtype, m, n, k))


def _attention_time(c: Cluster, dtype: str, s_q: int, s_k: int, d: int, heads: int) -> float:
    """Forward time of attention over ``heads`` (batch x heads) heads: from the profile's measured fused
    kernel (forward + backward, a third of it; scaled by s_q s_k d from the nearest shape), else its
    two GEMMs (QK^T and AV: local queries, all keys)."""
    table = [r for r in c.measured.get("attention", []) if r["dtype"] == dtype]
    if table:
        row = min(table, key=lambda r: abs(math.log(s_q / r["seq"])) + abs(math.log(d / r["head_dim"])))
        scale = s_q * s_k * d / (row["seq"] ** 2 * row["head_dim"])
        return heads * row["seconds_per_head"] * scale / 3
    return 2 * _gemm_time(c, dtype, s_q, s_k, d, batch=heads)


def layer_times(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster) -> tuple[float, float, float, float]:
    """(F, BI, BW, TP + CP communication) seconds of one layer for one micro-batch on one rank."""
    f, bi, bw_, tp_comm, attn = layer_times_parts(m, L, w, c)
    return f, bi, bw_, tp_comm + sum(cp_layer_times(m, L, w, c, attn))


def layer_times_parts(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster
                      ) -> tuple[float, float, float, float, float]:
    """(F, BI, BW, TP communication, attention forward) seconds of one layer, one micro-batch, one rank."""
    dt = w.precision if w.precision != "fp32" else "fp32"
    t, s, b, h = L.tp, w.seq_length // L.cp, w.micro_batch_size, m.hidden_size
    d, tokens = m.head_size, s * b
    q, kv = m.num_attention_heads * d // t, max(m.kv_heads // t, 1) * d
    ffn_in = (2 if m.gated_mlp else 1) * m.ffn_size // t
    gemms = [(tokens, q + 2 * kv, h), (tokens, h, q), (tokens, ffn_in, h), (tokens, h, m.ffn_size // t)]
    heads = m.num_attention_heads // t
    attn = _attention_time(c, dt, s, s * L.cp, d, b * heads)
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
    return f, bi, bw_, tp_comm, attn


def cp_layer_times(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, attn: float | None = None
                   ) -> tuple[float, float]:
    """Exposed context-parallel communication of one layer for one micro-batch: (forward, backward),
    priced in cp_cost.py; ``attn``: the rank's attention forward (computed when not given)."""
    if L.cp == 1:
        return 0.0, 0.0
    return cp_traffic(m, L, w, c, layer_times_parts(m, L, w, c)[4] if attn is None else attn)


def head_time(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster) -> float:
    """LM head forward + backward: three GEMMs, and the fp32 logits' softmax cross-entropy (written,
    read for the max and the sum, gradient written and read: about 6 passes)."""
    tokens = w.seq_length // L.cp * w.micro_batch_size
    vocab = -(-m.vocab_size // L.tp)
    logits = 6.0 * tokens * vocab * 4 / c.memory_bandwidth
    return 3 * _gemm_time(c, w.precision, tokens, vocab, m.hidden_size) + logits


@lru_cache(maxsize=64)
def _schedule(name: str, pp: int, microbatches: int, vpp: int) -> Schedule:
    from mpformer.pipeline.schedules import build_schedule

    return build_schedule(name, pp, microbatches, vpp)


def pipeline_time(schedule: str, pp: int, microbatches: int, vpp: int, costs: Costs,
                  dilation: Callable[[int], float] | None = None) -> float:
    """simulate()'s step time of the schedule. Past p micro-batches every schedule here is in its
    steady state, where each further micro-batch adds the same time: the timelines at p and 2p
    micro-batches are simulated and extended linearly (tests check this against the full timeline),
    so a 64-stage pipeline of 512 micro-batches costs two small simulations.

    ``dilation(k)``: how much slower compute runs while k ranks of the pipeline compute at once (ranks
    sharing cores); the timeline is then the processor-sharing fixed point of ``shared_step_time``."""
    from mpformer.core.layout import min_microbatches
    from mpformer.pipeline.simulate import simulate

    def run(mb: int) -> float:
        if dilation is not None:
            return shared_step_time(_schedule(schedule, pp, mb, vpp), costs, dilation)
        return simulate(_schedule(schedule, pp, mb, vpp), costs, verified=True).step_time

    lo, hi = pp, 2 * pp
    if microbatches <= hi or lo < min_microbatches(schedule, pp):
        return run(microbatches)
    t_lo, t_hi = run(lo), run(hi)
    return t_hi + (microbatches - hi) * (t_hi - t_lo) / (hi - lo)


def iteration_time(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, *,
                   params_per_rank: int, simulate_pipeline: bool = True) -> Breakdown:
    from mpformer.pipeline.simulate import Costs

    micro = w.global_batch_size // (w.micro_batch_size * L.dp)
    counts = stage_counts(m, L, w.seq_length)
    cal = calibration(c)  # once per candidate: its cache key is not free
    fc, bc, wc, tps = stage_costs(m, L, w, c, counts, cal)
    boundary = w.seq_length // L.cp * w.micro_batch_size * m.hidden_size * BYTES[w.precision]
    boundary /= L.tp if L.sequence_parallel else 1
    p2p = _p2p(c, boundary, L.tp * L.cp * L.dp >= c.devices_per_node) if L.pp > 1 else 0.0
    compute_per_micro = sum(fc) + sum(bc) + sum(wc)
    fs = [x + t / 2 for x, t in zip(fc, tps)]
    bs = [x + t / 2 for x, t in zip(bc, tps)]
    slow = slowdowns(c)
    dilation = None
    if slow is not None:
        # Ranks sharing a CPU host. The timeline is simulated with each rank on a core of its own and
        # its compute-only costs; while k ranks of the host compute, each runs slow[k] times slower (a
        # rank idle in a bubble or in a collective lends its core to the others). Tensor-parallel
        # waits are added on top.
        compute_per_micro *= interpolate(slow, c.devices_per_node)
        per_rank = max(1, c.devices_per_node // L.pp)  # every pipeline on the host is in step

        def dilation(k: int, slow: dict[int, float] = slow) -> float:
            return interpolate(slow, k * per_rank)

        fs, bs = fc, bc
    if L.pp > 1 and simulate_pipeline:
        pipe = pipeline_time(L.schedule, L.pp, micro, L.vpp, Costs(f=fs, b=bs, w=wc, p2p=p2p), dilation)
    else:  # closed form: (m + p - 1) slots of a stage's work, interleaving shrinks the fill by vpp
        stage_work = (sum(fs) + sum(bs) + sum(wc)) / L.pp
        pipe = (micro + (L.pp - 1) / L.vpp) * stage_work + (L.pp - 1) * 2 * p2p
        if dilation is not None:  # the shared-core bound: every rank busy at the shared rate
            pipe = max(pipe, micro * compute_per_micro / L.pp)
    if dilation is not None:
        pipe *= cal.pipeline_factor(L.pp, L.schedule)  # what processor sharing misses (calibration.py)
        pipe += micro * max(sum(tps[c_ * L.pp + r] for c_ in range(L.vpp)) for r in range(L.pp))
    compute = micro * compute_per_micro / L.pp
    tp_step = tp_step_time(m, L, c, cal)
    pipe += tp_step
    waits = [sum(tps[c * L.pp + r] for c in range(L.vpp)) for r in range(L.pp)]
    slowest = max(range(L.pp), key=waits.__getitem__)
    tp_comm = micro * waits[slowest] + tp_step
    mine = [counts[chunk * L.pp + slowest] for chunk in range(L.vpp)]
    cp_comm = micro * sum(sum(ns) * sum(cp_layer_times(m, lay, w, c)) for lay, ns in _recompute_split(L, mine)) \
        if L.cp > 1 else 0.0
    dp_exposed = _dp_time(m, L, w, c, params_per_rank, micro, bs[-1] + wc[-1], slow is not None)
    shard = params_per_rank / (L.dp * L.cp if L.zero >= 1 else 1)  # ZeRO shards over dp x cp
    optimizer = shard * (2 * (4 + 4 + 8) + 4 + BYTES[w.precision]) / c.memory_bandwidth
    if slow is not None:
        optimizer *= interpolate(slow, c.devices_per_node)
    return Breakdown(compute_s=compute, tp_comm_s=tp_comm - cp_comm, cp_comm_s=cp_comm,
                     pp_bubble_s=max(pipe - compute - tp_comm, 0.0), p2p_s=p2p,
                     dp_comm_exposed_s=dp_exposed, optimizer_s=optimizer, iteration_s=pipe + dp_exposed + optimizer,
                     extra={"microbatches": micro, "params": params_per_rank})


def stage_costs(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster,
                counts: list[int] | None = None, cal: Calibration | None = None
                ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per (chunk) stage and micro-batch: forward, backward (input), weight-gradient compute (the last
    two merged unless the schedule splits them), and the tensor- and context-parallel collectives
    waited in (the profile's tensor-parallel correction scales only the first)."""
    counts = stage_counts(m, L, w.seq_length) if counts is None else counts
    cal = calibration(c) if cal is None else cal
    k, split_factor = cal.compute, cal.split
    split = L.schedule in ("zb-h1", "zb-h2")
    fc, bc, wc, tps, cps = ([0.0] * len(counts) for _ in range(5))
    for lay, ns in _recompute_split(L, counts):  # recomputed layers and the others cost differently
        f, bi, bw_, tp_comm, attn = layer_times_parts(m, lay, w, c)
        cp = sum(cp_layer_times(m, lay, w, c, attn))
        f, bi, bw_ = k * f, k * bi * (split_factor if split else 1), k * bw_ * (split_factor if split else 1)
        for i, n in enumerate(ns):
            fc[i] += n * f
            bc[i] += n * (bi + (0 if split else bw_))
            wc[i] += n * bw_ if split else 0.0
            tps[i] += n * tp_comm
            cps[i] += n * cp
    head = k * head_time(m, L, w, c)
    fc[-1] += head / 3
    bc[-1] += 2 * head / 3
    if L.tp > 1:  # the vocabulary-parallel embedding and head, and the cross-entropy's three reductions
        tokens = w.seq_length // L.cp * w.micro_batch_size
        act = tokens * m.hidden_size * BYTES[w.precision]
        kinds = ("reduce_scatter", "all_gather") if L.sequence_parallel else ("all_reduce",)
        edge = sum(_collective(c, k, act, L.tp, L.tp > c.devices_per_node) for k in kinds)
        tps[0] += edge
        tps[-1] += edge + 3 * _collective(c, "all_reduce", tokens * 4, L.tp, L.tp > c.devices_per_node)
    return fc, bc, wc, [cal.tp_factor(L.tp) * t + x for t, x in zip(tps, cps)]


def _recompute_split(L: ParallelLayout, counts: list[int]) -> list[tuple[ParallelLayout, list[int]]]:
    """(layout, layers per chunk) pairs: parallel.recompute_layers=K recomputes the first K layers of
    each chunk, the rest run as without recompute."""
    if L.recompute == "none" or L.recompute_layers is None:
        return [(L, list(counts))]
    done = [min(L.recompute_layers, n) for n in counts]
    return [(L, done), (replace(L, recompute="none", recompute_layers=None), [n - d for n, d in zip(counts, done)])]


def tp_step_time(m: ModelConfig, L: ParallelLayout, c: Cluster, cal: Calibration | None = None) -> float:
    """Once a step under sequence parallelism: the gradients of the weights tp replicates (the norms'
    gains) are all-reduced over tp, one tensor at a time as the runtime does."""
    if L.tp == 1 or not L.sequence_parallel:
        return 0.0
    tensors = 2 * -(-m.num_layers // L.pp) + 1
    one = _collective(c, "all_reduce", m.hidden_size * 4, L.tp, L.tp > c.devices_per_node)
    return (calibration(c) if cal is None else cal).tp_factor(L.tp) * tensors * one


def _dp_time(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, params: int, micro: int,
             last_backward: float, cores_shared: bool) -> float:
    """Exposed data-parallel time: fp32 gradients reduced in buckets (ZeRO-3: per layer, every
    micro-batch), 16-bit (or fp32) parameters gathered; overlapped with the last backward on devices
    that compute and communicate at once; on a CPU host whose cores are all computing only the
    latency of all but the first collective of a kind is hidden (``coll``)."""
    dp_ranks = L.dp * L.cp  # gradients reduce over dp x cp (same weights)
    if dp_ranks <= 1:
        return 0.0
    spans = L.tp * L.cp * L.dp > c.devices_per_node
    grads, wbytes = params * 4.0, params * BYTES[w.precision]

    def coll(kind: str, total: float, pieces: int) -> float:
        """``pieces`` collectives of ``total`` bytes in all, issued back to back. On a CPU host whose
        ranks share the cores, the runtime issues them ahead of need (buckets asynchronously as the
        backward fills them, ZeRO-3's gather of the next layer while this one computes): their
        latency, mostly the wait for the partners to be scheduled, overlaps compute but for the
        first one's; their bandwidth part does not (copies and reductions need the same cores)."""
        if cores_shared:
            return _collective(c, kind, total, dp_ranks, spans)
        return pieces * _collective(c, kind, total / pieces, dp_ranks, spans)

    if L.zero == 0:
        dp = coll("all_reduce", grads, 1)
    elif L.zero in (1, 2):
        dp = coll("reduce_scatter", grads, 1) + coll("all_gather", wbytes, 1)
        if L.zero == 2:
            dp += (micro - 1) * coll("reduce_scatter", grads, 1)
    else:
        units = m.num_layers // L.pp + 1  # each layer, and the embedding + head unit
        dp = micro * (coll("reduce_scatter", grads, units) + 2 * coll("all_gather", wbytes, units))
    if cores_shared:
        return dp
    overlap = last_backward * (micro if L.zero == 3 else 1)  # backward the reduction hides behind
    return max(dp - 0.8 * overlap, 0.05 * dp)


# ---- the profile's corrections, worked out with the model above (calibration.py) ----------------
def calibration(c: Cluster) -> Calibration:
    """The cluster's corrections from its profile (all 1 without one)."""
    ref = c.measured.get("reference")
    if not ref:
        return Calibration()
    layouts = c.measured.get("layouts") or {}
    # Keyed by the profile (held, so that its id is not reused) and the cluster's other fields: the
    # factors depend on both (cores, rates), not on the candidate.
    key = (id(c.measured), repr(replace(c, measured={})))
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is c.measured:
        return cached[1]
    base = _alone(c, ref)
    out = _from_layouts(replace(c, measured={k: v for k, v in c.measured.items() if k != "layouts"}),
                        ref, layouts, base) if layouts and slowdowns(c) is not None else base
    _CACHE[key] = (c.measured, out)
    return out


_CACHE: dict[tuple[int, str], tuple[dict, Calibration]] = {}


def _alone(c: Cluster, ref: dict) -> Calibration:
    m = ModelConfig(**ref["model"])
    w = Workload(ref["micro_batch_size"], ref["micro_batch_size"], ref["seq_length"], ref["precision"])
    bare = replace(c, measured={k: v for k, v in c.measured.items() if k not in ("reference", "layouts")})
    fc, bc, wc, _ = stage_costs(m, ParallelLayout(dp=1), w, bare)
    compute = ref["seconds"] / (sum(fc) + sum(bc) + sum(wc))
    if "split_backward_ratio" in ref:  # measured back to back with a one-pass backward
        extra = (ref["split_backward_ratio"] - 1.0) * ref["seconds"]
    else:
        extra = ref.get("seconds_split_backward", ref["seconds"]) - ref["seconds"]
    return Calibration(compute, 1.0 + max(extra, 0.0) / (compute * sum(bc)))


def _from_layouts(c: Cluster, ref: dict, layouts: dict, base: Calibration) -> Calibration:
    """Predict each reference layout as it ran (no gradient reduction, no optimizer step) on a host of
    its world with only the compute and split corrections (``c`` has no layouts), and compare."""
    m = ModelConfig(**ref["model"])
    pipeline, split_pipeline, tp = {}, {}, {}
    for row in layouts.values():
        L = ParallelLayout(**row["layout"])
        host = replace(c, devices_per_node=row["world"], nodes=1)
        w = Workload(row["microbatches"], 1, ref["seq_length"], ref["precision"])
        b = iteration_time(m, L, w, host, params_per_rank=0)
        predicted = b.iteration_s - b.dp_comm_exposed_s - b.optimizer_s
        # Measured as a ratio to the same round's step with every rank computing the same number of
        # micro-batches without a break (a second or so each, back to back: the machine's drift
        # cancels), whose model is the time alone x slowdown(world).
        busy = 2 * ref["seconds"] * interpolate(slowdowns(host), row["world"])
        measured = row["relative_to_busy"] * busy
        if L.pp > 1 and L.tp == 1 and L.schedule in SPLIT:
            split_pipeline[L.pp] = measured / predicted
        elif L.pp > 1 and L.tp == 1:
            pipeline[L.pp] = clamp(measured / predicted)
        elif L.tp > 1 and L.pp == 1:
            # The step the profile ran has no once-per-step all-reduce of the replicated gradients
            # (the trainer's, after the pipeline): out of the prediction and of the waits scaled.
            waits = b.tp_comm_s - tp_step_time(m, L, host)
            if waits > 0:
                tp[L.tp] = clamp((measured - (predicted - b.tp_comm_s)) / waits)
    # A zero-bubble schedule against 1F1B at the same depth: its extra over 1F1B's correction.
    zb = [split_pipeline[p] / pipeline[p] for p in split_pipeline if p in pipeline]
    return replace(base, pipeline=pipeline, tp=tp, zero_bubble=clamp(zb[0]) if zb else 1.0)
