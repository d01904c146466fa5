"""Token-level pipelining (TeraPipe, Li et al. 2021): the keys and values a micro-batch's earlier
sequence slices leave on a pipeline stage, and the exact backward through them.

A micro-batch of a causal model is cut into ``k`` slices of its sequence that go through the stages
one after the other (``parallel.pp_token_slices``, pipeline/schedules.py). Slice ``s`` attends to its
own keys and to those of slices ``0 .. s-1``, which ran earlier on the same stage: every attention
layer keeps them here. Each kept key or value enters the later slices' graphs as a *leaf* that
requires grad, so a later slice's backward stops there and leaves its contribution in the leaf's
``.grad``; the backward of slice ``s`` (which the schedule runs after every later slice's) then starts
from its output gradient *and* from those accumulated key/value gradients (``roots``). Every
contribution reaches the weights once, so the gradients equal the unsliced model's.

Under full recompute a layer's forward runs again inside its backward; ``extend`` then reads the
earlier slices' leaves as before and keeps the entry of the first run (the one whose gradients the
later slices filled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Kept:
    k: torch.Tensor  # this slice's keys in its own graph ([b, kv, s/k, d], after RoPE)
    v: torch.Tensor
    k_leaf: torch.Tensor  # the same values as a leaf of the later slices' graphs
    v_leaf: torch.Tensor


class KVSlices:
    """One micro-batch's slices on one pipeline chunk: per attention layer, what each slice left.
    The engine sets ``current`` to the slice it runs (forward or backward)."""

    def __init__(self, slices: int) -> None:
        self.slices, self.current = slices, 0
        self._kept: dict[int, dict[int, _Kept]] = {}  # id(layer) -> slice -> its keys and values

    def extend(self, layer: object, k_bksd: torch.Tensor, v_bksd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values slice ``current`` attends to: the earlier slices' (as leaves) and its own."""
        kept, s = self._kept.setdefault(id(layer), {}), self.current
        past = [kept[j] for j in range(s)]
        if s not in kept:  # not a recompute of this slice's forward: keep what it made for the later slices
            grad = k_bksd.requires_grad
            kept[s] = _Kept(k_bksd, v_bksd, k_bksd.detach().requires_grad_(grad), v_bksd.detach().requires_grad_(grad))
        if not past:
            return k_bksd, v_bksd
        return (torch.cat([p.k_leaf for p in past] + [k_bksd], dim=2),
                torch.cat([p.v_leaf for p in past] + [v_bksd], dim=2))

    def roots(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Slice ``current``'s keys and values with the gradients the later slices left on them, for
        ``torch.autograd.backward`` beside the output (then ``release``)."""
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for kept in self._kept.values():
            e = kept.get(self.current)
            if e is None:
                continue
            for t, leaf in ((e.k, e.k_leaf), (e.v, e.v_leaf)):
                if leaf.grad is not None:
                    tensors.append(t)
                    grads.append(leaf.grad)
        return tensors, grads

    def release(self) -> None:
        """Forget slice ``current`` after its backward (a recompute inside that backward still found it)."""
        for kept in self._kept.values():
            kept.pop(self.current, None)

    def __len__(self) -> int:
        """Slices still kept on some layer (0: the micro-batch is done on this chunk)."""
        return len({s for kept in self._kept.values() for s in kept})
