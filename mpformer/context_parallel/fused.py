"""One block of attention on torch's fused kernels, forward and backward, returning the log-sum-exp.

The blocks of an attention plan (core/attention_plan.py) each run as one call of the fused kernel
of their device, the same ops torch's scaled_dot_product_attention dispatches to, called directly
because merging blocks needs the softmax statistics (lse) that SDPA does not return:

    cpu                 aten._scaled_dot_product_flash_attention_for_cpu (+ _backward): any dtype,
                        GQA natively, an additive mask of the block's size
    cuda, 16-bit        aten._scaled_dot_product_flash_attention (+ _backward): GQA natively; no mask
    cuda, fp32 or mask  aten._scaled_dot_product_efficient_attention (+ _backward): kv heads repeated
                        for GQA, the mask as an attention bias

``attention_kernel`` is the one place that choice is made (a call no fused kernel takes is refused,
never sent to SDPA's math kernel). On CUDA both kernels also take dropout: a block's mask comes from
its philox state, kept for its backward (blocks merge linearly: dropout scales each probability,
exp(s - lse) of the final lse, alike in every block). Whole causal sequences on CUDA run
``FusedAttention``, one kernel call, as SDPA would.

Shapes: q ``[b, n, q, d]``, k and v ``[b, kv, s, d]``, out like q, lse ``[b, n, q]`` fp32 (fp64 for
fp64). The backward is given the *final* output and lse of the rows (after every block is merged):
with them each block's gradients are its exact share (flash attention's algebra: P = exp(S - lse),
dS = P * (dO Vᵀ - rowsum(dO * O))), so no block's own output needs keeping.
"""

from __future__ import annotations

import functools

import torch

from mpformer.core.attention_plan import CAUSAL, MASKED, ScoreBlock
from mpformer.parallel.device import kernel_device

_aten = torch.ops.aten
_LOW = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=64)
def block_mask(offset: int, q_len: int, k_len: int, window: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """The additive mask ``[q_len, k_len]`` (0 seen, -inf not) of a masked block whose first query is
    ``offset`` positions after its first key; at most TILE x TILE (the plan's bound), cached by shape."""
    i = torch.arange(q_len, device=device)[:, None] + offset
    j = torch.arange(k_len, device=device)[None, :]
    seen = (j <= i) & (i - j < window)
    pad = -(-k_len // 16) * 16  # CUDA's efficient kernel wants the bias rows 16-element aligned
    out = torch.zeros(q_len, pad, dtype=dtype, device=device)
    out[:, :k_len].masked_fill_(~seen, float("-inf"))
    return out[:, :k_len]


def _mask(q: torch.Tensor, block: ScoreBlock, window: int | None) -> torch.Tensor | None:
    if block.kind != MASKED:
        return None
    assert window is not None, "a masked block comes only from a sliding window"
    return block_mask(block.q_pos - block.k_pos, block.q_len, block.k_len, window, q.dtype, q.device)


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads ``[b, k, s, d]`` repeated to ``heads`` (each query head's own), for kernels without GQA."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


FLASH, EFFICIENT, CUDNN, MATH, CPU_FLASH = "flash", "efficient", "cudnn", "math", "cpu_flash"


class NoFusedKernel(ValueError):
    """An attention call no fused kernel of its device takes: on a GPU it would run SDPA's math kernel,
    which forms the [q, s] scores, so it is refused instead."""


def attention_kernel(device: str, dtype: torch.dtype, head_dim: int, *, mask: bool = False,
                     dropout: bool = False) -> str:
    """The one choice of kernel for an attention call, by torch's own rules for its fused kernels
    (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), on GPUs of compute capability 8.0 or later
    (A100, H100, H200):

        cuda  flash      fp16/bf16, head dim a multiple of 8 up to 256, no mask (causal or full);
                         grouped-query heads natively; dropout
              efficient  fp16/bf16 (head dim a multiple of 8) or fp32 (a multiple of 4); a mask as an
                         attention bias; dropout; kv heads repeated for grouped-query heads (the kernel
                         takes them equal)
              (math)     anything else: ``NoFusedKernel``
        cpu   cpu_flash  any dtype, a mask, grouped-query heads; no dropout (the CPU's dropout runs
                         dropout_tiles.py, or SDPA's math for a block of at most a tile)

    cuDNN's kernel is not chosen: torch ranks it below flash and efficient, and it takes no
    grouped-query heads. The runtime calls the chosen kernel's op directly (never SDPA's dispatch, whose
    fallback is math), the cost model prices it (autoconfig/kernels.py), a rehearsal reports it."""
    if device != "cuda":
        if dropout:
            raise NoFusedKernel("attention dropout on CPU: torch's CPU flash kernel takes none")
        return CPU_FLASH
    if dtype in _LOW and not mask and head_dim % 8 == 0 and head_dim <= 256:
        return FLASH
    if (dtype in _LOW and head_dim % 8 == 0) or (dtype == torch.float32 and head_dim % 4 == 0):
        return EFFICIENT
    raise NoFusedKernel(f"attention with head dim {head_dim} in {dtype} has no fused CUDA kernel (flash: fp16/bf16, "
                        f"head dim a multiple of 8 up to 256; efficient: a multiple of 8 in fp16/bf16, of 4 in fp32); "
                        "SDPA would fall back to its math kernel and form the [s, s] scores")


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """The efficient kernel's lse layout: rows rounded up to 32."""
    pad = -(-lse.shape[-1] // 32) * 32 - lse.shape[-1]
    return torch.nn.functional.pad(lse, (0, pad)) if pad else lse


Rng = tuple[torch.Tensor, torch.Tensor] | None  # a CUDA kernel's philox seed and offset: its dropout mask


def _cuda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                  dropout: float, scale: float) -> tuple[torch.Tensor, torch.Tensor, Rng]:
    kernel = attention_kernel("cuda", q.dtype, q.shape[-1], mask=mask is not None, dropout=dropout > 0)
    if kernel == FLASH:
        out, lse, *_, seed, offset, _ = _aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False,
                                                                                  scale=scale)
        return out, lse, (seed, offset) if dropout > 0 else None
    n = q.shape[1]
    bias = None if mask is None else mask.expand(q.shape[0], n, -1, -1)
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, repeat_kv(k, n), repeat_kv(v, n), bias, True, dropout, causal, scale=scale)
    return out, lse[..., :q.shape[2]], (seed, offset) if dropout > 0 else None


def _cuda_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, mask: torch.Tensor | None, causal: bool, dropout: float, rng: Rng,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, n, sq, _ = q.shape
    kernel = attention_kernel("cuda", q.dtype, q.shape[-1], mask=mask is not None, dropout=dropout > 0)
    empty = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: no philox state read
    seed, offset = rng if rng is not None else (empty, empty)
    if kernel == FLASH:
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, sq, k.shape[2], dropout, causal, seed, offset,
            scale=scale)
    bias = None if mask is None else mask.expand(b, n, -1, -1)
    kr, vr = repeat_kv(k, n), repeat_kv(v, n)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, kr, vr, bias, out, _padded_lse(lse.contiguous()), seed, offset, dropout, [True, True, True, False],
        causal, scale=scale)
    g = n // k.shape[1]
    if g > 1:  # the repeated heads' gradients summed back onto their kv head
        dk, dv = (t.unflatten(1, (k.shape[1], g)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: ScoreBlock, window: int | None,
                  scale: float, dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, Rng]:
    """``(out [b, n, q, d] in q's dtype, lse [b, n, q] fp32, rng)`` of one block (rows already sliced);
    ``rng``: the CUDA kernel's dropout state for the backward (None without dropout)."""
    causal, mask = block.kind == CAUSAL, _mask(q, block, window)
    if kernel_device(q) == "cuda":
        return _cuda_forward(q, k, v, mask, causal, dropout, scale)
    assert dropout == 0, "no fused CPU kernel takes dropout (dropout_tiles.py runs it)"
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse, None


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, block: ScoreBlock, window: int | None, scale: float, dropout: float = 0.0,
                   rng: Rng = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block, given the rows' final ``out`` (q's dtype) and ``lse``, and the
    block's own ``rng`` from its forward."""
    causal, mask = block.kind == CAUSAL, _mask(q, block, window)
    if kernel_device(q) == "cuda":
        return _cuda_backward(dout, q, k, v, out, lse, mask, causal, dropout, rng, scale)
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


class FusedAttention(torch.autograd.Function):
    """Causal attention over whole sequences on one CUDA fused kernel, dropout included: what torch's
    SDPA runs on a GPU, called directly so that the kernel is ``attention_kernel``'s (never math). Saves
    what SDPA's flash path saves: q, k, v, the output, the log-sum-exp and the dropout state."""

    @staticmethod
    def forward(ctx, q, k, v, dropout, scale):
        out, lse, rng = _cuda_forward(q, k, v, None, True, dropout, scale)
        ctx.save_for_backward(q, k, v, out, lse, *(rng or ()))
        ctx.dropout, ctx.scale = dropout, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rng = ctx.saved_tensors
        dq, dk, dv = _cuda_backward(dout.contiguous(), q, k, v, out, lse, None, True, ctx.dropout,
                                    tuple(rng) or None, ctx.scale)
        return dq, dk, dv, None, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout: float = 0.0,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention of whole sequences on a CUDA (or rehearsed) device: ``FusedAttention``."""
    assert kernel_device(q) == "cuda", "the CPU runs SDPA (layers/attention.py)"
    return FusedAttention.apply(q, k, v, dropout, q.shape[-1] ** -0.5 if scale is None else scale)
