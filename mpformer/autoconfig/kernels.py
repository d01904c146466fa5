"""A transformer layer, the LM head and the embedding as the kernels that run them, counted.

The cost model (cost.py) times three kinds of work from the device's own rates:

    GEMMs         (m, n, k) of every matmul: the forward Y = X W (m tokens, n out, k in) and its two
                  backward products dX = dY W^T (m, k, n) and dW = X^T dY (k, n, m)
    attention     the core's FLOPs (a causal mask halves the score matrix a flash kernel computes);
                  without a flash kernel its two batched GEMMs per pass plus the score matrix that the
                  softmax and dropout kernels read and write (Megatron before FlashAttention)
    memory-bound  norms, rotary embedding, activation, residual adds and dropout, casts, the
                  weight-gradient accumulation: bytes read + written, and how many kernels launch

Bytes are counted per kernel from what it reads and writes (an elementwise forward reads its inputs
and writes its output; its backward reads the saved input and the incoming gradient and writes the
outgoing one). ``Workload.kernels`` says how the run implements the elementwise ops:

    fused      one kernel per op: Megatron-LM's / Transformer Engine's fused norm, bias-GeLU,
               SwiGLU, rotary and bias-dropout-add kernels, or torch.compile; the weight gradient
               accumulated into the fp32 main gradient by the GEMM itself (gradient-accumulation fusion)
    eager      PyTorch eager op by op, with torch's own fused norm kernels (mpformer on CUDA: fp32 cast,
               F.rms_norm, cast back, weight; rotate-half RoPE; silu then mul; the 16-bit weight
               gradient added into the fp32 main gradient by a kernel of its own)
    composite  eager with RMSNorm written as elementwise ops (pow, mean, rsqrt, mul: Hugging Face's
               LlamaRMSNorm, and torch before it had a fused rms_norm)

Shapes per micro-batch on one rank: T = (s / cp) b tokens, t = tp, q = a d / t query width, kv = k d / t
(kv heads replicate when tp exceeds them), f the FFN width / t, X the
residual stream elements (T h, or T h / t under sequence parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpformer.autoconfig.expert_cost import moe_gemms
from mpformer.autoconfig.fp8_terms import (
    Fp8Proj,
    cast_stream,
    casts_per_pass,
    copies_per_pass,
    experts_fp8,
    fp8_projections,
)
from mpformer.core.fp8_config import Fp8Options, compute_precision
from mpformer.core.layer_spec import attention_kind, mlp_kind
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig

KERNELS = ("fused", "eager", "composite")
FP32 = 4


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    batch: int = 1
    out_bytes: int = 2  # bytes per output element (fp32 when it accumulates into the main gradient)
    accumulate: bool = False  # reads its output too (beta = 1: gradient-accumulation fusion)
    dtype: str | None = None  # "fp8": a float8 GEMM (1-byte operands, the FP8 rate); None: the pass's dtype


@dataclass
class Pass:
    """One pass (forward, input gradients or weight gradients) of one layer, one micro-batch, one rank."""

    gemms: list[Gemm] = field(default_factory=list)
    stream_bytes: float = 0.0  # memory-bound kernels: bytes read + written
    launches: int = 0  # kernels launched (GEMMs and attention included)
    attention_flops: float = 0.0  # flash-kernel FLOPs (causal half counted once)

    def add(self, nbytes: float, kernels: int) -> None:
        self.stream_bytes += nbytes
        self.launches += kernels


@dataclass
class LayerWork:
    f: Pass
    bi: Pass  # input gradients
    bw: Pass  # weight gradients
    attn_f: Pass = field(default_factory=Pass)  # the attention core (what selective recompute reruns)
    attn_b: Pass = field(default_factory=Pass)


def dims(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int) -> dict[str, int]:
    t, s, b = L.tp, seq_length // L.cp, micro_batch
    d = m.head_size
    return {"T": s * b, "s": s, "s_k": s * L.cp, "b": b, "h": m.hidden_size, "d": d,
            "q": m.num_attention_heads * d // t, "kv": max(m.kv_heads // t, 1) * d,
            "heads": m.num_attention_heads // t, "f": m.ffn_size // t,
            "X": s * b * m.hidden_size // (t if L.sequence_parallel else 1)}


def _norm(p_f: Pass, p_b: Pass, n: float, a: int, kernels: str, rms: bool) -> None:
    """One norm over n elements. fused: read x, write y; backward reads x and dy, writes dx (one kernel
    each, two for LayerNorm's weight and bias gradients). eager (mpformer): the fp32 cast and back
    around the fused kernel, and the weight multiply. composite RMSNorm: cast, pow, mean, x * rsqrt,
    cast back, * weight as separate kernels, each backward twice its forward."""
    if kernels == "fused" or not rms:
        p_f.add(2 * n * a, 1)
        p_b.add(3 * n * a, 1 if rms else 2)
        return
    cast = 0 if a == FP32 else 1
    if kernels == "eager":  # x.float(); F.rms_norm; .to(dtype); * weight
        fwd = cast * 2 * n * (a + FP32) + 2 * n * FP32 + 3 * n * a
        p_f.add(fwd, 2 + 2 * cast)
        p_b.add(2 * fwd, 3 + 2 * cast)
        return
    fwd = cast * n * (a + FP32) + 2 * n * FP32 + n * FP32 + 3 * n * FP32 + cast * n * (FP32 + a) + 3 * n * a
    p_f.add(fwd, 5 + 2 * cast)  # cast, pow, mean, (rsqrt: per row), mul, cast back, * weight
    p_b.add(2 * fwd, 2 * (5 + 2 * cast))


def attention_kernel(m: ModelConfig, L: ParallelLayout, seq_length: int, runtime: str, flash: bool,
                     cpu_host: bool, precision: str = "bf16") -> str:
    """The kernel the attention core runs, as its name in a profile: another framework's published run as
    published (``flash``: "flash", else "math": two batched GEMMs and the score matrix between them);
    mpformer's by the runtime's own choice (context_parallel/fused.py ``attention_kernel``, torch's
    backend rules): on a GPU "flash" (fp16/bf16, no mask) or "efficient" (fp32 as TF32, or a mask: the
    edge tiles of a window that cuts the sequence), dropout in either; documents run per document and a
    token slice as its past keys' block and its own causal one, unmasked. On a CPU "cpu_flash", but "math"
    with attention dropout (torch's CPU flash kernel takes none: dropout_tiles.py's einsum tiles). A
    GPU call no fused kernel takes fails at its first step (the runtime never falls back to SDPA's
    math): so does the plan here, in one line."""
    import torch

    from mpformer.context_parallel.fused import NoFusedKernel
    from mpformer.context_parallel.fused import attention_kernel as runtime_choice
    from mpformer.core.errors import ConfigError

    if not flash:
        return "math"
    if runtime != "mpformer":
        return "flash"
    dropout = m.attention_dropout > 0
    if cpu_host:
        return "math" if dropout else "cpu_flash"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[compute_precision(precision)]
    mask = m.sliding_window is not None and m.sliding_window < seq_length
    try:
        return runtime_choice("cuda", dtype, m.head_size, mask=mask, dropout=dropout)
    except NoFusedKernel as e:
        raise ConfigError(str(e)) from None


def layer_work(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, precision: str,
               kernels: str = "eager", flash: bool = True, main_grad_fp32: bool = True,
               kind: str | None = None, fp8: Fp8Options | None = None) -> LayerWork:
    """Every kernel of one decoder layer (pre-norm attention + MLP blocks, as models/transformer.py);
    ``kind``: its MLP kind (default the model's; a sparse layer's GEMMs: expert_cost.py). Under precision
    fp8 (``fp8``: train.fp8, default its defaults) the float8 projections' GEMMs are float8 and their
    casts and layout copies memory-bound kernels (fp8_terms.py); the rest is bf16."""
    a = FP32 if precision == "fp32" else 2
    x = dims(m, L, seq_length, micro_batch)
    T, q, kv, f, X = x["T"], x["q"], x["kv"], x["f"], x["X"]
    F, BI, BW = Pass(), Pass(), Pass()
    # The projections' GEMMs and their two backward products each. The weight gradient either accumulates
    # into the fp32 main gradient inside the GEMM (fused), or is written in the compute dtype and
    # then added into it by a kernel of its own (eager: 3 reads/writes of the weight's size).
    fused_acc = kernels == "fused" and main_grad_fp32
    # The sublayers' projections as their kinds describe them (core/layer_spec.py; dense: qkv, o, up, down).
    kind = m.mlp_kind if kind is None else kind
    proj = [(T, g.n, g.k, 1) for g in attention_kind(m.attention_kind).projections(m, L.tp)]
    o = (fp8 if fp8 is not None else Fp8Options()) if precision == "fp8" else None
    float8 = fp8_projections(m, L.tp, o, kind) if o is not None else ()

    def dense8(n_: int, k_: int) -> Fp8Proj | None:  # the float8 Linear of this shape, if any
        return next((p for p in float8 if (p.n, p.k) == (n_, k_)), None)

    p8s = [dense8(n_, k_) for _, n_, k_, _ in proj]
    if kind == "moe":  # the router, the experts' grouped GEMMs at their rows per expert, the shared experts
        gemms = moe_gemms(m, L, seq_length, micro_batch)
        experts8 = o is not None and experts_fp8(m, o)  # the grouped GEMMs (entries 1, 2) in float8
        proj += gemms
        p8s += [(Fp8Proj("experts", k_, n_, False) if experts8 else None) if i in (1, 2) else
                (dense8(n_, k_) if i else None) for i, (_, n_, k_, _) in enumerate(gemms)]  # 0: the router
    else:
        proj += [(T, g.n, g.k, 1) for g in mlp_kind(kind).projections(m, L.tp)]
        p8s += [dense8(n_, k_) for _, n_, k_, _ in proj[len(p8s):]]
    for (mm, nn_, kk, bt), p8 in zip(proj, p8s, strict=True):
        dt = "fp8" if p8 is not None else None
        F.gemms.append(Gemm(mm, nn_, kk, batch=bt, out_bytes=a, dtype=dt))
        BI.gemms.append(Gemm(mm, kk, nn_, batch=bt, out_bytes=a, dtype=dt))
        BW.gemms.append(Gemm(kk, nn_, mm, batch=bt, out_bytes=FP32 if fused_acc else a, accumulate=fused_acc,
                             dtype=dt))
        if p8 is not None and o is not None:
            _fp8_casts(F, BI, BW, p8, o, mm, kernels == "fused", bt)
        if not fused_acc:
            BW.add(bt * kk * nn_ * (a + 2 * FP32) if main_grad_fp32 else 3 * bt * kk * nn_ * a, 1)
    F.launches += len(proj)
    BI.launches += len(proj)
    BW.launches += len(proj)
    rms = m.norm_type == "rmsnorm"
    for _ in range(2):
        _norm(F, BI, X, a, kernels, rms)
    # Residual adds (with dropout: GPT's bias-dropout-add; a 1-byte mask written, read in backward).
    drop = m.hidden_dropout > 0
    for _ in range(2):
        if kernels == "fused" or not drop:
            F.add(3 * X * a + (X if drop else 0), 1)
            BI.add((2 * X * a + X) if drop else 0, 1 if drop else 0)
        else:  # dropout, then add
            F.add(2 * X * a + X + 3 * X * a, 2)
            BI.add(2 * X * a + X, 1)
    # Rotary embedding on q and k (per rank: the full sequence of its heads).
    if not m.learned_positions:
        n = T * (q + kv)
        if kernels == "fused":
            F.add(2 * n * a, 1)
            BI.add(2 * n * a, 1)
        else:  # x * cos + rotate_half(x) * sin: chunk+cat, two multiplies, one add
            F.add((2 + 3 + 3 + 3) * n * a, 4)
            BI.add((3 + 5 + 3) * n * a, 4)
    # The activation: GeLU (bias folded into it when fused) or SwiGLU's silu(gate) * up.
    if m.gated_mlp:
        if kernels == "fused":
            F.add(3 * T * f * a, 1)
            BI.add(5 * T * f * a, 1)
        else:  # silu, then mul
            F.add((2 + 3) * T * f * a, 2)
            BI.add((3 + 5) * T * f * a, 2)
    else:
        F.add(2 * T * f * a, 1)
        BI.add(3 * T * f * a, 1)
    work = LayerWork(F, BI, BW)
    _attention(work.attn_f, work.attn_b, m, x, a, kernels, flash)
    return work


def _fp8_casts(F: Pass, BI: Pass, BW: Pass, p8, o: Fp8Options, tokens: int, fused: bool, batch: int = 1) -> None:
    """A float8 projection's amax-scale-casts per pass and the layout copies _scaled_mm needs
    (fp8_terms.py): memory-bound kernels; ``batch`` experts of one grouped GEMM, each cast as one tensor
    (one kernel sequence for all of them: their scales are vectors)."""
    for p, elems in zip((F, BI, BW), casts_per_pass(p8, o, tokens), strict=True):
        for e in elems:
            p.add(*cast_stream(batch * e, fused))
    dgrad, wgrad = copies_per_pass(p8, o, tokens)
    BI.add(batch * dgrad, 1)
    BW.add(batch * wgrad, 2)


def _attention(F: Pass, BI: Pass, m: ModelConfig, x: dict[str, int], a: int, kernels: str, flash: bool) -> None:
    """The attention core. A flash kernel: 4 s s_k d FLOPs per head forward, causal half, 2.5x that in
    backward (FlashAttention-2: five matmuls to the forward's two); eager q/k/v are made contiguous
    for it and its output copied back. Without one: QK^T and PV batched GEMMs (and two each in
    backward), the scores written by the first, softmax and dropout reading and writing them."""
    s, s_k, b, d, heads, kvh = x["s"], x["s_k"], x["b"], x["d"], x["heads"], max(x["kv"] // x["d"], 1)
    bh = b * heads
    if flash:  # causal: half the scores (a cp rank's zigzag chunks too: half of its s x s_k)
        flops = 0.5 * 4.0 * s * s_k * d * bh
        F.attention_flops += flops
        BI.attention_flops += 2.5 * flops
        F.launches += 1
        BI.launches += 1
        if kernels != "fused":
            n = s * b * d * (heads + 2 * kvh)
            F.add(2 * n * a + 2 * s * b * heads * d * a, 4)
            BI.add(2 * n * a + 2 * s * b * heads * d * a, 4)
        return
    P = float(bh * s * s_k)  # the score matrix, all of it (no kernel skips the masked half)
    F.gemms += [Gemm(s, s_k, d, batch=bh, out_bytes=a), Gemm(s, d, s_k, batch=bh, out_bytes=a)]
    BI.gemms += [Gemm(s, s_k, d, batch=bh, out_bytes=a), Gemm(s_k, d, s, batch=bh, out_bytes=a),
                 Gemm(s, d, s_k, batch=bh, out_bytes=a), Gemm(s_k, d, s, batch=bh, out_bytes=a)]
    drop = m.attention_dropout > 0 or m.hidden_dropout > 0
    F.add(2 * P * a + ((2 * P * a + P) if drop else 0), 2 + (1 if drop else 0))
    BI.add(3 * P * a + ((2 * P * a + P) if drop else 0), 4 + (1 if drop else 0))


def head_work(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, precision: str,
              kernels: str = "eager", fused_cross_entropy: bool = True) -> LayerWork:
    """The last stage's final norm, LM head and cross entropy (the first stage's embedding is
    ``embedding_work``). Logits per rank: T x V/t.

    Cross entropy without the fused head (Megatron's vocab-parallel CE on fp32 logits): cast, max,
    subtract, exp, sum, divide in forward, the gradient scaled and cast back in backward: about 13
    reads/writes of 4 bytes per logit. The fused head (mpformer's default, chunked): logits formed
    per chunk in fp32 (written, max, exp-sum, the softmax gradient written and read by the two
    gradient GEMMs in forward): 6 passes of 4 bytes, and no logit tensor kept."""
    a = FP32 if precision == "fp32" else 2
    x = dims(m, L, seq_length, micro_batch)
    T, h = x["T"], x["h"]
    V = -(-m.vocab_size // L.tp)
    F, BI, BW = Pass(), Pass(), Pass()
    _norm(F, BI, x["X"], a, kernels, m.norm_type == "rmsnorm")
    F.gemms.append(Gemm(T, V, h, out_bytes=FP32 if fused_cross_entropy else a))
    BI.gemms.append(Gemm(T, h, V, out_bytes=a))
    BW.gemms.append(Gemm(h, V, T, out_bytes=FP32))
    logits = float(T) * V
    if fused_cross_entropy:
        F.add(6 * FP32 * logits, 4)
    else:
        F.add(logits * (a + FP32) + 8 * FP32 * logits, 6)
        BI.add(4 * FP32 * logits + logits * (FP32 + a), 3)
    F.launches += 1
    BI.launches += 1
    BW.launches += 1
    return LayerWork(F, BI, BW)


def embedding_work(m: ModelConfig, L: ParallelLayout, seq_length: int, micro_batch: int, precision: str) -> LayerWork:
    """The first stage's token (and learned position) embedding: rows gathered in forward (vocab-
    parallel: masked, zeros elsewhere); in backward the dense gradient of the rank's V/t x h block
    zeroed, the rows added into it and the block added into the fp32 main gradient."""
    a = FP32 if precision == "fp32" else 2
    x = dims(m, L, seq_length, micro_batch)
    T, h = x["T"], x["h"]
    V = -(-m.vocab_size // L.tp)
    tables = 2 if m.learned_positions else 1
    F, BI, BW = Pass(), Pass(), Pass()
    F.add(tables * 2 * T * h * a + (3 * T * h * a if L.tp > 1 else 0), tables + (1 if L.tp > 1 else 0))
    BW.add(V * h * a + 2 * T * h * a + V * h * (a + 2 * FP32), 3)
    return LayerWork(F, BI, BW)
