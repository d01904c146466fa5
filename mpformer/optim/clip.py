"""Global gradient norm and clipping.

The norm is taken over every gradient the model has. With plain data parallelism each rank holds
the full, already-reduced gradients, so the local norm is the global one; model-parallel layouts
pass the groups over which partial sums of squares must be added (duplicates counted once).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def grad_norm(params: Iterable[torch.nn.Parameter], groups: Iterable[dist.ProcessGroup] = ()) -> torch.Tensor:
    """L2 norm of all gradients (fp32); sums of squares are all-reduced over ``groups``."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads, 2.0)
    sq = torch.stack([n.float() for n in norms]).pow(2).sum()
    for g in groups:
        dist.all_reduce(sq, group=g)
    return sq.sqrt()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float,
                   groups: Iterable[dist.ProcessGroup] = ()) -> float:
    """Scale gradients in place so their global norm is at most ``max_norm`` (0 disables); return the
    norm before clipping. In-place scaling keeps gradients that are views into flat buffers valid."""
    total = grad_norm(params, groups)
    if max_norm > 0:
        coeff = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coeff.to(grads[0].device))
    return float(total)
