"""Linear layers. Today: one single-device linear with a CPU low-precision fast path.

Why a custom backward on CPU: under bf16/fp16 autocast, the input gradient ``dX = dY @ W`` is a
GEMM whose second operand is row-major ``W [out, in]`` (the "NN" layout). On CPUs without native
bf16 matmul units (AVX2 only) oneDNN runs that layout ~20x slower than the transposed one
(measured 0.7-1.3 vs 15-24 GFLOP/s, benchmarks/bench_throughput.py). Computing it as
``dY @ (W^T contiguous)^T`` costs one small copy of W and puts the GEMM in the fast layout; the
values are the same products summed in the same precision. fp32 and GPU paths are untouched:
there the copy only costs time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LOW = (torch.bfloat16, torch.float16)


class _CpuLowPrecisionLinear(torch.autograd.Function):
    """y = x W^T + b with dX taken through a contiguous W^T (inputs already in the low dtype)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy, w.t().contiguous().t())
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = dy2.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on CPU under bf16/fp16 autocast where the input gradient uses the fast layout."""
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        if dt in _LOW:
            with torch.autocast("cpu", enabled=False):
                # Casting outside the Function keeps autograd's cast back to fp32 for the master weights.
                b = bias.to(dt) if bias is not None else None
                return _CpuLowPrecisionLinear.apply(x.to(dt), weight.to(dt), b)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear with the CPU low-precision backward above; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
