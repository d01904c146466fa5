"""LayerNorm and RMSNorm, with apex's fused kernels as an optional fast path.

The native path (torch.nn.functional.layer_norm / rms_norm) is the default and the one CI tests;
apex is used only when asked for (``use_apex=True``) and importable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpformer.parallel.device import DeviceLike


def _apex_norm(kind: str):  # pragma: no cover - apex is not installable on CPU machines
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
    except ImportError as e:
        raise ImportError("use_apex=True but apex is not installed; install NVIDIA apex or drop the flag") from e
    return FusedLayerNorm if kind == "layernorm" else FusedRMSNorm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 like HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6,
                 device: DeviceLike = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(in_dtype)


def build_norm(kind: str, dim: int, eps: float, *, use_apex: bool = False,
               device: DeviceLike = None, dtype: torch.dtype | None = None) -> nn.Module:
    """Build the norm an architecture uses: 'layernorm' (weight and bias) or 'rmsnorm' (weight)."""
    if use_apex:  # pragma: no cover
        return _apex_norm(kind)(dim, eps=eps).to(device=device, dtype=dtype)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, device=device, dtype=dtype)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps, device=device, dtype=dtype)
    raise ValueError(f"unknown norm kind {kind!r}; valid: layernorm, rmsnorm")
