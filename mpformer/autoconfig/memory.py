"""Memory per device of a plan, per pipeline stage: model state, activations, transients, overhead.

    model state   the ZeRO table (docs/formulas.md, N_d = dp x cp: cp ranks hold the same weights) for
                  the parameters this rank holds: its stage's layers
                  cut by tp (blocks tp replicates - norm gains, kv heads when tp > kv heads - counted
                  whole), the embedding on the first stage, the LM head (or the tied embedding's
                  copy) on the last; bytes per parameter from the precision (16-bit: fp32 main
                  gradients and masters, as mpformer keeps them)
    activations   Korthikanti et al.'s bytes per layer for 16-bit activations (x2 for fp32), with
                  tp / sp / cp (s/cp positions per rank) and the recompute mode, plus what a cp kind
                  saves beyond its own K/V (``cp_extra_bytes_per_layer``: allgather the gathered
                  sequence's K/V, Ulysses kv heads repeated to U), times the layers of one pipeline chunk, times
                  the chunks in flight that the chosen schedule really keeps on this rank (verified
                  from the schedule's own action lists), plus the first stage's embedding output and
                  the last stage's head: with the fused cross entropy (the default) its fp32 input
                  and weight gradients formed in forward plus one chunk's logits (fp32 and the
                  compute dtype, and their exp), without it the fp32 logits and their gradient
    transients    ZeRO-2: one bucket of fp32 gradients in flight; ZeRO-3: two gathered layers and
                  their fp32 gradients
    overhead      a fixed runtime context (CUDA context and workspaces) and a fragmentation factor
                  on everything else (``ALLOCATOR_FACTOR``)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from mpformer.core.layout import ParallelLayout, ulysses_degree
from mpformer.core.model_config import ModelConfig
from mpformer.core.pipeline_plan import stage_counts
from mpformer.optim.memory import zero_formula_bytes

ALLOCATOR_FACTOR = 1.08  # caching-allocator fragmentation on top of the live tensors
RUNTIME_BYTES = {"cuda": 1.5e9, "cpu": 0.4e9}  # CUDA context + cuBLAS/NCCL workspaces; torch on CPU
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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
    kernels: str = "eager"  # how elementwise ops run: fused | eager (mpformer) | composite (kernels.py)
    # What the run's software overlaps (mpformer: bucketed gradient reduction during backward, tensor-
    # parallel collectives not overlapped). Megatron-LM before --overlap-grad-reduce (September 2023)
    # reduced after the backward; --tp-comm-overlap (Transformer Engine) hides TP collectives in GEMMs.
    overlap_grad_reduce: bool = True
    tp_comm_overlap: bool = False
    overlap_p2p: bool = True  # False: each send/receive blocks its rank (Megatron-LM's and DeepSpeed's pipelines)
    # torchtitan's op-level selective activation checkpointing of a layout without recompute: the
    # outputs of every other matmul (wq, wv, w1, w2) and of SDPA saved, wk, wo, w3 and every elementwise
    # op recomputed in backward (its parallelize_llama.py of 2024). A published run's policy: mpformer
    # has no such mode; the cost model prices it, the memory model counts the layout's recompute.
    op_checkpoint: bool = False


@dataclass(frozen=True)
class StageMemory:
    params: int  # parameters this rank holds (before ZeRO sharding)
    model_state: float
    activations: float
    transients: float
    overhead: float

    @property
    def total(self) -> float:
        return self.model_state + self.activations + self.transients + self.overhead


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


def inflight_closed_form(schedule: str, pp: int, microbatches: int, vpp: int) -> tuple[int, ...] | None:
    """Peak in-flight (micro-batch, chunk) units per rank of each generated schedule; equal to verify()
    on the schedules' own action lists for every valid micro-batch count (checked by the unit tests)."""
    p, m, v = pp, microbatches, vpp
    forms = {"1f1b": tuple(min(p - r, m) for r in range(p)), "gpipe": (m,) * p, "zb-h1": (min(p, m),) * p,
             "zb-h2": (min(2 * p - 1, m),) * p, "interleaved": tuple(min(v * p - r, v * m) for r in range(p))}
    return forms.get(schedule)


@lru_cache(maxsize=4096)
def inflight(schedule: str, pp: int, microbatches: int, vpp: int) -> tuple[int, ...]:
    """Peak (micro-batch, chunk) activations each rank holds under the schedule: the closed form (a
    generated schedule), else verify.py on the schedule's own action lists."""
    from mpformer.pipeline.schedules import build_schedule
    from mpformer.pipeline.verify import verify

    if pp == 1:
        return (1,)
    closed = inflight_closed_form(schedule, pp, microbatches, vpp)
    if closed is not None:
        return closed
    return tuple(verify(build_schedule(schedule, pp, microbatches, vpp)).peak_inflight)


def head_bytes(m: ModelConfig, L: ParallelLayout, w: Workload) -> float:
    """What the last stage's head keeps for one micro-batch beyond the layers' activations."""
    tokens, vocab = w.seq_length // L.cp * w.micro_batch_size, -(-m.vocab_size // L.tp)
    if not w.fused_cross_entropy:  # fp32 logits of this rank's vocabulary block and their gradient
        return 2.0 * tokens * vocab * 4
    chunk = min(w.cross_entropy_chunk, tokens)
    return 4.0 * (tokens * m.hidden_size + vocab * m.hidden_size) + chunk * vocab * (4 + 4 + BYTES[w.precision])


def plan_memory(m: ModelConfig, L: ParallelLayout, w: Workload, *, device: str = "cuda",
                bucket_mb: float = 25.0) -> list[StageMemory]:
    """Per pipeline rank (pp entries): the bytes one device of that stage needs."""
    if L.recompute_layers == 0:  # no layer recomputes
        L = replace(L, recompute="none", recompute_layers=None)
    wb = BYTES[w.precision]
    g, master = 4, (4 if wb < 4 else 0)
    micro = w.global_batch_size // (w.micro_batch_size * L.dp)
    peaks = inflight(L.schedule, L.pp, micro, L.vpp) if L.pp > 1 else (1,)
    counts = stage_counts(m, L, w.seq_length)
    act_layer = activation_bytes_per_layer(m, L, w) + cp_extra_bytes_per_layer(m, L, w)
    plain = replace(L, recompute="none", recompute_layers=None)  # layers past recompute_layers keep everything
    act_plain = activation_bytes_per_layer(m, plain, w) + cp_extra_bytes_per_layer(m, plain, w)
    s, b = w.seq_length // L.cp, w.micro_batch_size
    recomputing = 0.0  # live while one layer is recomputed: its activations (full), its cp buffers (allgather)
    if L.recompute == "full":
        recomputing += activation_bytes_per_layer(m, replace(L, recompute="selective"), w)
    if L.recompute != "none" and L.cp > 1:
        recomputing += cp_extra_bytes_per_layer(m, replace(L, recompute="none"), w)
    out = []
    for r in range(L.pp):
        layers = sum(counts[c * L.pp + r] for c in range(L.vpp))
        first, last = r == 0, r == L.pp - 1
        n = stage_params(m, L, layers, first, last)
        state = zero_formula_bytes(L.zero, n, L.dp * L.cp, w=wb, g=g, m=master, k=8)
        chunk_layers = layers / L.vpp
        done = chunk_layers if L.recompute == "none" or L.recompute_layers is None else \
            min(L.recompute_layers, chunk_layers)
        act = peaks[r] * (done * act_layer + (chunk_layers - done) * act_plain) + recomputing
        seq_rank = s // L.tp if L.sequence_parallel else s
        if first:
            act += peaks[r] * seq_rank * b * m.hidden_size * wb
        if last:
            act += head_bytes(m, L, w)
        transient = 0.0
        if L.zero == 2:
            transient = min(bucket_mb * 2**20, n * 4)
        elif L.zero == 3:
            transient = 2 * layer_params_per_rank(m, L.tp) * (wb + 4)
        live = state + act + transient
        out.append(StageMemory(n, state, act, transient, (ALLOCATOR_FACTOR - 1) * live + RUNTIME_BYTES[device]))
    return out
