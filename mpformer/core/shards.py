"""Shards of layout-free tensors: which block of a global (canonical) tensor a rank holds.

A :class:`Shard` says: this rank holds ``local``, the block of the global tensor that starts at
``offsets``. Tensor parallelism cuts q/k/v, gate/up and the vocabulary into row blocks; replicated
tensors are one block covering everything; kv heads replicated over several tp ranks are the same
block on each of them. Pure arithmetic on shapes and offsets: the DCP planners that turn shards into
checkpoint reads and writes live in :mod:`mpformer.checkpoint.shards`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Shard:
    """``local`` is global[offsets[0]:offsets[0]+local.shape[0], ...] of a tensor of ``global_shape``."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    name: str | None = None  # the stored tensor's name when the dict key is not it (several chunks)

    @classmethod
    def full(cls, t: torch.Tensor) -> Shard:
        return cls(t, tuple(t.shape), (0,) * t.dim())

    @classmethod
    def rows(cls, local: torch.Tensor, global_rows: int, start: int) -> Shard:
        """A block of rows (dim 0) starting at ``start`` of a tensor with ``global_rows`` rows."""
        return cls(local, (global_rows, *local.shape[1:]), (start,) + (0,) * (local.dim() - 1))

    def like(self, t: torch.Tensor) -> Shard:
        """The same block of another tensor with the local shape (e.g. Adam's exp_avg)."""
        assert t.shape == self.local.shape
        return Shard(t, self.global_shape, self.offsets, self.name)

    @property
    def is_full(self) -> bool:
        return tuple(self.local.shape) == tuple(self.global_shape)


def stored_name(key: str, sh: Shard) -> str:
    return sh.name if sh.name is not None else key
