"""Memory per device of a plan, per pipeline stage: what the runtime keeps live at its peak.

    model state   persistent per rank: the ZeRO table (docs/formulas.md, N_d = dp x cp: cp ranks hold
                  the same weights) for the parameters this rank holds (its stage's layers cut by tp;
                  blocks tp replicates - norm gains, kv heads when tp > kv heads - counted whole; the
                  embedding on the first stage, the LM head or the tied embedding's copy on the last),
                  with the bytes the engine holds (optim/engine.py): parameters w (2 or 4; 0 at stage
                  3 with 16-bit parameters, whose ranks keep only the fp32 masters), fp32 gradients
                  g = 4 (stages 0-1 whole, 2-3 the shard), fp32 masters m = 4 for 16-bit parameters,
                  Adam's two moments k = 8 (another framework's runtime: its own, runtimes.py)
    activations   what the micro-batches in flight keep for backward at the peak (the schedule's
                  peak in-flight count per rank, verified from its own action lists) and, when the
                  peak falls in a layer's backward, that layer's recomputed activations and its
                  backward's own (layer_memory.py). Per layer: mpformer's own count
                  (layer_memory.py ``layer_bytes``: PyTorch autograd's, torchtitan's too), or Megatron's
                  block (``megatron_layer_bytes``: Korthikanti et al.'s count op by op, for the
                  runtimes that run it and for an attention that writes its scores, as Megatron
                  before FlashAttention did); plus what a cp kind keeps
                  beyond its own K/V (block_memory.py ``cp_extra_bytes_per_layer``), the pipeline's received inputs and
                  kept outputs, and on the last stage the head's: its final norm and the fused cross
                  entropy's fp32 dX [n, h] and dW [v, h], formed in forward and held until backward
    transients    what the point of the step at the peak adds besides activations (step_memory.py
                  walks them): one chunk of the fused head in forward, the head's gradients cast to
                  the compute dtype, a weight gradient before the engine takes it, the gradient
                  buckets (stage 2: fp32 buckets, one filling and MAX_IN_FLIGHT reducing; stage 3: one
                  per unit in the parameter dtype, taken once the reductions in flight and it hold at
                  most the runtime's ``reduce_numel``; both from the engine's pool), stage 3's gathered
                  units (units of a layer's parts, runtimes.py: the one in use and the next in use
                  order within ``prefetch_numel``), the reductions' output shards and,
                  on CPU, gloo's receive buffers; stages 0-1 hold every bucket's reduction at the end
                  of the backward, when the activations are gone
    overhead      the caching allocator's fragmentation, ``ALLOCATOR_FACTOR`` on the transients: an
                  allowance, not derived. It applies to the buffers whose sizes and lifetimes vary
                  within a step (gathered units, buckets, the head's chunk and casts) and not to the
                  model state (allocated once at set-up, never freed) or the activations (the same
                  sizes every layer and micro-batch, whose blocks the allocator reuses); PyTorch also
                  returns its cached blocks and retries before it reports an out-of-memory, so what
                  must fit is the live tensors and what cannot be returned. What the process holds
                  besides its tensors (the CUDA context, NCCL's buffers, the allocator's reserve) is
                  the device's, not the plan's: the cluster preset subtracts it from the device's
                  memory (cluster.py ``usable_bytes``), and ``total`` is fitted to what is left.

``StageMemory.live`` (state + activations + transients) is what the runtime's tensors hold at the
peak: benchmarks/bench_memory.py measures it (live tensor bytes on CPU, the allocator's peak on
CUDA) against this model.

plan_memory in steps: the plan read once (``PlanInputs``: what a layer and the head hold,
block_memory.py; how the gradients are reduced), each stage shape built once (``StageShape``: its
persistent bytes and its units, stage_units.py), then per rank what its other units in flight keep
(``InFlight``) and the walk's peak (step_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mpformer.autoconfig.block_memory import head_live, layer_live
from mpformer.autoconfig.expert_memory import (
    expert_data_size,
    expert_param_sizes,
    mlp_part_sizes,
    stage_expert_params,
)
from mpformer.autoconfig.fp8_terms import delayed_state_bytes, expert_state_bytes, experts_fp8
from mpformer.autoconfig.inflight import inflight, offloaded, weighted_peak
from mpformer.autoconfig.layer_memory import BYTES
from mpformer.autoconfig.runtimes import MPFORMER, Runtime, gathered_at_head
from mpformer.autoconfig.stage_units import PlanInputs, gathers, stage_units, with_gathered
from mpformer.autoconfig.step_memory import Peak, ReductionSpec, Unit, walk
from mpformer.autoconfig.workload import Workload
from mpformer.core.buffers import zero3_groups
from mpformer.core.layer_spec import attention_kind
from mpformer.core.layout import SPLIT_BACKWARD, ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.pipeline_plan import rank_ends, stage_counts, stage_index
from mpformer.optim.engine import MAX_IN_FLIGHT
from mpformer.optim.memory import zero_formula_bytes

ALLOCATOR_FACTOR = 1.08  # caching-allocator fragmentation on top of the transients (an allowance, not derived)

@dataclass(frozen=True)
class StageMemory:
    params: int  # parameters this rank holds (before ZeRO sharding)
    model_state: float
    activations: float
    transients: float
    overhead: float
    phase: str = ""  # where the peak falls: "head forward", "layer backward", ... (step_memory.py)
    host: float = 0.0  # activations offloaded to host memory at the peak (parallel.offload)
    speculation: float = 0.0  # train.overlap_validation: the previous step's saved copy, held through this one

    @property
    def total(self) -> float:
        return self.model_state + self.speculation + self.activations + self.transients + self.overhead

    @property
    def live(self) -> float:
        """The tensors' bytes at the peak, without the runtime context and the allocator's allowance."""
        return self.model_state + self.speculation + self.activations + self.transients


def layer_params_per_rank(m: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank."""
    return sum(layer_param_sizes(m, tp))


def rank_layers(m: ModelConfig, L: ParallelLayout, counts: list[int] | tuple[int, ...], r: int) -> list[int]:
    """The global layer indices pipeline rank ``r`` holds (its chunks' stages, ``counts`` per stage)."""
    out: list[int] = []
    for c in range(L.vpp):
        g = stage_index(L, r, c)
        start = sum(counts[:g])
        out += range(start, start + counts[g])
    return out


def stage_params(m: ModelConfig, L: ParallelLayout, stage_layers: int, first: bool, last: bool,
                 layers: list[int] | None = None) -> int:
    """Parameters one rank holds (before ZeRO): ``stage_layers`` layers (``layers``: which ones, for a
    model whose layers differ in kind; default the first ones), the embedding and the head."""
    vocab = -(-m.vocab_size // L.tp) * m.hidden_size
    if m.num_experts:  # a mixture of experts: each layer by its kind, its experts at the layout's ep, etp
        ids = layers if layers is not None else range(stage_layers)
        n = sum(sum(layer_param_sizes(m, L.tp, m.layer_mlp_kind(i), L)) for i in ids)
    else:
        n = stage_layers * layer_params_per_rank(m, L.tp)
    if first:
        n += vocab + (m.max_position_embeddings * m.hidden_size if m.learned_positions else 0)
    if last:
        n += (2 if m.norm_bias else 1) * m.hidden_size
        if not m.tie_embeddings or not first:
            n += vocab  # the untied head, or the last stage's copy of a tied embedding
    return n


def activation_bytes_per_layer(m: ModelConfig, L: ParallelLayout, w: Workload) -> float:
    """Korthikanti et al. Table 2 (16-bit activations and 1-byte dropout masks), scaled for fp32; s is
    the rank's s/cp positions. Their s^2 terms (scores, softmax, its dropout mask) count only for an
    attention that writes its scores (``w.flash_attention=False``, as the Megatron runs they measured):
    SDPA and the cp block kernels save q, k, v, the output and the log-sum-exp rows."""
    s, b, h, a, t = w.seq_length // L.cp, w.micro_batch_size, m.hidden_size, m.num_attention_heads, L.tp
    if L.recompute == "full":
        per = 2.0  # the layer input only
    elif L.sequence_parallel:
        per = 34.0 / t
    else:
        per = 10.0 + 24.0 / t
    # Flash-style kernels (SDPA, and the cp block kernels) keep q, k, v, the output and row statistics;
    # only an attention that writes its scores (flash_attention=False: Megatron before FlashAttention)
    # keeps the s^2 terms.
    if L.recompute == "none" and L.cp == 1 and not w.flash_attention:
        per += 5.0 * a * s / (h * t)  # attention scores, softmax and its dropout mask (s^2 per head)
    return s * b * h * per * BYTES[w.precision] / 2

def head_bytes(m: ModelConfig, L: ParallelLayout, w: Workload) -> float:
    """What the last stage's head holds for one micro-batch beyond the layers' activations, as one sum:
    its kept gradient buffers and one chunk's logits (fused), or fp32 logits and their gradient. (An
    upper bound: plan_memory places the kept part and the chunk at the points of the step where each
    is live, block_memory.py ``head_live``.)"""
    tokens, vocab = w.seq_length // L.cp * w.micro_batch_size, -(-m.vocab_size // L.tp)
    if not w.fused_cross_entropy:  # fp32 logits of this rank's vocabulary block and their gradient
        return 2.0 * tokens * vocab * 4
    chunk = min(w.cross_entropy_chunk, tokens)
    return 4.0 * (tokens * m.hidden_size + vocab * m.hidden_size) + chunk * vocab * (4 + 4 + BYTES[w.precision])


def layer_param_sizes(m: ModelConfig, tp: int, kind: str | None = None, L: ParallelLayout | None = None) -> list[int]:
    """One layer's parameters on one tensor-parallel rank, in model order (how the engine buckets them)."""
    return [n for part in layer_part_sizes(m, tp, kind, L) for n in part]


def layer_part_sizes(m: ModelConfig, tp: int, kind: str | None = None,
                     L: ParallelLayout | None = None) -> list[list[int]]:
    """One layer's parameters by its parts (Block.parts(), how mpformer's ZeRO-3 makes units): each norm
    with the first part of the sublayer it feeds, as the attention and MLP kinds describe their parts
    (core/layer_spec.py; dense: norm + qkv, o, norm + up, down). ``kind``: the layer's MLP kind
    (``layer_mlp_kind``; default the model's); ``L``: the layout whose ep and etp split the experts."""
    norm = [m.hidden_size, m.hidden_size] if m.norm_bias else [m.hidden_size]
    L = L if L is not None else ParallelLayout(tp=tp, etp=1)
    out: list[list[int]] = []
    for parts in (attention_kind(m.attention_kind).part_sizes(m, tp),
                  mlp_part_sizes(m, L, m.mlp_kind if kind is None else kind)):
        first, *rest = parts
        out += [norm + first, *rest]
    return out


@dataclass(frozen=True)
class StageShape:
    """What the pipeline ranks with the same ends and chunks share (a deep pipeline's middle ranks differ
    only in how many units they keep in flight, which the walk adds last)."""

    params: int  # parameters this rank holds (before ZeRO sharding)
    state: float  # persistent bytes: the ZeRO table's
    units: tuple[Unit, ...]  # what one micro-batch's backward meets, in order (step_memory.py)
    per_unit: float  # bytes a unit in flight keeps (the walked chunk's)
    io: float  # of which its received input and kept output at the stage boundaries
    chunk_kept: tuple[float, ...]  # bytes a unit of each chunk keeps (a balanced or explicit split: unequal)
    head_forward: float  # what the end of the forward adds: the head's chunk, the gathered head


@dataclass(frozen=True)
class InFlight:
    """What one rank's other units in flight keep, beside the walked one's."""

    kept: float  # on the device at every point of the walk but the end of the backward
    last_only: float  # the same when the walked micro-batch is the only one in flight
    host: float  # offloaded to host memory
    copying: bool  # some units are copied out (the walk sees two of its layers at a time)


def plan_memory(m: ModelConfig, L: ParallelLayout, w: Workload, *, device: str = "cuda",
                bucket_mb: float = 25.0, runtime: Runtime | None = None) -> list[StageMemory]:
    """Per pipeline rank (pp entries): the bytes one device of that stage needs at its peak (module
    docstring). ``runtime``: whose runtime runs the plan (mpformer's unless modelling a published run
    of another framework, runtimes.py; default: the workload's)."""
    p = _plan(m, L, w, device, bucket_mb, w.runtime if runtime is None else runtime)
    out, shapes = [], {}
    for r in range(p.L.pp):
        first, last = rank_ends(p.L, r)  # a V schedule's rank 0 holds both ends
        chunks = tuple(p.counts[stage_index(p.L, r, c)] for c in range(p.L.vpp))
        key = (first, last, chunks, r > 0)
        if key not in shapes:  # one build per shape: most ranks of a deep pipeline share it
            shapes[key] = _stage_shape(p, r, first, last, chunks)
        out.append(_rank_memory(p, shapes[key], r))
    return out


def _plan(m: ModelConfig, L: ParallelLayout, w: Workload, device: str, bucket_mb: float,
          runtime: Runtime) -> PlanInputs:
    """The plan read once: its in-flight peaks and layer counts (whole sequences), then, per token slice
    when there are slices, what a layer and the head hold and how the gradients are bucketed."""
    from mpformer.parallel.pairwise import MAX_RANKS

    if L.recompute_layers == 0:  # no layer recomputes
        L = replace(L, recompute="none", recompute_layers=None)
    micro = w.global_batch_size // (w.micro_batch_size * L.dp)
    peaks = inflight(L.schedule, L.pp, micro, L.vpp, L.pp_token_slices) if L.pp > 1 else (1,)
    counts = tuple(stage_counts(m, L, w.seq_length))
    if L.pp_token_slices > 1:  # token slices: every unit in flight is a slice, s/k positions (slice_kv_bytes)
        w = replace(w, seq_length=w.seq_length // L.pp_token_slices)
        micro *= L.pp_token_slices
    wb, n_d, stage3 = BYTES[w.precision], L.dp * L.cp, L.zero == 3
    sunk = stage3 and runtime.pooled  # mpformer's ZeRO-3 forms its projections' weight gradients in the buckets

    def units(kind: str) -> tuple[tuple[int, ...], ...]:
        if not (stage3 and runtime.units == "parts"):  # a layer as one unit: its parameters go to the buckets
            return (tuple(layer_param_sizes(m, L.tp, kind, L)),)
        parts = layer_part_sizes(m, L.tp, kind, L)
        groups = zero3_groups([sum(q) for q in parts], runtime.unit_numel)
        return tuple(tuple(n for j in g for n in parts[j]) for g in groups)

    # A mixture of experts: each layer by its MLP kind (sparse or dense); the fields for one layer are the
    # heaviest kind's (what a unit in flight is counted at where the layer is not named).
    kinds = tuple(m.layer_mlp_kind(i) for i in range(m.num_layers)) if m.num_experts else ()
    by_kind = {k: (layer_live(m, L, w, L.recompute, runtime, sunk, k), layer_live(m, L, w, "none", runtime, sunk, k),
                   units(k)) for k in dict.fromkeys(kinds)}
    top = max(by_kind, key=lambda k: by_kind[k][1].saved) if by_kind else m.mlp_kind
    edp = expert_data_size(L) if m.num_experts else n_d  # the routed experts' buckets reduce over it
    red = ReductionSpec(L.zero, n_d, wb if sunk else 4, wb if stage3 and wb < 4 else BYTES[L.grad_reduce_dtype],
                        bucket_mb * 2**20 / 4, MAX_IN_FLIGHT, device == "cpu" and 1 < n_d <= MAX_RANKS,
                        edp=edp, expert_pairwise=device == "cpu" and 1 < edp <= MAX_RANKS,
                        pooled=runtime.pooled or not stage3, budget=runtime.reduce_numel)
    if by_kind:
        recomputed, plain, layer_units = by_kind[top]
    else:
        recomputed, plain = layer_live(m, L, w, L.recompute, runtime, sunk), layer_live(m, L, w, "none", runtime, sunk)
        layer_units = units(m.mlp_kind)
    return PlanInputs(m, L, w, runtime, device, micro, peaks, counts, recomputed, plain, head_live(m, L, w),
                      layer_units, red, kinds, by_kind, expert_param_sizes(m, L, top))


def _stage_shape(p: PlanInputs, r: int, first: bool, last: bool, chunks: tuple[int, ...]) -> StageShape:
    """The stage of rank ``r`` (``chunks``: its layers per chunk): its persistent bytes and its units."""
    L, tied = p.L, p.m.tie_embeddings and first and last
    layers = rank_layers(p.m, L, p.counts, r)
    starts = tuple(sum(p.counts[:stage_index(L, r, c)]) for c in range(L.vpp))
    n = stage_params(p.m, L, sum(chunks), first, last, layers)
    # Experts reduce, and ZeRO shards their state, over the expert-data group (dp cp / ep ranks)
    n_e, edp = stage_expert_params(p.m, L, layers), expert_data_size(L)
    if p.stage3 and p.runtime.shard_bytes is not None:
        state = sum(p.runtime.shard_bytes) * ((n - n_e) / p.n_d + n_e / edp)
    else:
        state = sum(zero_formula_bytes(L.zero, k, d, w=0 if p.stage3 and p.wb < 4 else p.wb, g=4,
                                       m=4 if p.wb < 4 else 0, k=8) for k, d in ((n - n_e, p.n_d), (n_e, edp)) if k)
    # Delayed scaling's amax histories and scales: buffers of every float8 projection (fp8_terms.py)
    state += delayed_state_bytes(p.fp8_projs, p.runtime.fp8) * len(layers)
    if p.w.precision == "fp8" and experts_fp8(p.m, p.runtime.fp8):  # and of the float8 routed experts
        sparse = sum(p.m.layer_mlp_kind(i) == "moe" for i in layers)
        state += expert_state_bytes(p.runtime.fp8, p.m.num_experts // L.ep) * sparse
    units = stage_units(p, first, last, chunks, starts)
    io = p.boundary * (((r > 0 or L.vpp > 1) and not p.shared_input) + (not last or L.vpp > 1))
    per_unit = sum(u.saved for u in units if u.name == "layer") + io
    chunk_kept = tuple(io + sum(p.layer(i, starts[c] + i).saved for i in range(chunks[c])) for c in range(L.vpp))
    if last and L.vpp == 1:  # each micro-batch in flight on the last stage holds its head's (GPipe: many)
        per_unit += p.head.saved
    front = 0.0  # ZeRO-3: the head gathered (a tied head reads the embedding's weight: that unit too)
    if p.stage3:
        gathered = gathers(p, units, tied)
        units = with_gathered(p, units, gathered)
        front = gathered_at_head(p.runtime, gathered[0].size, gathered[0].biggest, p.wb) if last else 0.0
    head_forward = (p.head.forward if last else 0.0) + front
    return StageShape(n, state, tuple(units), per_unit, io, chunk_kept, head_forward)


def _in_flight(p: PlanInputs, s: StageShape, r: int) -> InFlight:
    """Rank ``r``'s units in flight besides the walked one, on the device and offloaded."""
    L, peak = p.L, p.peaks[r]
    on_device, copying = offloaded(L, peak, p.device)  # units kept whole on the device (the walked one too)
    # Host memory: every unit in flight but the ``on_device - 1`` kept whole (the walked one is moved too);
    # a moved unit's received input and sent output stay on the device (engine).
    host = (peak - on_device + copying) * (s.per_unit - s.io)
    # A unit being copied out still holds its last layer's activations on the device (the copy trails
    # the forward by about a layer).
    trailing = (p.recomputed if L.recompute != "none" else p.plain).saved if copying else 0.0
    kept = (on_device - 1) * s.per_unit + (peak - on_device) * s.io + s.io + trailing
    if not copying and L.pp > 1 and L.pp_token_slices == 1 and len(set(s.chunk_kept)) > 1:
        # the units in flight weighed by their own chunks; the walked one is the last chunk's
        kept = weighted_peak(L.schedule, L.pp, p.micro, L.vpp, r, s.chunk_kept) - s.per_unit + s.io
    return InFlight(kept, s.io + trailing, host, copying)


def _rank_memory(p: PlanInputs, s: StageShape, r: int) -> StageMemory:
    """Rank ``r`` of stage shape ``s``: its peak and what the peak is made of."""
    flight = _in_flight(p, s, r)
    # The speculative step's copy (optim/speculate.py: parameters, Adam's m and v, and the gradient
    # shards) held through the next step's forward/backward while its check is in flight.
    speculation = 16.0 * s.params / (p.n_d if p.L.zero >= 1 else 1) if p.runtime.overlap_validation else 0.0
    peak = _peak(p, s, flight, s.state + speculation)
    transients = peak.live - s.state - speculation - peak.activations
    overhead = (ALLOCATOR_FACTOR - 1) * max(transients, 0.0)
    return StageMemory(s.params, s.state, peak.activations, transients, overhead, peak.where, flight.host,
                       speculation)


def _peak(p: PlanInputs, s: StageShape, flight: InFlight, state: float) -> Peak:
    """The rank's peak: the walk's, or the post-validation copy at the optimizer step (``state``: the
    persistent bytes with the speculative copy)."""
    def walked(red: ReductionSpec, kept: float) -> Peak:
        return walk(s.units, red, state=state, kept=kept, head_forward=s.head_forward, micro=p.micro,
                    offloaded=flight.copying)

    if p.red.stage < 2 and p.micro > 1 and p.L.schedule not in SPLIT_BACKWARD and p.runtime.name == MPFORMER.name:
        # Stages 0-1 reduce in the step's last micro-batch's backward only (the engine's no_sync), and
        # then no other micro-batch is in flight on the rank: its peak in flight meets no reduction,
        # the reductions meet only the last micro-batch (a rehearsal of GPT-3 175B, ZeRO-1, full
        # recompute, found the two counted together 5% high).
        during = walked(replace(p.red, dp=1, edp=1), flight.kept)
        reducing = walked(p.red, flight.last_only)
        peak = during if during.live >= reducing.live else reducing
    else:
        peak = walked(p.red, flight.kept)
    # The step's saved copy (optim/speculate.py): fp32 stepped parameters, Adam's m, v
    if p.runtime.post_validation and not p.runtime.overlap_validation:
        copy = s.state + 12.0 * s.params / (p.n_d if p.L.zero >= 1 else 1)
        if copy > peak.live:
            peak = Peak(copy, 0.0, "optimizer step (post-validation copy)")
    return peak
