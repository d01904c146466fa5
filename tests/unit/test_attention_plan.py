"""The attention plan (core/attention_plan.py) against the rule itself, pair by pair, on random splits.

Oracle: a dense table of which query sees which key, built from positions and documents directly
(``seen`` and the document ids), compared with the table the plan's blocks cover: every seen pair
covered exactly once, nothing else covered, every masked block small and without an empty row.
"""

from __future__ import annotations

import random

import pytest

from mpformer.core.attention_plan import CAUSAL, FULL, MASKED, doc_starts_of, plan, plan_pairs, seen
from mpformer.core.sequence import Segment, concat, positions, rank_segments


def _doc_ids(s: int, starts: tuple[int, ...]) -> list[int]:
    return [sum(1 for p in starts if p <= i) for i in range(s)]


def _covered(blocks, q_segments, k_segments, window):
    qpos, kpos = positions(q_segments), positions(k_segments)
    count = [[0] * len(kpos) for _ in qpos]
    for b in blocks:
        if b.kind != FULL:  # a mask is built from positions: they must follow the rows (a full block may
            # join runs that are adjacent in storage only)
            assert qpos[b.q_rows] == list(range(b.q_pos, b.q_pos + b.q_len))
            assert kpos[b.k_rows] == list(range(b.k_pos, b.k_pos + b.k_len))
        for x in range(b.q_len):
            for y in range(b.k_len):
                i, j = b.q_pos + x, b.k_pos + y
                if b.kind == CAUSAL:
                    assert b.q_pos == b.k_pos and b.q_len == b.k_len
                    hit = y <= x
                elif b.kind == MASKED:
                    hit = seen(i, j, window)
                else:
                    hit = True
                count[b.q_row + x][b.k_row + y] += hit
        if b.kind == MASKED:
            rows = [any(seen(b.q_pos + x, b.k_pos + y, window) for y in range(b.k_len)) for x in range(b.q_len)]
            assert all(rows), "a masked block has a row that sees nothing (the kernel's lse would be wrong)"
    return count


def _check(q_segments, k_segments, window, starts, tile):
    blocks = plan(q_segments, k_segments, window, starts, tile)
    count = _covered(blocks, q_segments, k_segments, window)
    s = max(seg.stop for seg in q_segments + k_segments)
    docs = _doc_ids(s, starts)
    for r, i in enumerate(positions(q_segments)):
        for c, j in enumerate(positions(k_segments)):
            want = seen(i, j, window) and docs[i] == docs[j]
            assert count[r][c] == int(want), (i, j, count[r][c], want)
    for b in blocks:
        if b.kind == MASKED:
            assert b.q_len <= tile and b.k_len <= tile
    return blocks


@pytest.mark.parametrize("seed", range(40))
def test_plan_covers_exactly_the_seen_pairs(seed):
    rng = random.Random(seed)
    cp = rng.choice([1, 2, 3, 4])
    s = 2 * cp * rng.randint(1, 12)
    window = rng.choice([None, None, 1, 2, 3, 5, 9, 17])
    n_docs = rng.choice([0, 0, 1, 3, 8])
    starts = tuple(sorted(rng.sample(range(1, s), min(n_docs, s - 1))))
    tile = rng.choice([2, 3, 4, 1024])
    parts = [rank_segments(s, cp, r) for r in range(cp)]
    keys = concat(parts)
    for mine in parts:
        _check(mine, keys, window, starts, tile)  # all-gather: every key, rank order
        for other in parts:  # ring: one other rank's block at a time
            _check(mine, other, window, starts, tile)
    slices = rng.randint(1, 4)  # token slices: a slice's queries against every key up to its end
    n = s // slices
    for part in range(slices):
        _check((Segment(part * n, n),), (Segment(0, (part + 1) * n),), window, starts, tile)


def test_plan_shapes_by_hand():
    # cp=2 zigzag, s=16: rank 0 holds [0..3] + [12..15]; against its own block: two causal squares and
    # the full block of its late queries over its early keys; against rank 1's [4..7] + [8..11]: one
    # full block (merged across the two adjacent key segments), the early queries see none of it.
    mine, other = rank_segments(16, 2, 0), rank_segments(16, 2, 1)
    assert [(b.kind, b.q_rows, b.k_rows) for b in plan(mine, mine)] == [
        (CAUSAL, slice(0, 4), slice(0, 4)), (FULL, slice(4, 8), slice(0, 4)), (CAUSAL, slice(4, 8), slice(4, 8))]
    assert [(b.kind, b.q_rows, b.k_rows) for b in plan(mine, other)] == [(FULL, slice(4, 8), slice(0, 8))]
    # Causal work is halved exactly: a rank of the zigzag computes (2cp + 1) c^2 / 2 + ... products.
    whole = plan((Segment(0, 16),), (Segment(0, 16),))
    assert [b.kind for b in whole] == [CAUSAL] and plan_pairs(whole) == 16 * 17 // 2
    # A token slice after its past keys: the past in full, its own keys causal.
    assert [(b.kind, b.q_rows, b.k_rows) for b in plan((Segment(8, 4),), (Segment(0, 12),))] == [
        (FULL, slice(0, 4), slice(0, 8)), (CAUSAL, slice(0, 4), slice(8, 12))]
    # Documents: two documents, no block crosses them, none needs a mask.
    docs = plan((Segment(0, 8),), (Segment(0, 8),), None, (3,))
    assert [(b.kind, b.q_rows, b.k_rows) for b in docs] == [(CAUSAL, slice(0, 3), slice(0, 3)),
                                                            (CAUSAL, slice(3, 8), slice(3, 8))]


def test_a_sliding_window_costs_a_band_not_a_square():
    s, w, tile = 16384, 1024, 256
    blocks = plan((Segment(0, s),), (Segment(0, s),), w, (), tile)
    assert plan_pairs(blocks) < 1.3 * s * w  # the band holds s * w pairs (less the first triangle)
    assert max(b.q_len * b.k_len for b in blocks if b.kind == MASKED) <= tile * tile
    assert {b.kind for b in blocks} == {CAUSAL, FULL, MASKED}


def test_doc_starts_and_bad_window():
    assert doc_starts_of([0, 0, 1, 1, 1, 2, 3]) == (2, 5, 6)
    assert doc_starts_of([]) == ()
    with pytest.raises(ValueError, match="sliding window 0"):
        plan((Segment(0, 4),), (Segment(0, 4),), 0)
