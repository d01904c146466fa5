"""Cross entropy over vocabulary-parallel logits, without ever gathering the full logits.

Each tp rank holds logits for its vocabulary block ``[start, start + rows)`` of which the first
``valid`` are real tokens (the rest pad the vocabulary to a multiple of tp and are masked out).
Per token, with three all-reduces of one float each (Megatron's scheme)::

    m   = max over the vocabulary          (all-reduce MAX)
    z   = sum exp(logit - m)               (all-reduce SUM)
    x_y = logit of the label - m           (all-reduce SUM: only the owning rank contributes)
    loss = log z - x_y,   d loss / d logit = softmax - onehot(label)   (local, no communication)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpformer.parallel.comm import Comm


def _ce_forward(logits_nv: torch.Tensor, labels_n: torch.Tensor, comm: Comm, start: int,
                valid: int) -> tuple[torch.Tensor, ...]:
    """Loss per token [n] (0 where label == -100) and what backward needs."""
    logits = logits_nv.float()
    if valid < logits.shape[-1]:
        logits = logits.clone()
        logits[:, valid:] = float("-inf")  # vocabulary padding: probability exactly 0
    m = logits.amax(dim=-1) if valid > 0 else torch.full(logits.shape[:1], float("-inf"), device=logits.device)
    comm.all_reduce(m, op=dist.ReduceOp.MAX)
    shifted = logits - m.unsqueeze(-1)
    exp = shifted.exp()
    local = labels_n - start
    mine = (local >= 0) & (local < valid)
    safe = local.clamp(0, max(valid - 1, 0))
    picked = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    zx = torch.stack([exp.sum(dim=-1), torch.where(mine, picked, torch.zeros_like(picked))])
    comm.all_reduce(zx)  # z and the label's logit in one collective
    z, x_y = zx[0], zx[1]
    ignore = labels_n == -100
    loss = (z.log() - x_y).masked_fill(ignore, 0.0)
    return loss, exp / z.unsqueeze(-1), safe, mine, ignore


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_nv, labels_n, comm, start, valid):
        loss, softmax, safe, mine, ignore = _ce_forward(logits_nv, labels_n, comm, start, valid)
        ctx.save_for_backward(softmax, safe, mine, ignore)
        ctx.in_dtype = logits_nv.dtype
        return loss

    @staticmethod
    def backward(ctx, g_n):
        softmax, safe, mine, ignore = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[mine], safe[mine]] -= 1.0
        grad = grad * g_n.masked_fill(ignore, 0.0).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_nv: torch.Tensor, labels_n: torch.Tensor, comm: Comm, start: int,
                                 valid: int) -> torch.Tensor:
    """Mean loss over the labelled tokens (labels == -100 are ignored), identical on every tp rank."""
    loss_n = VocabParallelCrossEntropy.apply(logits_nv, labels_n, comm, start, valid)
    count = (labels_n != -100).sum().clamp(min=1)
    return loss_n.sum() / count
