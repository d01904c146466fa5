"""One block of attention on torch's fused kernels, forward and backward, returning the log-sum-exp.

The blocks of an attention plan (core/attention_plan.py) each run as one call of the fused kernel
of their device, the same ops torch's scaled_dot_product_attention dispatches to, called directly
because merging blocks needs the softmax statistics (lse) that SDPA does not return:

    cpu                 aten._scaled_dot_product_flash_attention_for_cpu (+ _backward): any dtype,
                        GQA natively, an additive mask of the block's size
    cuda, 16-bit        aten._scaled_dot_product_flash_attention (+ _backward): GQA natively; no mask
    cuda, fp32 or mask  aten._scaled_dot_product_efficient_attention (+ _backward): kv heads repeated
                        for GQA, the mask as an attention bias

Shapes: q ``[b, n, q, d]``, k and v ``[b, kv, s, d]``, out like q, lse ``[b, n, q]`` fp32 (fp64 for
fp64). The backward is given the *final* output and lse of the rows (after every block is merged):
with them each block's gradients are its exact share (flash attention's algebra: P = exp(S - lse),
dS = P * (dO Vᵀ - rowsum(dO * O))), so no block's own output needs keeping.
"""

from __future__ import annotations

import functools

import torch

from mpformer.core.attention_plan import CAUSAL, MASKED, Block

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


def _mask(q: torch.Tensor, block: Block, window: int | None) -> torch.Tensor | None:
    if block.kind != MASKED:
        return None
    assert window is not None, "a masked block comes only from a sliding window"
    return block_mask(block.q_pos - block.k_pos, block.q_len, block.k_len, window, q.dtype, q.device)


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads ``[b, k, s, d]`` repeated to ``heads`` (each query head's own), for kernels without GQA."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _cuda_flash(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return q.dtype in _LOW and mask is None and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """The efficient kernel's lse layout: rows rounded up to 32."""
    pad = -(-lse.shape[-1] // 32) * 32 - lse.shape[-1]
    return torch.nn.functional.pad(lse, (0, pad)) if pad else lse


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, window: int | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, n, q, d] in q's dtype, lse [b, n, q] fp32)`` of one block (rows already sliced)."""
    causal, mask = block.kind == CAUSAL, _mask(q, block, window)
    if q.device.type == "cuda":
        if _cuda_flash(q, mask):
            out, lse = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
            return out, lse
        n = q.shape[1]
        bias = None if mask is None else mask.expand(q.shape[0], n, -1, -1)
        out, lse = _aten._scaled_dot_product_efficient_attention(
            q, repeat_kv(k, n), repeat_kv(v, n), bias, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :q.shape[2]]
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, block: Block, window: int | None, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block, given the rows' final ``out`` (q's dtype) and ``lse``."""
    causal, mask = block.kind == CAUSAL, _mask(q, block, window)
    if q.device.type == "cuda":
        b, n, sq, _ = q.shape
        empty = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: no philox state read
        if _cuda_flash(q, mask):
            return _aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse.contiguous(), None, None, sq, k.shape[2], 0.0, causal, empty, empty,
                scale=scale)
        bias = None if mask is None else mask.expand(b, n, -1, -1)
        kr, vr = repeat_kv(k, n), repeat_kv(v, n)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, kr, vr, bias, out, _padded_lse(lse.contiguous()), empty, empty, 0.0, [True, True, True, False],
            causal, scale=scale)
        g = n // k.shape[1]
        if g > 1:  # the repeated heads' gradients summed back onto their kv head
            dk, dv = (t.unflatten(1, (k.shape[1], g)).sum(2) for t in (dk, dv))
        return dq, dk, dv
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
