"""FP8 numerics: formats, scales and the recipes that choose them (issue 35, train.precision=fp8).

A float8 GEMM ``A @ B`` runs as ``_scaled_mm(A8, B8, scale_a, scale_b)`` with ``A = A8 * scale_a`` and
``B = B8 * scale_b``: a scale here is the *dequantizing* factor (Transformer Engine's ``scale_inv``),
``A8 = saturate(A / scale_a).to(fp8)``. Its definition, for an amax ``a`` of the scaled elements and
the format's largest finite value ``fmax``::

    scale = max(a * 2**margin / fmax, TINY)   if a > 0
    scale = 1                                 if a == 0   (an all-zero tensor: nothing to stretch)

``TINY`` is fp32's smallest normal (1.18e-38): for an amax in fp32's denormal range ``a / fmax`` would
itself be denormal or 0, and ``A / scale`` would lose bits or be inf; floored, ``|A| / scale <= fmax``
still holds. The cast saturates (clamps to +-fmax) before rounding: torch's ``.to(float8_e5m2)`` sends
an overflow to inf and ``.to(float8_e4m3fn)`` to NaN, and a delayed scale may be smaller than this step's
amax calls for.

Recipes (``Float8Recipe.name``):
- tensorwise: one scale per operand from its own amax (torchao's dynamic tensorwise recipe);
- rowwise: per row of the left operand and per column of the right one, the amax taken along the
  contraction dimension so that the scales factor out of the sum (scale shapes [M, 1] and [1, N], fp32,
  as ``_scaled_mm`` requires). Each GEMM contracts over a different dimension, so the backward GEMMs
  re-cast their operands from the high-precision tensors rather than reuse the forward's (torchao's
  rowwise recipe does the same);
- delayed: the scale of each tensor role (input, weight, output gradient) comes from the max of an amax
  history of the previous ``history_len`` uses; this use's amax joins the history after the cast
  (Transformer Engine's DelayedScaling with amax_compute_algo="max"). ``DelayedScalingState`` holds the
  histories and saves/loads them as tensors for checkpoints.

Gradients (the output gradient dY) are cast to ``grad``: e5m2 is TE's HYBRID format (e4m3 in forward,
e5m2's range in backward), e4m3 TE's E4M3 format. ``train.fp8.grad_dtype=auto`` (core/fp8_config.py
grad_format) picks e5m2 for tensorwise and delayed scaling and e4m3 for rowwise, as torchao's recipes do.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from mpformer.core.fp8_config import grad_format

FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FMAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
TINY = torch.finfo(torch.float32).tiny
RECIPES = ("tensorwise", "rowwise", "delayed")
ROLES = ("input", "weight", "grad_output")  # the three tensors of a linear layer that are cast
ALIGN = 16  # _scaled_mm on CUDA: K and N of every GEMM multiples of 16 (the CPU kernel does not check)


@dataclass(frozen=True)
class Float8Recipe:
    """train.fp8: ``name`` tensorwise|rowwise|delayed; ``grad`` the output gradient's format (e4m3|e5m2);
    ``history_len`` and ``margin``: delayed scaling's amax window and the power of two of headroom
    (scale = amax * 2**margin / fmax, for every recipe; 0 leaves the top of the format in use)."""

    name: str = "tensorwise"
    grad: str = "auto"  # the recipe's own (core/fp8_config.py grad_format): never "auto" once built
    history_len: int = 16
    margin: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "grad", grad_format(self.name, self.grad))
        if self.name not in RECIPES:
            raise ValueError(f"train.fp8.recipe={self.name!r}: not a recipe; valid: {', '.join(RECIPES)}")
        if self.grad not in FORMATS:
            raise ValueError(f"train.fp8.grad={self.grad!r}: not a float8 format; valid: {', '.join(FORMATS)}")
        if self.history_len < 1:
            raise ValueError(f"train.fp8.history_len={self.history_len}: must be at least 1")
        if self.margin < 0:
            raise ValueError(f"train.fp8.margin={self.margin}: must be >= 0 (a power of two of headroom)")

    def dtype(self, role: str) -> torch.dtype:
        """The float8 dtype the tensor of ``role`` is cast to: e4m3 forward, ``grad`` for dY."""
        return FORMATS[self.grad] if role == "grad_output" else torch.float8_e4m3fn


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The dequantizing scale(s) for amax(es) ``amax`` (any shape, fp32 out): amax * 2**margin / fmax,
    1 where amax is 0, floored at fp32's smallest normal (see the module docstring)."""
    amax = amax.float()
    scale = torch.clamp(amax * (2.0**margin) / FMAX[dtype], min=TINY)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def tensorwise_scale(t: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """A 0-d fp32 scale from ``t``'s amax."""
    return scale_from_amax(t.detach().abs().amax(), dtype, margin)


def rowwise_scale(t: torch.Tensor, dim: int, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """Scales of ``t`` (2-D) from its amax along ``dim`` (the contraction dimension), kept as a dim of
    size 1: ``dim=1`` of a left operand [M, K] gives [M, 1]; ``dim=0`` of a right operand [K, N] gives [1, N]."""
    return scale_from_amax(t.detach().abs().amax(dim=dim, keepdim=True), dtype, margin).contiguous()


def cast_to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(t / scale) rounded to ``dtype`` (round to nearest even, as torch's cast does); ``scale``
    broadcasts against ``t`` (0-d, [M, 1] or [1, N])."""
    fmax = FMAX[dtype]
    return torch.clamp(t.detach().float() / scale, -fmax, fmax).to(dtype)


class DelayedScalingState:
    """Per-layer delayed-scaling state: an amax history of ``history_len`` per role, and the scale each
    role's next cast uses. ``scale(role)`` is what the next cast of ``role`` divides by; ``record(role,
    amax)`` then rolls ``amax`` into the history (newest at index 0, the oldest falls off) and sets the
    next scale from the history's max. The first use of a role (history all zero)
    takes its scale from its own amax (``scale_for``), as a tensorwise cast would: scale 1 would flush a
    gradient of 1e-5 to zero in e5m2. A non-finite amax (an overflowed step) is recorded as 0, so it
    cannot poison the next ``history_len`` scales (TE keeps the previous scale then)."""

    def __init__(self, recipe: Float8Recipe, device: torch.device | str | None = None) -> None:
        if recipe.name != "delayed":
            raise ValueError(f"DelayedScalingState is for train.fp8.recipe=delayed, not {recipe.name!r}")
        self.recipe = recipe
        self.amax_history = torch.zeros(len(ROLES), recipe.history_len, dtype=torch.float32, device=device)
        self.scales = torch.ones(len(ROLES), dtype=torch.float32, device=device)
        # full recompute (layers/fp8_layer.py): the first forward appends the scales it cast with to
        # ``stash``; the recompute takes them from ``replay`` in the same order and records nothing
        self.stash: collections.deque[torch.Tensor] | None = None
        self.replay: collections.deque[torch.Tensor] | None = None

    def scale(self, role: str) -> torch.Tensor:
        """The 0-d scale the next cast of ``role`` uses (a copy: a later record does not change it)."""
        return self.scales[ROLES.index(role)].clone()

    def scale_for(self, role: str, amax: torch.Tensor) -> torch.Tensor:
        """``scale(role)``, or on the role's first use (nothing recorded yet) the scale of ``amax``
        itself; on the device, no host read."""
        i = ROLES.index(role)
        fresh = scale_from_amax(torch.nan_to_num(amax.detach().float(), posinf=0.0), self.recipe.dtype(role),
                                self.recipe.margin)
        return torch.where(self.amax_history[i].amax() > 0, self.scales[i], fresh.to(self.scales.device))

    def record(self, role: str, amax: torch.Tensor) -> None:
        """``amax`` of this use of ``role`` joins the history; the next scale follows (TE's update)."""
        i = ROLES.index(role)
        with torch.no_grad():
            row = self.amax_history[i]
            row.copy_(torch.roll(row, 1))
            a = amax.detach().float().to(row.device)
            row[0] = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
            self.scales[i] = scale_from_amax(row.amax(), self.recipe.dtype(role), self.recipe.margin)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors for a checkpoint: ``amax_history`` [3, H] (rows in ROLES order) and ``scale`` [3]."""
        return {"amax_history": self.amax_history.clone(), "scale": self.scales.clone()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        hist = sd["amax_history"]
        if tuple(hist.shape) != tuple(self.amax_history.shape):
            raise ValueError(f"fp8 delayed-scaling state: amax_history of shape {tuple(hist.shape)} where this "
                             f"run keeps {tuple(self.amax_history.shape)} (train.fp8.history_len changed?)")
        self.amax_history.copy_(hist)
        self.scales.copy_(sd["scale"])


def check_fp8_dims(name: str, in_features: int, out_features: int) -> None:
    """At a layer's construction: the weight's dimensions are the K and N of the float8 GEMMs, which
    ``_scaled_mm`` on CUDA takes only in multiples of 16 (the CPU kernel runs any size: the same rule
    holds here so that a layout that trains on CPU also runs on a GPU)."""
    bad = [f"{k}={v}" for k, v in (("in_features", in_features), ("out_features", out_features)) if v % ALIGN]
    if bad:
        raise ValueError(f"train.precision=fp8: layer {name} has {', '.join(bad)}; float8 GEMMs need "
                         f"multiples of {ALIGN} (pad the dimension or keep this layer in bf16)")
