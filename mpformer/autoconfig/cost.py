"""Iteration time of a plan: per-layer compute from FLOPs and shape-dependent GEMM efficiency,
alpha-beta collectives on the link the rank order implies, the pipeline timeline from simulate.py
on the schedule itself, data-parallel reduction with its overlap, and the optimizer step.

    compute   every GEMM of a layer (qkv, o, mlp up/down, the two attention products) timed as
              FLOPs / (peak x efficiency(m, n, k)); efficiency from the cluster's measured matmul
              table when it has one (local-cpu), else ``GEMM_EFFICIENCY`` x the size term below;
              elementwise work (norms, activations, dropout, residuals) as memory traffic over HBM
    TP / SP   2 all-reduces (or all-gather + reduce-scatter) of s b h per layer in forward and 2 in
              backward, not overlapped (Megatron), or chunked into the GEMMs (Transformer Engine)
    CP        per layer, the traffic each cp kind does not hide behind attention (cp_cost.py); selective
              or full recompute reruns the attention core and with it its forward's traffic
    PP        per-stage F / B / W costs into ``simulate`` with the actual schedule; p2p over the link
              between stages
    EP        a sparse layer's token exchanges (expert_cost.py) per stage into the pipeline's
              Costs.a2a_f / a2a_b: waited after a compute alone, run beside the other half's compute in
              DualPipeV's pairs (Breakdown: ep_comm_s waited, ep_hidden_s hidden); with pp = 1 a plain wait
    DP / ZeRO (dp_cost.py) gradient reduce-scatter or all-reduce overlapped with the backward of the last
              micro-batch; parameter all-gather after the step (stages 1-2) or per layer (stage 3)
    overlap   a collective hidden behind compute still holds the SMs of its CTAs while it runs
              (``comm_sms``): the compute beside it loses that share of the device (links.beside)
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

from dataclasses import dataclass, field, replace

from mpformer.autoconfig.calibration import Calibration, clamp
from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.cp_cost import cp_traffic
from mpformer.autoconfig.dp_cost import _dp_time, optimizer_time
from mpformer.autoconfig.expert_cost import dp_share, stage_exchanges
from mpformer.autoconfig.expert_memory import stage_expert_params
from mpformer.autoconfig.fp8_terms import Fp8Proj, amax_reductions, experts_fp8, fp8_projections, saves_fp8
from mpformer.autoconfig.kernel_times import (  # noqa: F401  (fused_attention: re-exported)
    _PARTS,
    embedding_times,
    fused_attention,
    head_times,
    kernel_launches,
    layer_compute,
)
from mpformer.autoconfig.links import RING_FACTOR, _collective, _p2p, sm_share  # noqa: F401  (RING_FACTOR: re-exported)
from mpformer.autoconfig.memory import BYTES, Workload, rank_layers
from mpformer.autoconfig.pipeline_cost import hidden_exchanges, offload_exposed, pipeline_bound, pipeline_time
from mpformer.autoconfig.sharing import interpolate, slowdowns
from mpformer.core.layout import SPLIT_BACKWARD, V_SCHEDULES, ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.pipeline_plan import stage_counts, stage_index
from mpformer.pipeline.simulate import Costs


@dataclass
class Breakdown:
    compute_s: float = 0.0
    tp_comm_s: float = 0.0
    cp_comm_s: float = 0.0  # context-parallel traffic not hidden behind attention (on the slowest rank)
    ep_comm_s: float = 0.0  # a mixture of experts' token exchanges waited for (on the slowest rank)
    ep_hidden_s: float = 0.0  # and those DualPipeV's overlapped pairs run beside compute (not a summand)
    pp_bubble_s: float = 0.0
    p2p_s: float = 0.0
    dp_comm_exposed_s: float = 0.0
    optimizer_s: float = 0.0
    iteration_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra


def layer_times(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster) -> tuple[float, float, float, float]:
    """(F, BI, BW, TP + CP communication) seconds of one layer for one micro-batch on one rank."""
    f, bi, bw_, tp_comm, attn = layer_times_parts(m, L, w, c)
    return f, bi, bw_, tp_comm + sum(cp_layer_times(m, L, w, c, attn))


def layer_times_parts(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, kind: str | None = None
                      ) -> tuple[float, float, float, float, float]:
    """(F, BI, BW, TP communication, attention forward) seconds of one layer, one micro-batch, one rank.
    Selective recompute reruns the attention core's forward in the backward, full recompute the
    whole forward (and its tensor-parallel collectives). ``kind``: the layer's MLP kind (a sparse
    layer's token exchanges are not here: the pipeline prices them apart, expert_cost.stage_exchanges)."""
    lt = layer_compute(m, L, w, c, kind)
    f, bi, bw_ = lt.f, lt.bi, lt.bw
    if L.recompute == "selective" and w.runtime.selective == "op":
        # torchtitan's op-level checkpointing: the outputs of every other matmul (wq, wv, w1, w2) and
        # of SDPA kept; wk, wo, w3 and every elementwise op run again
        q, kv = m.num_attention_heads * m.head_size, m.kv_heads * m.head_size
        qkv, o, up = lt.f_gemms[:3]
        bi += qkv * kv / (q + 2 * kv) + o + (up / 2 if m.gated_mlp else 0.0) + lt.f_memory
    elif L.recompute == "selective":
        bi += lt.attn_f
    elif L.recompute == "full":
        bi += f
    t, act = L.tp, w.seq_length // L.cp * w.micro_batch_size * m.hidden_size * BYTES[w.precision]
    spans = t > c.devices_per_node
    kinds = ("all_gather", "reduce_scatter") if L.sequence_parallel else ("all_reduce", None)
    # fp8 (tensorwise, delayed) under sequence parallelism: the shard is cast before the all-gather (fp8_terms.py)
    gather = act / 2 if w.precision == "fp8" and saves_fp8(w.runtime.fp8) else act
    per = sum(_collective(c, k, gather if k == "all_gather" else act, t, spans) for k in kinds if k)
    if w.runtime.tp_comm_overlap and t > 1:
        # Transformer Engine's overlap (Megatron-LM --tp-comm-overlap): each collective is cut into t
        # chunks exchanged while the adjacent GEMM computes the chunk before (all-gather -> QKV / FC1,
        # RS after O / FC2; the same in backward): the first chunk, and what the GEMM cannot cover,
        # stay exposed. While hidden, the reduce-scatters (half the traffic; TE's "pipeline" and
        # "bulk" methods, 24 SMs in NeMo's H100 userbuffer configs) hold SMs as NCCL's collectives do;
        # the all-gathers ("ring_exchange", copy engines) hold about none (links.sm_share).
        exposed = max(per / t, per - lt.parts["gemm_forward"] / 2)
        per = exposed + sm_share(c) * (per - exposed) / 2
    # 2 in forward, 2 in backward, 2 more to recompute; the backward's two all-gathers of the kept input
    # shards (layers/linear.py) run under the input-gradient GEMMs and are not charged, as in Megatron
    tp_comm = (6 if L.recompute == "full" else 4) * per
    if w.precision == "fp8" and t * L.cp > 1:  # each cast's amax all-reduced over the shards: latency-bound
        projs = list(fp8_projections(m, t, w.runtime.fp8, kind))
        if kind == "moe" and experts_fp8(m, w.runtime.fp8):  # the float8 experts' two grouped GEMMs
            projs += [Fp8Proj("experts", 1, 1, False)] * 2
        counts = [amax_reductions(p, w.runtime.fp8) for p in projs]
        fwd, bwd = sum(f for f, _ in counts), sum(b for _, b in counts)
        amaxes = fwd * (2 if L.recompute == "full" else 1) + bwd  # a recomputed forward casts again
        tp_comm += amaxes * _collective(c, "all_reduce", 4.0, t * L.cp, t * L.cp > c.devices_per_node)
    return f, bi, bw_, tp_comm, lt.attn_f


def cp_layer_times(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, attn: float | None = None
                   ) -> tuple[float, float]:
    """Exposed context-parallel communication of one layer for one micro-batch: (forward, backward),
    priced in cp_cost.py; ``attn``: the rank's attention forward (computed when not given)."""
    if L.cp == 1:
        return 0.0, 0.0
    return cp_traffic(m, L, w, c, layer_times_parts(m, L, w, c)[4] if attn is None else attn)


def iteration_time(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, *,
                   params_per_rank: int, simulate_pipeline: bool = True) -> Breakdown:

    micro = w.global_batch_size // (w.micro_batch_size * L.dp)
    counts = stage_counts(m, L, w.seq_length)
    cal = calibration(c)  # once per candidate: its cache key is not free
    fc, bc, wc, tps = stage_costs(m, L, w, c, counts, cal)
    k = L.pp_token_slices  # token slices: the pipeline runs micro x k units, each priced by stage_costs
    micro_batches, micro = micro, micro * k
    boundary = w.seq_length // k // L.cp * w.micro_batch_size * m.hidden_size * BYTES[w.precision]
    boundary /= L.tp if L.sequence_parallel or w.runtime.p2p_split else 1
    p2p = _p2p(c, boundary, L.tp * L.cp * L.dp >= c.devices_per_node) if L.pp > 1 else 0.0
    compute_per_micro = sum(fc) + sum(bc) + sum(wc)
    fs = [x + t / 2 for x, t in zip(fc, tps)]
    bs = [x + t / 2 for x, t in zip(bc, tps)]
    if L.offload != "none" and L.pp > 1 and c.host_bandwidth > 0:
        fs, bs = offload_exposed(m, L, w, c, counts, fs, bs)
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
    # A mixture of experts' token exchanges per stage: the pipeline's F and B carry them (Costs.a2a_f /
    # a2a_b), so the schedule decides what they cost (DualPipeV's pairs run them beside compute); with
    # one stage, or on shared cores (its waits are added on top), a plain exposed wait.
    xf, xb = stage_exchanges(m, L, w.seq_length // k, w.micro_batch_size, BYTES[w.precision], c, counts)
    exch = [x + y for x, y in zip(xf, xb)]
    in_pipe = L.pp > 1 and dilation is None and any(exch)
    if L.pp == 1 and any(exch):
        fs, bs = [x + y for x, y in zip(fs, xf)], [x + y for x, y in zip(bs, xb)]
    costs = Costs(f=fs, b=bs, w=wc, p2p=p2p, **({"a2a_f": xf, "a2a_b": xb} if in_pipe else {}))
    # train.overlap_validation: steps run back to back, a step's check in flight during the next one's
    # forward/backward (training/overlap.py); the pipeline term is their period, not one step alone.
    # Not with a tied embedding on two ranks: the first stage's step then waits for the last stage's
    # embedding gradient (engine.finish), which ends the step for both as a barrier would.
    b2b = w.runtime.overlap_validation and not (m.tie_embeddings and L.pp > 1 and L.schedule not in V_SCHEDULES)
    if L.pp > 1 and simulate_pipeline:
        blocking = not w.runtime.overlap_p2p
        pipe = pipeline_time(L.schedule, L.pp, micro_batches, L.vpp, costs, dilation, blocking, k, b2b)
        if dilation is None:  # past 2p micro-batches the timeline is extrapolated: never below the bound
            pipe = max(pipe, pipeline_bound(L.schedule, L.pp, micro_batches, L.vpp, costs, blocking, k, b2b))
    else:  # the closed form: a lower bound of the simulated timeline, equal to it for even stages
        pipe = pipeline_bound(L.schedule, L.pp, micro_batches, L.vpp, costs,
                              blocking=not w.runtime.overlap_p2p, slices=k, back_to_back=b2b)
        if dilation is not None:  # the shared-core bound: every rank busy at the shared rate
            pipe = max(pipe, micro * compute_per_micro / L.pp)
    waits = [sum(tps[stage_index(L, r, c)] for c in range(L.vpp)) for r in range(L.pp)]
    exchanges = [sum(exch[stage_index(L, r, c)] for c in range(L.vpp)) for r in range(L.pp)]
    if dilation is not None:
        pipe *= cal.pipeline_factor(L.pp, L.schedule)  # what processor sharing misses (calibration.py)
        pipe += micro * max(x + y for x, y in zip(waits, exchanges))
    compute = micro * compute_per_micro / L.pp
    tp_step = tp_step_time(m, L, c, cal)
    pipe += tp_step
    # the exchanges of one step that the rank's overlapped pairs run beside compute (DualPipeV)
    hidden = hidden_exchanges(L.schedule, L.pp, micro_batches, L.vpp, costs, k) if in_pipe else [0.0] * L.pp
    slowest = max(range(L.pp), key=lambda r: micro * (waits[r] + exchanges[r]) - hidden[r])
    tp_comm = micro * waits[slowest] + tp_step
    ep_comm = micro * exchanges[slowest] - hidden[slowest]
    mine = [counts[stage_index(L, slowest, chunk)] for chunk in range(L.vpp)]
    cp_comm = micro * sum(sum(ns) * sum(cp_layer_times(m, lay, w, c)) for lay, ns in _recompute_split(L, mine)) \
        if L.cp > 1 else 0.0
    first = [stage_index(L, 0, chunk) for chunk in range(L.vpp)]  # pipeline rank 0's stages: it finishes last
    dp_params = params_per_rank
    if m.num_experts:  # the experts reduce over the expert-data group (dp cp / ep ranks): priced at their share
        dp_params = round(dp_share(L, params_per_rank, stage_expert_params(m, L, rank_layers(m, L, counts, 0))))
    ax, bx = (xf, xb) if in_pipe else ([0.0] * len(fs), [0.0] * len(fs))  # exchanges not in fs / bs
    dp_exposed = _dp_time(m, L, w, c, dp_params, micro, sum(fs[i] + ax[i] for i in first),
                          sum(bs[i] + bx[i] + wc[i] for i in first), slow is not None)
    optimizer = optimizer_time(L, w, c, params_per_rank)
    if slow is not None:
        optimizer *= interpolate(slow, c.devices_per_node)
    return Breakdown(compute_s=compute, tp_comm_s=tp_comm - cp_comm, cp_comm_s=cp_comm, ep_comm_s=ep_comm,
                     ep_hidden_s=hidden[slowest],
                     pp_bubble_s=max(pipe - compute - tp_comm - ep_comm, 0.0) if L.pp > 1 else 0.0, p2p_s=p2p,
                     dp_comm_exposed_s=dp_exposed, optimizer_s=optimizer, iteration_s=pipe + dp_exposed + optimizer,
                     extra={"microbatches": micro_batches, "params": params_per_rank})


def stage_costs(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster,
                counts: list[int] | None = None, cal: Calibration | None = None
                ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per (chunk) stage and micro-batch: forward, backward (input), weight-gradient compute (the last
    two merged unless the schedule splits them), and the tensor- and context-parallel collectives
    waited in (the profile's tensor-parallel correction scales only the first). With token slices
    (``parallel.pp_token_slices`` = k) per slice, the pipeline's unit: every kernel at a slice's s/k
    positions, and attention over the keys before it too. Slice j of a causal sequence attends to
    (j + 1/2) slices' keys, k/2 on average, against the 1/2 a slice alone would: k times the attention
    of an s/k sequence, forward and backward (FlashAttention's backward runs 2.5 times its forward's
    work: five GEMMs against two)."""
    counts = stage_counts(m, L, w.seq_length) if counts is None else counts
    slices = L.pp_token_slices
    if slices > 1:
        w = replace(w, seq_length=w.seq_length // slices)
    cal = calibration(c) if cal is None else cal
    k, split_factor = cal.compute, cal.split
    split = L.schedule in SPLIT_BACKWARD
    fc, bc, wc, tps, cps = ([0.0] * len(counts) for _ in range(5))
    for lay, ns, kind in _kind_split(m, L, counts):  # recomputed layers and the others cost differently
        f, bi, bw_, tp_comm, attn = layer_times_parts(m, lay, w, c, kind)
        cp = sum(cp_layer_times(m, lay, w, c, attn))
        f, bi = f + (slices - 1) * attn, bi + 2.5 * (slices - 1) * attn  # the earlier slices' keys
        nf, nbi, nbw = kernel_launches(m, lay, w, "layers") if cal.launch else (0, 0, 0)  # host cost per launch
        f, bi, bw_ = (k * f + cal.launch * nf, (k * bi + cal.launch * nbi) * (split_factor if split else 1),
                      (k * bw_ + cal.launch * nbw) * (split_factor if split else 1))
        for i, n in enumerate(ns):
            fc[i] += n * f
            bc[i] += n * (bi + (0 if split else bw_))
            wc[i] += n * bw_ if split else 0.0
            tps[i] += n * tp_comm
            cps[i] += n * cp
    hf, hb, hw = (k * x + cal.launch * n for x, n in zip(head_times(m, L, w, c), kernel_launches(m, L, w, "head")))
    ef, eb, ew = (k * x + cal.launch * n for x, n in zip(embedding_times(m, L, w, c),
                                                         kernel_launches(m, L, w, "embedding")))
    fc[-1] += hf
    fc[0] += ef
    for i, (b_, w_) in ((-1, (hb, hw)), (0, (eb, ew))):
        bc[i] += b_ + (0 if split else w_)
        wc[i] += w_ if split else 0.0
    if L.tp > 1:  # the vocabulary-parallel embedding and head, and the cross-entropy's three reductions
        tokens = w.seq_length // L.cp * w.micro_batch_size
        act = tokens * m.hidden_size * BYTES[w.precision]
        kinds = ("reduce_scatter", "all_gather") if L.sequence_parallel else ("all_reduce",)
        edge = sum(_collective(c, k, act, L.tp, L.tp > c.devices_per_node) for k in kinds)
        tps[0] += edge
        tps[-1] += edge + 3 * _collective(c, "all_reduce", tokens * 4, L.tp, L.tp > c.devices_per_node)
    return fc, bc, wc, [cal.tp_factor(L.tp) * t + x for t, x in zip(tps, cps)]


def _kind_split(m: ModelConfig, L: ParallelLayout, counts: list[int]
                ) -> list[tuple[ParallelLayout, list[float], str | None]]:
    """(layout, layers per chunk, MLP kind): ``_recompute_split`` and, in a mixture of experts, each stage's
    layers of each kind (sparse or dense) in the shares the stage holds them (None: the model's kind)."""
    split = _recompute_split(L, counts)
    if not m.num_experts:
        return [(lay, list(ns), None) for lay, ns in split]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    out = []
    for kind in dict.fromkeys(m.layer_kinds()):
        share = [sum(m.layer_mlp_kind(j) == kind for j in range(a, a + n)) / n if n else 0.0
                 for a, n in zip(starts, counts)]
        out += [(lay, [x * q for x, q in zip(ns, share)], kind) for lay, ns in split]
    return out


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
    """The reference alone: its step t = k x (the kernels' modelled time M) + launch x (kernels
    launched N). The same tokens in ``short_pieces`` micro-batches launch the same kernels that many
    times on smaller operands, so the two measured steps give k and launch; without that measurement
    (or when it leaves launch negative: noise) all of t is k x M."""
    m = ModelConfig(**ref["model"])
    bare = replace(c, measured={k: v for k, v in c.measured.items() if k not in ("reference", "layouts")})

    def modelled(seq: int) -> tuple[float, float, int, int]:  # M, its backward, N, N of the backward
        w = Workload(ref["micro_batch_size"], ref["micro_batch_size"], seq, ref["precision"])
        fc, bc, wc, _ = stage_costs(m, ParallelLayout(dp=1), w, bare)
        layer, head, emb = (kernel_launches(m, ParallelLayout(dp=1), w, part) for part in _PARTS)
        n = [m.num_layers * a + b + e for a, b, e in zip(layer, head, emb)]  # forward, input, weight gradients
        return sum(fc) + sum(bc) + sum(wc), sum(bc), sum(n), n[1] + n[2]

    t = ref["seconds"]
    full, backward, n, n_backward = modelled(ref["seq_length"])
    compute, launch = t / full, 0.0
    pieces, ratio = ref.get("short_pieces"), ref.get("short_micro_batches_ratio")
    if pieces and ratio:
        short = modelled(ref["seq_length"] // pieces)[0]
        k = t * (pieces - ratio) / (pieces * (full - short)) if full > short else 0.0
        if 0.0 < k and t - k * full > 0.0:
            compute, launch = k, (t - k * full) / n
    if "split_backward_ratio" in ref:  # measured back to back with a one-pass backward
        extra = (ref["split_backward_ratio"] - 1.0) * t
    else:
        extra = ref.get("seconds_split_backward", t) - t
    return Calibration(compute, 1.0 + max(extra, 0.0) / (compute * backward + launch * n_backward), launch=launch)


def _from_layouts(c: Cluster, ref: dict, layouts: dict, base: Calibration) -> Calibration:
    """Predict each reference layout as it ran (no gradient reduction, no optimizer step) on a host of
    its world with only the compute and split corrections (``c`` has no layouts), and compare."""
    m = ModelConfig(**ref["model"])
    pipeline, tp = {}, {}
    for row in layouts.values():
        L = ParallelLayout(**row["layout"])
        if L.schedule in SPLIT_BACKWARD:  # a profile from before zero-bubble layouts left the set (calibration.py)
            continue
        host = replace(c, devices_per_node=row["world"], nodes=1)
        w = Workload(row["microbatches"], 1, ref["seq_length"], ref["precision"])
        b = iteration_time(m, L, w, host, params_per_rank=0)
        predicted = b.iteration_s - b.dp_comm_exposed_s - b.optimizer_s
        # Measured as a ratio to the same round's step with every rank computing the same number of
        # micro-batches without a break (a second or so each, back to back: the machine's drift
        # cancels), whose model is the time alone x slowdown(world).
        busy = 2 * ref["seconds"] * interpolate(slowdowns(host), row["world"])
        measured = row["relative_to_busy"] * busy
        if L.pp > 1 and L.tp == 1:
            pipeline[L.pp] = clamp(measured / predicted)
        elif L.tp > 1 and L.pp == 1:
            # The step the profile ran has no once-per-step all-reduce of the replicated gradients
            # (the trainer's, after the pipeline): out of the prediction and of the waits scaled.
            # What the step took beyond the modelled compute, not the waits the ledger timed: on
            # shared cores a rank waiting lends its core, so the step grows by less than its waits.
            waits = b.tp_comm_s - tp_step_time(m, L, host)
            if waits > 0:
                tp[L.tp] = clamp((measured - (predicted - b.tp_comm_s)) / waits)
    return replace(base, pipeline=pipeline, tp=tp)
