"""Flat buffers for sharded data parallelism: where each parameter lives, and what each rank owns.

Parameters are packed, in reverse order (roughly the order backward produces their gradients),
into buckets of at most ``cap`` elements. A bucket is padded to a multiple of the data-parallel
size ``dp`` so that it splits into ``dp`` equal, contiguous shards: rank r owns elements
``[r * S, (r + 1) * S)`` of every bucket (S = padded size / dp). A parameter may straddle shards;
each rank's part of it is a ``Piece``: a contiguous range of the parameter's flattened elements
and where that range sits in the rank's shard.

Everything here is arithmetic on element counts (no tensors, no processes), so the bookkeeping
that ZeRO's correctness rests on is unit-tested on its own (tests/unit/test_optim_buffers.py).

    bucket  | p3 ......... | p2 .... | p1 ............. | pad |
    shards  | rank 0       | rank 1        | rank 2         ...
    pieces  rank 1: (p3, [a, n3), at 0), (p2, [0, n2), at n3 - a), (p1, [0, b), at ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """Parameter ``index`` (its position in the model's parameter list) at ``start`` in its bucket."""

    index: int
    start: int
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of parameter ``index`` (flattened) sit at ``shard_offset`` in a rank's shard."""

    index: int
    lo: int
    hi: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class BucketLayout:
    slots: tuple[Slot, ...]
    size: int  # padded: a multiple of dp
    dp: int

    @property
    def used(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def shard_size(self) -> int:
        return self.size // self.dp

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of parameters that fall in ``rank``'s shard, in bucket order."""
        lo, hi = self.shard_range(rank)
        out = []
        for s in self.slots:
            a, b = max(lo, s.start), min(hi, s.end)
            if a < b:
                out.append(Piece(s.index, a - s.start, b - s.start, a - lo))
        return out


def plan_buckets(numels: Sequence[int], dp: int, cap: int) -> list[BucketLayout]:
    """Pack parameters (given by element count, in model order) into padded buckets, last first.

    A bucket closes when the next parameter would push it past ``cap`` elements (a parameter larger
    than ``cap`` gets a bucket of its own). Padding is at most ``dp - 1`` elements per bucket.
    """
    if dp < 1 or cap < 1:
        raise ValueError(f"dp={dp} and cap={cap} must be >= 1")
    groups: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(numels))):
        if groups[-1] and size + numels[i] > cap:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += numels[i]
    out = []
    for g in groups:
        if not g:
            continue
        slots, at = [], 0
        for i in g:
            slots.append(Slot(i, at, numels[i]))
            at += numels[i]
        out.append(BucketLayout(tuple(slots), -(-at // dp) * dp, dp))
    return out


def pieces_by_param(buckets: Sequence[BucketLayout], rank: int) -> dict[int, list[tuple[int, Piece]]]:
    """For each parameter index, ``(bucket number, piece)`` of what ``rank`` owns of it."""
    out: dict[int, list[tuple[int, Piece]]] = {}
    for k, b in enumerate(buckets):
        for piece in b.pieces(rank):
            out.setdefault(piece.index, []).append((k, piece))
    return out


# ZeRO-3's granularity (optim/engine.py, optim/gather.py; the memory model walks the same rules). In
# elements of the parameters:
#   unit      a layer's parts (its submodules in forward order, Block.parts()) merge into units of at most
#             this many; a layer no larger is one unit. Each unit costs per micro-batch an all-gather in
#             forward, one in backward and a reduce-scatter, each with a fixed cost (launch, ring latency:
#             tens of microseconds in a node, more across nodes). At 5e7 elements (100 MB in bf16, 4 ms at
#             25 GB/s) that fixed cost is ~1% of the transfer, and the gathered parameters of a large model
#             are bounded by a submodule, not a layer (530B: 3.4 GB, not 10 GB)
#   prefetch  the next unit is gathered while the current one computes when it has at most this many:
#             hides the gather, costs its memory. 5e8 (1 GB in bf16, ~1% of an 80 GB device) prefetches
#             every unit of models up to ~70B; the 4h x h projections of 175B/530B are gathered when used
#   reduce    a unit's gradient buffer is taken once the reductions in flight and it hold at most this
#             many elements (older ones waited first); idle buffers are kept for reuse within it too.
#             Twice a full unit: as the two reductions in flight mpformer kept before, now in bytes, so a
#             unit larger than it never has a second buffer alive beside its own
ZERO3_UNIT_NUMEL = 50_000_000
ZERO3_PREFETCH_NUMEL = 500_000_000
ZERO3_REDUCE_NUMEL = 2 * ZERO3_UNIT_NUMEL


def zero3_groups(sizes: Sequence[int], cap: float) -> list[list[int]]:
    """Consecutive parts (given by element count) grouped into ZeRO-3 units: a group grows while it stays
    at most ``cap`` elements; a part larger than ``cap`` is a unit of its own."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if groups and total + n <= cap:
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups
