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
                  beyond its own K/V (``cp_extra_bytes_per_layer``), the pipeline's received inputs and
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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mpformer.autoconfig.inflight import inflight, offloaded, weighted_peak
from mpformer.autoconfig.layer_memory import (
    BYTES,
    layer_bytes,
    megatron_layer_bytes,
    norm_bytes,
    recompute_bytes,
    shape,
)
from mpformer.autoconfig.runtimes import MPFORMER, Runtime, gathered_at_head, parts_gathered, zero3_extras
from mpformer.autoconfig.step_memory import Peak, ReductionSpec, Unit, walk
from mpformer.core.buffers import zero3_groups
from mpformer.core.layout import SPLIT_BACKWARD, ParallelLayout, ulysses_degree
from mpformer.core.model_config import ModelConfig
from mpformer.core.pipeline_plan import rank_ends, stage_counts, stage_index
from mpformer.optim.engine import MAX_IN_FLIGHT
from mpformer.optim.memory import zero_formula_bytes

ALLOCATOR_FACTOR = 1.08  # caching-allocator fragmentation on top of the transients (an allowance, not derived)

@dataclass(frozen=True)
class Workload:
    """What one step computes: the global batch, the sequence, the precision."""

    global_batch_size: int
    micro_batch_size: int
    seq_length: int
    precision: str = "bf16"
    flash_attention: bool = True  # False: attention scores materialised (Megatron before FlashAttention)
    fused_cross_entropy: bool = True  # train.fused_cross_entropy (layers/fused_cross_entropy.py)
    cross_entropy_chunk: int = 1024  # train.cross_entropy_chunk: tokens per chunk of the fused head
    runtime: Runtime = MPFORMER  # whose software runs it (runtimes.py): mpformer's, or a published run's


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
    h, d, f = m.hidden_size, m.head_size, m.ffn_size
    q = m.num_attention_heads * d // tp
    kv = max(m.kv_heads // tp, 1) * d  # kv heads replicate when tp exceeds them
    attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if m.attention_bias else 0) + (h if m.out_proj_bias else 0)
    mlp = (3 if m.gated_mlp else 2) * h * f // tp + (((2 * f if m.gated_mlp else f) // tp + h) if m.mlp_bias else 0)
    norms = 2 * (2 if m.norm_bias else 1) * h
    return attn + mlp + norms


def stage_params(m: ModelConfig, L: ParallelLayout, stage_layers: int, first: bool, last: bool) -> int:
    vocab = -(-m.vocab_size // L.tp) * m.hidden_size
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


def cp_extra_bytes_per_layer(m: ModelConfig, L: ParallelLayout, w: Workload) -> float:
    """Bytes a cp kind keeps per layer for the backward beyond the rank's own K/V (which the layer's
    activations already count), without recompute (a recomputed attention core keeps only its inputs).

    allgather  the K/V gathered over the whole sequence: 2 s b k d, less the rank's own 2 (s/cp) b k d
    ulysses    after the all-to-all each rank keeps q, k, v of U s/cp positions and 1/U of the heads;
               with kv heads repeated to U (U > k): 2 (s/cp) b (U - k) d more
    hybrid     the same for its Ulysses degree; the ring keeps only the rank's own K/V
    (k kv heads per tp rank, d head size, s the whole sequence.)"""
    if L.cp == 1 or L.recompute != "none":
        return 0.0
    seq, b, d, wb = w.seq_length // L.cp, w.micro_batch_size, m.head_size, BYTES[w.precision]
    kv, u = max(m.kv_heads // L.tp, 1), ulysses_degree(L)
    if L.cp_kind == "allgather":
        return 2.0 * (L.cp - 1) * seq * b * kv * d * wb
    return 2.0 * seq * b * (max(kv, u) - kv) * d * wb


def slice_kv_bytes(m: ModelConfig, L: ParallelLayout, w: Workload, mode: str) -> float:
    """Token slices (context_parallel/token_slices.py): what a slice keeps per layer beyond an s/k
    sequence's activations (``w`` is the slice's workload). Its own keys and values, kept for the later
    slices; and, unless the layer recomputes, the attention core's saved keys and values reach back over
    the earlier slices: (j + 1) slices' for slice j, counted at their mean (k + 1) / 2, less the one
    slice's the activations count."""
    k = L.pp_token_slices
    if k == 1:
        return 0.0
    own = 2.0 * w.seq_length * w.micro_batch_size * max(1, m.kv_heads // L.tp) * m.head_size * BYTES[w.precision]
    return own * (1.0 if mode == "full" else (k + 1) / 2)


def head_bytes(m: ModelConfig, L: ParallelLayout, w: Workload) -> float:
    """What the last stage's head holds for one micro-batch beyond the layers' activations, as one sum:
    its kept gradient buffers and one chunk's logits (fused), or fp32 logits and their gradient. (An
    upper bound: plan_memory places the kept part and the chunk at the points of the step where each
    is live, ``_head``.)"""
    tokens, vocab = w.seq_length // L.cp * w.micro_batch_size, -(-m.vocab_size // L.tp)
    if not w.fused_cross_entropy:  # fp32 logits of this rank's vocabulary block and their gradient
        return 2.0 * tokens * vocab * 4
    chunk = min(w.cross_entropy_chunk, tokens)
    return 4.0 * (tokens * m.hidden_size + vocab * m.hidden_size) + chunk * vocab * (4 + 4 + BYTES[w.precision])


def layer_param_sizes(m: ModelConfig, tp: int) -> list[int]:
    """One layer's parameters on one tensor-parallel rank, in model order (how the engine buckets them):
    attention norm, qkv (and bias), o (and bias), MLP norm, up (gate|up), down (and biases)."""
    h, d, f = m.hidden_size, m.head_size, m.ffn_size // tp
    q, kv = m.num_attention_heads * d // tp, max(m.kv_heads // tp, 1) * d
    norm = [h, h] if m.norm_bias else [h]
    width = (2 if m.gated_mlp else 1) * f
    qkv = [h * (q + 2 * kv)] + ([q + 2 * kv] if m.attention_bias else [])
    o = [q * h] + ([h] if m.out_proj_bias else [])
    up = [h * width] + ([width] if m.mlp_bias else [])
    down = [f * h] + ([h] if m.mlp_bias else [])
    return norm + qkv + o + norm + up + down


def layer_part_sizes(m: ModelConfig, tp: int) -> list[list[int]]:
    """layer_param_sizes by the layer's parts (Block.parts(), how mpformer's ZeRO-3 makes units): attention
    norm and qkv, output projection, MLP norm and up, down."""
    sizes = layer_param_sizes(m, tp)
    norm = 2 if m.norm_bias else 1
    cuts = [norm + 1 + m.attention_bias, 1 + m.out_proj_bias, norm + 1 + m.mlp_bias, 1 + m.mlp_bias]
    out, at = [], 0
    for c in cuts:
        out.append(sizes[at:at + c])
        at += c
    return out


def _layer(m: ModelConfig, L: ParallelLayout, w: Workload, mode: str, rt: Runtime,
           sunk: bool = False) -> tuple[float, float]:
    """(kept for backward, live above that in its backward) of one layer under recompute ``mode``; ``sunk``:
    its projections' weight gradients go straight into the gradient buffers (mpformer's ZeRO-3)."""
    Lm = replace(L, recompute=mode, recompute_layers=None)
    kept = cp_extra_bytes_per_layer(m, Lm, w) + slice_kv_bytes(m, L, w, mode)
    again = cp_extra_bytes_per_layer(m, replace(Lm, recompute="none"), w) if mode != "none" and L.cp > 1 else 0.0
    x, wb = shape(m, L, w.seq_length, w.micro_batch_size), BYTES[w.precision]
    tokens = x.s_n * x.b
    if w.flash_attention and rt.block == "mpformer":  # mpformer's own block (and torchtitan's)
        args = (w.seq_length, w.micro_batch_size, w.precision)
        lb = layer_bytes(m, Lm, *args, sunk=sunk)
        if mode == "selective" and rt.selective == "op":  # torchtitan's op-level SAC (runtimes.py)
            saved = wb * x.s_r * x.b * x.h + wb * tokens * (2 * x.q + x.kv + x.f + x.h) + 4 * x.a * tokens
            return saved + kept, layer_bytes(m, Lm, *args, recompute="none").saved - saved + lb.backward
        return lb.saved + kept, lb.backward + recompute_bytes(m, Lm, *args) + again
    # Megatron's block (layer_memory.megatron_layer_bytes; without a flash kernel, whoever runs it). A
    # recomputed layer's activations come back in its backward, which adds the gradients of the MLP's
    # wide activations (while all of them live) or, once the MLP's are freed, the gradient of the
    # attention probabilities.
    args = (w.seq_length, w.micro_batch_size, w.precision, w.flash_attention)
    saved = megatron_layer_bytes(m, Lm, *args)
    again += megatron_layer_bytes(m, Lm, *args, recompute="none") - saved
    mlp_part = (wb + (1 if m.hidden_dropout > 0 else 0)) * x.s_r * x.b * x.h + 2 * wb * tokens * x.f
    probs = wb * x.a * x.s_n * tokens if L.cp == 1 and not w.flash_attention else 0.0
    return saved + kept, again + max(2 * wb * tokens * x.f, probs - mlp_part)


def _head(m: ModelConfig, L: ParallelLayout, w: Workload) -> tuple[float, float, float]:
    """The last stage's head per micro-batch: (kept from its forward to its backward, what its forward's
    chunk adds, what its backward adds). Fused (layers/fused_cross_entropy.py): fp32 dX [n, h] and dW
    [v, h] kept; a chunk's fp32 logits with, in 16-bit, their 16-bit original, or the 16-bit gradient
    and dW's 16-bit product; backward casts dX and dW to the compute dtype. Unfused: the fp32 log-softmax
    [n, v] kept, its gradient and 16-bit cast in backward."""
    x, wb = shape(m, L, w.seq_length, w.micro_batch_size), BYTES[w.precision]
    n, v, h = x.s_n * x.b, -(-m.vocab_size // L.tp), m.hidden_size
    norm = norm_bytes(m, x, wb) if w.flash_attention else wb * x.s_r * x.b * h
    if not w.fused_cross_entropy:  # logits (16-bit), their fp32 copy and log-softmax; its two fp32 gradients
        return norm + 4 * n * v + wb * n * h, (wb if wb < 4 else 0) * n * v + 4 * n * v, 8 * n * v
    c = min(w.cross_entropy_chunk, n)
    chunk = 4 * c * v if wb == 4 else max((wb + 4) * c * v, wb * c * v + wb * v * h + wb * c * h)
    return norm + 4 * (n * h + v * h), chunk, (wb * (n * h + v * h) if wb < 4 else 0.0)  # fp32: no cast


def plan_memory(m: ModelConfig, L: ParallelLayout, w: Workload, *, device: str = "cuda",
                bucket_mb: float = 25.0, runtime: Runtime | None = None) -> list[StageMemory]:
    """Per pipeline rank (pp entries): the bytes one device of that stage needs at its peak (module
    docstring). ``runtime``: whose runtime runs the plan (mpformer's unless modelling a published run
    of another framework, runtimes.py; default: the workload's)."""
    from mpformer.parallel.pairwise import MAX_RANKS

    runtime = w.runtime if runtime is None else runtime
    if L.recompute_layers == 0:  # no layer recomputes
        L = replace(L, recompute="none", recompute_layers=None)
    wb, n_d = BYTES[w.precision], L.dp * L.cp
    micro = w.global_batch_size // (w.micro_batch_size * L.dp)
    peaks = inflight(L.schedule, L.pp, micro, L.vpp, L.pp_token_slices) if L.pp > 1 else (1,)
    counts = stage_counts(m, L, w.seq_length)
    if L.pp_token_slices > 1:  # token slices: every unit in flight is a slice, s/k positions (slice_kv_bytes)
        w = replace(w, seq_length=w.seq_length // L.pp_token_slices)
        micro *= L.pp_token_slices
    x = shape(m, L, w.seq_length, w.micro_batch_size)
    stage3 = L.zero == 3
    sunk = stage3 and runtime.pooled  # mpformer's ZeRO-3 forms its projections' weight gradients in the buckets
    recomputed, plain = _layer(m, L, w, L.recompute, runtime, sunk), _layer(m, L, w, "none", runtime, sunk)
    head_kept, head_fwd, head_bwd = _head(m, L, w)
    v = -(-m.vocab_size // L.tp)
    embed = v * m.hidden_size + (m.max_position_embeddings * m.hidden_size if m.learned_positions else 0)
    layer_units = [layer_param_sizes(m, L.tp)]  # a layer's ZeRO-3 units in forward order (else: one bucket list)
    if stage3 and runtime.units == "parts":
        parts = layer_part_sizes(m, L.tp)
        layer_units = [[n for j in g for n in parts[j]] for g in zero3_groups([sum(p) for p in parts],
                                                                               runtime.unit_numel)]
    rb = BYTES[L.grad_reduce_dtype]
    red = ReductionSpec(L.zero, n_d, wb if stage3 and runtime.pooled else 4, wb if stage3 and wb < 4 else rb,
                    bucket_mb * 2**20 / 4, MAX_IN_FLIGHT, device == "cpu" and 1 < n_d <= MAX_RANKS,
                    pooled=runtime.pooled or not stage3, budget=runtime.reduce_numel)
    shared_input = L.recompute == "full" or m.norm_type == "layernorm" or wb == 4  # the first norm keeps it

    def recomputes(i: int) -> bool:  # a chunk's layer i: the first recompute_layers of each chunk (all: None)
        return L.recompute != "none" and (L.recompute_layers is None or i < L.recompute_layers)

    def build(r: int, first: bool, last: bool, chunks: tuple[int, ...]) -> tuple:
        """One stage shape: its parameters, persistent bytes, units and what a micro-batch in flight keeps."""
        n = stage_params(m, L, sum(chunks), first, last)
        if stage3 and runtime.shard_bytes is not None:
            state = sum(runtime.shard_bytes) * n / n_d
        else:
            state = zero_formula_bytes(L.zero, n, n_d, w=0 if stage3 and wb < 4 else wb, g=4,
                                       m=4 if wb < 4 else 0, k=8)
        tied = m.tie_embeddings and first and last
        # Token slices: from a slice's backward until the earlier slices' own, their keys' and values'
        # gradients wait in every layer (context_parallel/token_slices.py): k - 1 slices' worth.
        leaf_grads = slice_kv_bytes(m, replace(L, recompute="full"), w, "full") * (L.pp_token_slices - 1)
        # This micro-batch's units in backward order: the head, each chunk's layers from the last, the embedding.
        units: list[Unit] = []
        if last:
            head = [(2 if m.norm_bias else 1) * m.hidden_size] + ([] if tied else [v * m.hidden_size])
            units.append(Unit("head", head, head_kept, 0.0, head_bwd))
        # The schedule's in-flight units are (micro-batch, chunk) pairs: the walk runs the last chunk's
        # layers; the other chunks' layers only carry their parameters into the gradient buckets.
        # A layer's units from its last: its kept activations end with its first, each sees its backward's
        # (the layer's peak: conservative for all but the unit where it falls).
        full = {}  # walked layers that run their forward again in their backward
        for c in reversed(range(L.vpp)):
            for i in reversed(range(chunks[c])):
                recompute = recomputes(i)
                keep, back = recomputed if recompute else plain
                back += leaf_grads * chunks[c]  # token slices: the earlier slices' key/value gradients, every layer
                carry = wb * v * m.hidden_size if tied else 0.0  # the head's dW waits for the embedding's
                walked = c == L.vpp - 1
                full[(c, i)] = recompute and L.recompute == "full"
                for j in reversed(range(len(layer_units))):
                    units.append(Unit("layer", layer_units[j], keep if walked and j == 0 else 0.0,
                                      back if walked else 0.0, carry, layer=(c, i)))
        if first:
            units.append(Unit("embedding", [embed], 0.0, 0.0, wb * embed))
        io = wb * x.s_r * x.b * m.hidden_size * (((r > 0 or L.vpp > 1) and not shared_input) + (not last or L.vpp > 1))
        per_chunk = sum(u.saved for u in units if u.name == "layer") + io
        # what a unit of each chunk keeps (a balanced or explicit split gives the chunks unequal layers)
        chunk_kept = tuple(io + sum((recomputed if recomputes(i) else plain)[0] for i in range(chunks[c]))
                           for c in range(L.vpp))
        if last and L.vpp == 1:  # each micro-batch in flight on the last stage holds its head's (GPipe: many)
            per_chunk += head_kept
        front = 0.0
        if stage3:
            # a tied head reads the embedding's weight: its region gathers that unit too
            reads_embed = [embed if u.name == "head" and tied else 0 for u in units]
            sizes = [float(sum(u.params) + e) for u, e in zip(units, reads_embed)]
            biggest = [float(max(*u.params, e)) for u, e in zip(units, reads_embed)]
            reads = [u.name != "embedding" for u in units]
            if runtime.units == "parts":
                gathered = parts_gathered(sizes, reads, [u.layer for u in units],
                                          [full.get(u.layer, False) for u in units], runtime.prefetch_numel)
                extras = [wb * g for g in gathered]
            else:
                extras = zero3_extras(runtime, sizes, biggest, reads, wb, n_d)
            units = [replace(u, extra=u.extra + e) for u, e in zip(units, extras)]
            front = gathered_at_head(runtime, sizes[0], biggest[0], wb) if last else 0.0
        return n, state, units, per_chunk, io, (head_fwd if last else 0.0) + front, chunk_kept

    # Ranks of the same shape (most of a deep pipeline) differ only in how many micro-batches they
    # keep in flight, which walk() adds last: one build per shape.
    out, shapes = [], {}
    for r in range(L.pp):
        first, last = rank_ends(L, r)  # a V schedule's rank 0 holds both ends
        chunks = tuple(counts[stage_index(L, r, c)] for c in range(L.vpp))
        key = (first, last, chunks, r > 0)
        if key not in shapes:
            shapes[key] = build(r, first, last, chunks)
        n, state, units, per_chunk, io, head_forward, chunk_kept = shapes[key]
        held, copying = offloaded(L, peaks[r], device)
        # Host memory: every unit in flight but the ``held - 1`` kept whole (the walked one is moved too);
        # a moved unit's received input and sent output stay on the device (engine).
        host = (peaks[r] - held + copying) * (per_chunk - io)
        # A unit being copied out still holds its last layer's activations on the device (the copy trails
        # the forward by about a layer).
        pending = (recomputed if L.recompute != "none" else plain)[0] if copying else 0.0
        kept = (held - 1) * per_chunk + (peaks[r] - held) * io + io + pending
        if not copying and L.pp > 1 and L.pp_token_slices == 1 and len(set(chunk_kept)) > 1:
            # the units in flight weighed by their own chunks; the walked one is the last chunk's
            kept = weighted_peak(L.schedule, L.pp, micro, L.vpp, r, chunk_kept) - per_chunk + io
        # The speculative step's copy (optim/speculate.py: parameters, Adam's m and v, and the gradient
        # shards) held through the next step's forward/backward while its check is in flight.
        held = 16.0 * n / (n_d if L.zero >= 1 else 1) if runtime.overlap_validation else 0.0
        peak = walk(units, red, state=state + held, kept=kept, head_forward=head_forward, micro=micro,
                    offloaded=copying)
        if red.stage < 2 and micro > 1 and L.schedule not in SPLIT_BACKWARD and runtime.name == MPFORMER.name:
            # Stages 0-1 reduce in the step's last micro-batch's backward only (the engine's no_sync), and
            # then no other micro-batch is in flight on the rank: its peak in flight meets no reduction,
            # the reductions meet only the last micro-batch (a rehearsal of GPT-3 175B, ZeRO-1, full
            # recompute, found the two counted together 5% high).
            during = walk(units, replace(red, dp=1), state=state + held, kept=kept, head_forward=head_forward,
                          micro=micro, offloaded=copying)
            last = walk(units, red, state=state + held, kept=io + pending, head_forward=head_forward, micro=micro,
                        offloaded=copying)
            peak = during if during.live >= last.live else last
        # The step's saved copy (optim/speculate.py): fp32 stepped parameters, Adam's m, v
        if runtime.post_validation and not runtime.overlap_validation:
            copy = state + 12.0 * n / (n_d if L.zero >= 1 else 1)
            if copy > peak.live:
                peak = Peak(copy, 0.0, "optimizer step (post-validation copy)")
        transients = peak.live - state - held - peak.activations
        overhead = (ALLOCATOR_FACTOR - 1) * max(transients, 0.0)
        out.append(StageMemory(n, state, peak.activations, transients, overhead, peak.where, host, held))
    return out
