"""LayerNorm and RMSNorm, with apex's fused kernels as an optional fast path.

The native path (torch.nn.functional.layer_norm / rms_norm) is the default and the one CI tests;
apex is used only when asked for (``use_apex=True``) and importable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpformer.core.shards import Shard
from mpformer.parallel.comm import all_reduce_sum
from mpformer.parallel.device import DeviceLike, no_autocast
from mpformer.parallel.tensor_parallel import GradSpec, Part, TPContext

_aten = torch.ops.aten
# torch's fused RMSNorm forward (aten._fused_rms_norm: output and 1/rms) is 2.8's (pytorch PR 153666);
# pyproject's floor is older: there the same two results come from plain ops (``_rms_norm_stats``).
FUSED_RMS_NORM = hasattr(_aten, "_fused_rms_norm")


def _rms_norm_stats(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, 1/rms)`` as aten._fused_rms_norm gives them: statistics in fp32 (fp64 for fp64), the output in
    x's dtype, multiplied by ``weight`` when given."""
    acc = torch.promote_types(x.dtype, torch.float32)
    rstd = torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + eps)
    out = (x.to(acc) * rstd).to(x.dtype)
    return (out * weight if weight is not None else out), rstd


def rms_norm_stats(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused kernel where this torch has it (``fused``: force a path, for tests)."""
    if FUSED_RMS_NORM if fused is None else fused:
        return _aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    return _rms_norm_stats(x, weight, eps)


def _apex_norm(kind: str):  # pragma: no cover - apex is not installable on CPU machines
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
    except ImportError as e:
        raise ImportError("use_apex=True but apex is not installed; install NVIDIA apex or drop the flag") from e
    return FusedLayerNorm if kind == "layernorm" else FusedRMSNorm


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm keeping for backward only its input as it came (the compute dtype) and the per-row 1/rms
    in fp32: no fp32 copy of the input and no normalised copy for the gain's gradient (torch's own
    rms_norm on CPU is composite and autograd keeps both). Forward is torch's fused kernel (statistics
    in fp32 whatever the input's dtype); backward recomputes the normalised rows in fp32:

        x̂ = x·r   y = g·x̂   dg = Σ_rows dy·x̂   dx = r·(dx̂ - x̂·mean(dx̂·x̂))  with dx̂ = dy·g

    A gain of another dtype than the input (fp32 gains under autocast) multiplies the normalised input
    in the input's dtype, as HF's LlamaRMSNorm computes it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        same = weight.dtype == x.dtype
        out, rstd = rms_norm_stats(x, weight if same else None, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out if same else weight * out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32, fp64 for fp64 (exact tests)
        normed = x.to(acc) * rstd
        dw = None
        if ctx.needs_input_grad[1]:
            rounded = normed if weight.dtype == x.dtype else normed.to(x.dtype).to(acc)
            dw = (dout.to(acc) * rounded).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dn = dout.to(acc) * weight.to(acc)
            dx = (rstd * (dn - normed * (dn * normed).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32 like HF's LlamaRMSNorm; saves its input
    and the 1/rms rows (``_RMSNormFn``)."""

    def __init__(self, dim: int, eps: float = 1e-6,
                 device: DeviceLike = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class SplitRMSNorm(nn.Module):
    """RMSNorm over a vector whose elements are split over the tp ranks by ``part``'s rule (OLMoE's q/k
    norm over every head's projection, the heads split over tp): this rank holds its block of the gain
    and of each row; the row's sum of squares is all-reduced over tp (``all_reduce_sum``: every rank
    normalises its own block by it, so its backward sums too). Kv heads replicated over r ranks
    (tp > kv heads) enter the sum r times: it is divided by r. The gain's gradient is complete on a
    rank (its rows see every token: the projection's output is sequence-gathered), save that the r
    copies of a replicated block each hold a part, summed over their replica group."""

    def __init__(self, part: Part, tp: TPContext, eps: float = 1e-6,
                 device: DeviceLike = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.part, self.tp, self.eps = part, tp, eps
        self.start, rows = part.block(tp.rank, tp.size)
        self.replicas = part.replicas(tp.size)
        self.weight = nn.Parameter(torch.ones(rows, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)  # statistics in fp32, as HF's OlmoeRMSNorm
        xf = x.to(acc)
        sumsq = all_reduce_sum(xf.pow(2).sum(-1, keepdim=True), self.tp.comm)
        rstd = torch.rsqrt(sumsq / (self.part.rows * self.replicas) + self.eps)
        return self.weight * (xf * rstd).to(x.dtype)

    def canonical_shards(self, name: str) -> dict[str, Shard]:
        return {f"{name}.weight": Shard.rows(self.weight, self.part.rows, self.start)}

    def grad_specs(self) -> list[GradSpec]:
        sync = self.tp.replica_comm(self.replicas) if self.replicas > 1 else None
        return [GradSpec(self.weight, None, self.replicas, sync)]


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that keeps its input in the input's dtype: autocast would run it in fp32 and save an
    fp32 copy of a 16-bit input for backward (twice the bytes of the residual stream, two norms a layer:
    4 s b h / t more than Korthikanti et al.'s 34 s b h / t at t = 8). torch's kernel takes 16-bit
    input and weights and computes its statistics in fp32 (saved as fp32 rows), as apex's fused
    LayerNorm and Megatron do; the output, in the input's dtype, is what the next GEMM reads anyway."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or x.dtype != self.weight.dtype:
            return super().forward(x)
        with no_autocast(x):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def build_norm(kind: str, dim: int, eps: float, *, use_apex: bool = False,
               device: DeviceLike = None, dtype: torch.dtype | None = None) -> nn.Module:
    """Build the norm an architecture uses: 'layernorm' (weight and bias) or 'rmsnorm' (weight)."""
    if use_apex:  # pragma: no cover
        return _apex_norm(kind)(dim, eps=eps).to(device=device, dtype=dtype)
    if kind == "layernorm":
        return LayerNorm(dim, eps=eps, device=device, dtype=dtype)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"unknown norm kind {kind!r}; valid: layernorm, rmsnorm")
