"""CUDA autocast's casting policy on data-free (meta) tensors, for a rehearsal (training/rehearsal.py).

torch's autocast is a dispatch key of the device (AutocastCUDA, AutocastCPU); meta tensors have none,
so ``torch.autocast("cuda")`` changes nothing on them (on a CPU-only build it is even switched off
with a warning). A rehearsal stands meta tensors in for a GPU's, and the dtypes it sees (and so the
bytes it counts) must be those a GPU would produce: ``MetaAutocast`` applies CUDA autocast's op
lists at the torch-function level, above autograd, so its casts are recorded and their backward runs
as a GPU's would. The lists are torch's documented CUDA lists ("Autocast Op Reference"); an op in
neither runs in its inputs' dtypes, as under autocast.

Only ops called through torch's Python API are seen; ``torch.ops.aten`` calls made directly (the
fused attention and RMSNorm kernels) run in their inputs' dtypes, as they do under CUDA autocast,
which lists none of them.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_map

# Ops CUDA autocast runs in the lower precision (float16 or bfloat16).
LOWER = frozenset({
    "__matmul__", "__rmatmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul",
    "multi_dot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "linear", "matmul", "mm", "mv", "prelu", "scaled_dot_product_attention",
})
# Ops CUDA autocast runs in float32.
FP32 = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
    "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum",
    "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss",
    "layer_norm", "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
    "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss",
    "softmax", "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss",
})
# Ops CUDA autocast runs in the widest of their inputs' floating dtypes.
PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
                     "scatter_add", "tensordot"})
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _cast(args: object, dtype: torch.dtype) -> object:
    """Floating meta tensors (not float64, as autocast leaves it) cast to ``dtype``."""
    def one(t: object) -> object:
        if isinstance(t, torch.Tensor) and t.is_meta and t.dtype in _CASTABLE[:3] and t.dtype != dtype:
            return t.to(dtype)
        return t
    return tree_map(one, args)


def _widest(args: object) -> torch.dtype | None:
    dtypes = [t.dtype for t in torch.utils._pytree.tree_leaves(args)
              if isinstance(t, torch.Tensor) and t.is_meta and t.dtype in _CASTABLE[:3]]
    if not dtypes:
        return None
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


class MetaAutocast(TorchFunctionMode):
    """``with MetaAutocast(torch.bfloat16): ...``: CUDA autocast's casts on meta tensors. ``enabled``
    False (``no_autocast``): the block runs in its inputs' dtypes, as ``torch.autocast(enabled=False)``."""

    def __init__(self, dtype: torch.dtype, enabled: bool = True) -> None:
        super().__init__()
        self.dtype, self.enabled = dtype, enabled

    def __torch_function__(self, func, types, args=(), kwargs=None):  # torch's signature
        kwargs = kwargs or {}
        if self.enabled:
            name = getattr(func, "__name__", "")
            if name in LOWER:
                args, kwargs = _cast((args, kwargs), self.dtype)
            elif name in FP32:
                args, kwargs = _cast((args, kwargs), torch.float32)
            elif name in PROMOTE and (wide := _widest((args, kwargs))) is not None:
                args, kwargs = _cast((args, kwargs), wide)
        return func(*args, **kwargs)


def active() -> MetaAutocast | None:
    """The innermost MetaAutocast in force on this thread, or None."""
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, MetaAutocast):
            return mode
    return None
