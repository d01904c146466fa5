"""Global gradient norm and clipping over every parallel dimension.

Each gradient element is counted once: blocks that several tensor-parallel ranks hold identically
(norm gains, kv heads replicated under GQA) are weighted by 1/replicas before the sum of squares is
all-reduced over tp (models.parallelize.grad_specs says which). Data-parallel ranks hold the same,
already-averaged gradients, so nothing is summed over dp.
"""

from __future__ import annotations

import torch

from mpformer.parallel.comm import Comm
from mpformer.parallel.tensor_parallel import GradSpec, grad_norm_sq


def clip_grad_norm(specs: list[GradSpec], max_norm: float, tp: Comm | None = None, pp: Comm | None = None) -> float:
    """Scale gradients in place so that their global norm is at most ``max_norm`` (0 disables); return
    the norm before clipping. In-place scaling keeps gradients that are views into flat buffers valid."""
    total = grad_norm_sq(specs, tp, pp).sqrt()
    if max_norm > 0:
        grads = list({id(s.param): s.param.grad for s in specs if s.param.grad is not None}.values())
        coeff = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coeff.to(grads[0].device))
    return float(total)
