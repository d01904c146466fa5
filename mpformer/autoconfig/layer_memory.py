"""What mpformer's own layers keep for backward, and what their backward adds, counted op by op.

Korthikanti et al.'s 34 s b h (autoconfig/memory.py ``activation_bytes_per_layer``) counts Megatron's
GPT layer (GeLU MLP of 4h, LayerNorm, dropout masks, attention scores); ``megatron_layer_bytes`` below
counts the same block op by op for any width, kv heads, gate, dropout and attention kernel (the runs
of Megatron-LM, Megatron-Core and Megatron-DeepSpeed). mpformer's block differs
(SwiGLU, RMSNorm with fp32 statistics, SDPA), so the memory model counts what its modules save, per
micro-batch and rank, in bytes (``wb``: the parameter and activation dtype's bytes; s_n = s / cp the
rank's positions, s_r = s_n / t under sequence parallelism, else s_n; q, kv, f the rank's query,
key/value and MLP widths, a its heads, d the head size):

    norm (x2)       RMSNorm: its input as it came (wb s_r b h) and the 1/rms rows in fp32 (4 s_r b;
                    layers/norm.py); LayerNorm: its input (wb s_r b h) and mean and 1/std rows in fp32 (8 s_r b)
    linear input    the input of the qkv and of the MLP projection: the norm output (wb s_r b h each;
                    under sequence parallelism the rank's shard, gathered again in backward)
    attention       none: SDPA's q, k, v (wb s_n b (q + 2 kv); RoPE's outputs and contiguous copies)
                    and output (wb s_n b q), its log-sum-exp rows (4 a s_n b), the output projection's
                    input (a contiguous copy, wb s_n b q); RoPE tables cast to wb per call (4 s_n d wb)
                    selective: the core's inputs: q and k after RoPE and the qkv output that v views
                    (wb s_n b (2q + 3kv)), without RoPE the qkv output alone; the projection's input
    MLP             SwiGLU: gate and up outputs, silu(gate), the product (4 wb s_n b f); GeLU: the up
                    output and the GeLU output (2 wb s_n b f)
    dropout         a 1-byte mask per hidden dropout (2 s_r b h) when model.hidden_dropout > 0
    full recompute  the layer's input alone (wb s_r b h); during its backward the layer's activations
                    are recomputed and live again

``tests/unit/test_layer_memory.py`` checks these against the bytes autograd saves (torch's
saved-tensor hooks) for GPT-2 and Llama blocks in fp32 and bf16 under each recompute mode.

The backward of a layer adds, above what it keeps: the gradients of the MLP's f-wide activations,
two at once for SwiGLU (of silu(gate) and of up, while the incoming one lives: 2 wb s_n b f), and for
GeLU one (wb s_n b f) while its up projection's weight gradient is formed (wb f h; not under ZeRO-3,
whose projections form their weight gradients in the unit's buffer). Measured on the
same blocks (profiler memory events): exact in fp32; in bf16 a 16-bit weight gradient can still be
held while the next node runs (up to 15% of the layer's saved bytes at h = 128, none at h = 256).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpformer.autoconfig.expert_memory import (
    MOE,
    expert_rows,
    expert_tp,
    moe_backward_bytes,
    moe_saved_bytes,
    routed_tokens,
)
from mpformer.autoconfig.fp8_terms import experts_fp8, fp8_expert_bytes, fp8_layer_bytes, fp8_projections
from mpformer.core.fp8_config import Fp8Options
from mpformer.core.layer_spec import attention_kind, mlp_kind
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig

# fp8: bf16 parameters and activations; its float8 projections' saved inputs, weight copies and casts are
# counted apart (fp8_terms.py)
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


@dataclass(frozen=True)
class LayerBytes:
    """One layer's saved bytes by part (one micro-batch, one rank), and what its backward adds."""

    norms: float  # both norms and the two linear inputs
    attention: float
    mlp: float
    other: float  # RoPE table casts, dropout masks
    backward: float  # live above the saved bytes while the layer runs its backward
    fp8: float = 0.0  # train.precision=fp8: the float8 weight copies less the inputs' saving (fp8_terms.py)

    @property
    def saved(self) -> float:
        return self.norms + self.attention + self.mlp + self.other + self.fp8


@dataclass(frozen=True)
class Shape:
    """The per-rank sizes the counts use."""

    s_n: float  # positions per rank (s / cp)
    s_r: float  # positions of the residual stream (s_n / t under sequence parallelism)
    b: int
    h: int
    q: int  # query width per rank (heads x head size)
    kv: int  # key/value width per rank
    f: int  # MLP width per rank
    a: int  # query heads per rank
    d: int  # head size


def shape(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int) -> Shape:
    s_n = seq_length / L.cp
    d, t = m.head_size, L.tp
    return Shape(s_n, s_n / t if L.sequence_parallel else s_n, micro_batch, m.hidden_size,
                 m.num_attention_heads // t * d, max(m.kv_heads // t, 1) * d, m.ffn_size // t,
                 m.num_attention_heads // t, d)


def norm_bytes(m: ModelConfig, x: Shape, wb: int) -> float:
    """What one norm keeps (its output is counted where it is consumed)."""
    rows = x.s_r * x.b
    if m.norm_type == "rmsnorm":
        return wb * rows * x.h + 4 * rows
    return wb * rows * x.h + 2 * 4 * rows


def layer_bytes(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, precision: str,
                recompute: str | None = None, sunk: bool = False, kind: str = "dense",
                fp8: Fp8Options | None = None, fused_casts: bool = False, fp8_gathered: bool = False) -> LayerBytes:
    """mpformer's block: what one layer keeps per micro-batch on one rank under ``recompute`` (default:
    the layout's), and what its backward adds (module docstring); ``sunk``: its weight gradients are
    formed in a gradient buffer (ZeRO-3's gradient sink, layers/linear.py), not beside it; ``kind``:
    the layer's MLP kind (``layer_mlp_kind``; a sparse layer's MLP is counted in expert_memory.py);
    ``fp8``: train.fp8 under precision fp8 (default: its defaults), whose float8 projections keep
    1-byte inputs and weight copies and add their casts to the backward (fp8_terms.py; ``fused_casts``: a
    runtime whose casts are single kernels; ``fp8_gathered``: the weights arrive in float8 from mpformer's
    ZeRO-3 gather, the forward saving no copy of its own)."""
    wb, x = BYTES[precision], shape(m, L, seq_length, micro_batch)
    mode = L.recompute if recompute is None else recompute
    tokens, gated, rope = x.s_n * x.b, m.gated_mlp, not m.learned_positions
    mlp = (4 if gated else 2) * wb * tokens * x.f
    # SwiGLU: the two f-wide gradients, or, in a short sequence (fewer tokens than h: a token slice),
    # the fused gate/up projection's weight gradient [2f, h] formed beside its grad (measured: 1.38 MiB
    # at 256 tokens, the former; 2.06 at 64, the latter and the slices' key gradients; h = 256).
    backward = (max(2 * wb * tokens * x.f, 0 if sunk else 2 * wb * x.f * x.h) if gated
                else wb * tokens * x.f + (0 if sunk else wb * x.f * x.h))
    if kind == MOE:
        mlp = moe_saved_bytes(m, L, seq_length, micro_batch, wb, mode)
        backward = moe_backward_bytes(m, L, seq_length, micro_batch, wb)
    f8 = 0.0
    if precision == "fp8":
        o = fp8 if fp8 is not None else Fp8Options()
        terms = fp8_layer_bytes(fp8_projections(m, L.tp, o, kind), o, x.s_n, x.s_r, x.b, fused_casts, fp8_gathered)
        f8, peak = terms.weight_copies - terms.input_saving, terms.cast_peak
        if kind == MOE and experts_fp8(m, o):  # the routed experts' grouped GEMMs (fp8_terms.py)
            et = fp8_expert_bytes(o, x.h, m.expert_ffn_size // expert_tp(L), m.num_experts // L.ep,
                                  expert_rows(m, routed_tokens(m, L, seq_length, micro_batch)), wb, mode, fused_casts)
            f8, peak = f8 + et.weight_copies - et.input_saving, max(peak, et.cast_peak)
        backward += peak
    if mode == "full":  # the recomputed forward saves the float8 copies again (recompute_bytes)
        return LayerBytes(wb * x.s_r * x.b * x.h, 0.0, 0.0, 0.0, backward)
    norms = 2 * norm_bytes(m, x, wb) + 2 * wb * x.s_r * x.b * x.h
    if mode == "selective":
        core_inputs = (2 * x.q + 3 * x.kv) if rope else (x.q + 2 * x.kv)
        attention = wb * tokens * core_inputs + wb * tokens * x.q
    else:
        attention = wb * tokens * (x.q + 2 * x.kv) + 4 * x.a * tokens + 2 * wb * tokens * x.q
    other = (4 * x.s_n * x.d * wb if rope and wb < 4 else 0.0) + (2 * x.s_r * x.b * x.h if m.hidden_dropout > 0 else 0)
    return LayerBytes(norms, attention, mlp, other, backward, f8)


def recompute_bytes(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, precision: str,
                    kind: str = "dense", fp8: Fp8Options | None = None, fp8_gathered: bool = False) -> float:
    """Live above the kept input while a fully recomputed layer runs its backward: its activations again,
    of which the kept input is one (the first norm saves the input itself, either kind)."""
    if L.recompute != "full":
        return 0.0
    f8 = {"fp8": fp8, "fp8_gathered": fp8_gathered}
    again = layer_bytes(m, L, seq_length, micro_batch, precision, recompute="none", kind=kind, **f8).saved
    return again - layer_bytes(m, L, seq_length, micro_batch, precision, kind=kind, **f8).saved


def megatron_layer_bytes(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, precision: str,
                         flash: bool, recompute: str | None = None) -> float:
    """What Megatron's block (Megatron-LM, Megatron-Core with Transformer Engine, Megatron-DeepSpeed)
    keeps per micro-batch on one rank: Korthikanti et al.'s Table 2, op by op, for any MLP width, kv
    heads, gate and dropout. Per token: the two norms' inputs and the qkv and MLP inputs (wb h each;
    under sequence parallelism the rank's shard, the all-gather redone in backward), a 1-byte mask per
    hidden dropout, q, k, v (wb (q + 2 kv)) and the attention output (wb q, the projection's input),
    the MLP's up output(s) and activation output (wb f x 2 or 3); an attention that writes its scores
    keeps the softmax output, and with attention dropout its mask and output (wb + 1 + wb per score),
    a flash kernel its log-sum-exp rows instead (fp32). Selective recompute drops the scores; full keeps
    the layer's input (the rank's shard under sequence parallelism). GPT-3 (h 4h MLP, MHA, dropout):
    34 s b h (t-sharded under sequence parallelism, else 10 + 24 / t) + 5 a s^2 b / t, as published."""
    wb, x = BYTES[precision], shape(m, L, seq_length, micro_batch)
    mode = L.recompute if recompute is None else recompute
    rows, tokens = x.s_r * x.b, x.s_n * x.b
    if mode == "full":
        return wb * rows * x.h
    masks = 2 * rows * x.h if m.hidden_dropout > 0 else 0.0
    residual = 4 * wb * rows * x.h + masks
    attention = wb * tokens * attention_kind(m.attention_kind).saved(m, L.tp)
    if flash:
        attention += 4 * x.a * tokens
    elif mode == "none":
        attention += (2 * wb + 1 if m.attention_dropout > 0 else wb) * x.a * x.s_n * tokens
    mlp = wb * tokens * mlp_kind(m.mlp_kind).saved(m, L.tp)
    return residual + attention + mlp
