"""Shard bookkeeping of the flat buffers, without tensors or processes."""

from __future__ import annotations

import random

import pytest

from mpformer.core.buffers import Piece, pieces_by_param, plan_buckets


def test_worked_example():
    # Params of 5, 3, 6 elements, dp=4, one bucket: reversed order p2 p1 p0 = 6 + 3 + 5 = 14 -> 16.
    (b,) = plan_buckets([5, 3, 6], dp=4, cap=100)
    assert [(s.index, s.start, s.numel) for s in b.slots] == [(2, 0, 6), (1, 6, 3), (0, 9, 5)]
    assert b.size == 16 and b.shard_size == 4
    assert b.pieces(0) == [Piece(2, 0, 4, 0)]
    assert b.pieces(1) == [Piece(2, 4, 6, 0), Piece(1, 0, 2, 2)]
    assert b.pieces(2) == [Piece(1, 2, 3, 0), Piece(0, 0, 3, 1)]
    assert b.pieces(3) == [Piece(0, 3, 5, 0)]  # and 2 elements of padding


def test_cap_closes_buckets_and_large_params_stand_alone():
    buckets = plan_buckets([4, 4, 10, 4], dp=2, cap=8)
    assert [[s.index for s in b.slots] for b in buckets] == [[3], [2], [1, 0]]
    assert [b.size for b in buckets] == [4, 10, 8]


@pytest.mark.parametrize("seed", range(30))
def test_every_element_owned_exactly_once(seed):
    rng = random.Random(seed)
    numels = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
    dp, cap = rng.randint(1, 8), rng.randint(1, 120)
    buckets = plan_buckets(numels, dp, cap)
    owned = {i: [0] * n for i, n in enumerate(numels)}
    for b in buckets:
        assert b.size % dp == 0 and 0 <= b.size - b.used < dp
        assert b.used <= cap or len(b.slots) == 1
        for r in range(dp):
            used = [0] * b.shard_size
            for p in b.pieces(r):
                assert 0 <= p.lo < p.hi <= numels[p.index]
                for k in range(p.numel):
                    used[p.shard_offset + k] += 1
                    owned[p.index][p.lo + k] += 1
            assert max(used, default=0) <= 1  # pieces never overlap inside a shard
    assert all(c == 1 for counts in owned.values() for c in counts)
    total = sum(p.numel for r in range(dp) for ps in pieces_by_param(buckets, r).values() for _, p in ps)
    assert total == sum(numels)
