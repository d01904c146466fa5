"""Which blocks of queries and keys a fused attention kernel runs, and with which mask: pure arithmetic.

A part of queries and a part of keys are each segments (core/sequence.py: runs of global positions
in storage order). The causal rule, a sliding window and a document mask decide which query-key
pairs are seen; all three are functions of the global positions and of the documents they fall in.
``plan`` cuts the seen pairs into rectangles of storage rows, each one call of a fused kernel
(context_parallel/blockwise.py):

    full     every query sees every key: no mask
    causal   a square on the diagonal (the same positions on both sides): the kernel's own
             top-left causal mask, which costs nothing to build
    masked   at most ``tile`` x ``tile``, only where a sliding window cuts a block: an explicit mask
             of that size, trimmed so that every row sees some key

Pairs nobody sees are in no rectangle and cost nothing, and every seen pair is in exactly one. A
document mask becomes the packed variable-length form: runs are cut where documents start and only
runs of the same document meet, so a document never needs a mask and fully masked blocks vanish.

    causal split of queries [a, a+m) against keys [c, c+n):
        keys [c, min(c+n, a))                        full, all the queries
        overlap O = [max(a,c), min(a+m, c+n))         causal square O x O
        queries after O against O                     full
    a sliding window w then keeps a rectangle whose largest i - j is below w, drops one whose
    smallest is not, and halves the rest (on tile boundaries) down to masked tiles.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from mpformer.core.sequence import Segments

FULL, CAUSAL, MASKED = "full", "causal", "masked"
KINDS = (FULL, CAUSAL, MASKED)
TILE = 1024  # the largest masked rectangle's side: bounds a mask at TILE x TILE, never [s, s]

DocStarts = tuple[int, ...]  # the positions at which a document starts (0 implied), ascending


@dataclass(frozen=True)
class ScoreBlock:
    """Storage rows ``[q_row, q_row + q_len)`` of the queries against ``[k_row, k_row + k_len)`` of the
    keys, whose first global positions are ``q_pos`` and ``k_pos`` (runs: positions follow rows)."""

    q_row: int
    k_row: int
    q_len: int
    k_len: int
    q_pos: int
    k_pos: int
    kind: str

    @property
    def q_rows(self) -> slice:
        return slice(self.q_row, self.q_row + self.q_len)

    @property
    def k_rows(self) -> slice:
        return slice(self.k_row, self.k_row + self.k_len)

    @property
    def pairs(self) -> int:
        """Query-key products the kernel computes (a causal square: its lower triangle)."""
        if self.kind == CAUSAL:
            return self.q_len * (self.q_len + 1) // 2
        return self.q_len * self.k_len


@dataclass(frozen=True)
class _Run:
    pos: int
    row: int
    length: int


def seen(i: int, j: int, window: int | None) -> bool:
    """The rule itself: query position ``i`` sees key position ``j`` (same document assumed)."""
    return j <= i and (window is None or i - j < window)


def _runs(segments: Segments, doc_starts: DocStarts) -> list[tuple[int, _Run]]:
    """Each segment with its storage row, cut where a document starts; each run with its document."""
    out, row = [], 0
    for seg in segments:
        cuts = [p for p in doc_starts[bisect.bisect_right(doc_starts, seg.start):] if p < seg.stop]
        edges = [seg.start, *cuts, seg.stop]
        for lo, hi in itertools.pairwise(edges):
            out.append((bisect.bisect_right(doc_starts, lo), _Run(lo, row + lo - seg.start, hi - lo)))
        row += seg.length
    return out


def _rect(q: _Run, k: _Run, kind: str) -> ScoreBlock:
    return ScoreBlock(q.row, k.row, q.length, k.length, q.pos, k.pos, kind)


def _sub(r: _Run, lo: int, hi: int) -> _Run:
    """Positions ``[lo, hi)`` of run ``r``."""
    return _Run(lo, r.row + lo - r.pos, hi - lo)


def _causal(q: _Run, k: _Run) -> list[ScoreBlock]:
    """The seen part of q x k under the causal rule: at most one full block, one causal square and one
    full block below it."""
    a, m, c, n = q.pos, q.length, k.pos, k.length
    out = []
    if c < a:
        out.append(_rect(q, _sub(k, c, min(c + n, a)), FULL))
    lo, hi = max(a, c), min(a + m, c + n)
    if lo < hi:
        out.append(_rect(_sub(q, lo, hi), _sub(k, lo, hi), CAUSAL))
        if hi < a + m:
            out.append(_rect(_sub(q, hi, a + m), _sub(k, lo, hi), FULL))
    return out


def _split_point(length: int, tile: int) -> int:
    """Where to halve a side: its middle, rounded to a whole number of tiles (at least one)."""
    return max(tile, (length // 2) // tile * tile)


def _trim(b: ScoreBlock, w: int) -> ScoreBlock | None:
    """A masked rectangle cut to the rows that see some key and the keys some row sees."""
    q0 = max(b.q_pos, b.k_pos)
    q1 = min(b.q_pos + b.q_len - 1, b.k_pos + b.k_len - 1 + w - 1)
    k0 = max(b.k_pos, b.q_pos - w + 1)
    k1 = min(b.k_pos + b.k_len - 1, b.q_pos + b.q_len - 1)
    if q0 > q1 or k0 > k1:
        return None
    return ScoreBlock(b.q_row + q0 - b.q_pos, b.k_row + k0 - b.k_pos, q1 - q0 + 1, k1 - k0 + 1, q0, k0, MASKED)


def _windowed(b: ScoreBlock, w: int, tile: int) -> list[ScoreBlock]:
    """``b`` (full or causal) restricted to pairs with i - j < w."""
    far = b.q_pos + b.q_len - 1 - b.k_pos  # the largest i - j in the block
    near = b.q_pos - (b.k_pos + b.k_len - 1)  # the smallest (a causal square: negative)
    if far < w:
        return [b]
    if b.kind == FULL and near >= w:
        return []
    if b.q_len <= tile and b.k_len <= tile:
        t = _trim(b, w)
        return [] if t is None else [t]
    if b.kind == CAUSAL:  # two smaller squares and the full block between them
        h = _split_point(b.q_len, tile)
        parts = [ScoreBlock(b.q_row, b.k_row, h, h, b.q_pos, b.k_pos, CAUSAL),
                 ScoreBlock(b.q_row + h, b.k_row + h, b.q_len - h, b.q_len - h, b.q_pos + h, b.k_pos + h, CAUSAL),
                 ScoreBlock(b.q_row + h, b.k_row, b.q_len - h, h, b.q_pos + h, b.k_pos, FULL)]
    elif b.q_len >= b.k_len:
        h = _split_point(b.q_len, tile)
        parts = [ScoreBlock(b.q_row, b.k_row, h, b.k_len, b.q_pos, b.k_pos, FULL),
                 ScoreBlock(b.q_row + h, b.k_row, b.q_len - h, b.k_len, b.q_pos + h, b.k_pos, FULL)]
    else:
        h = _split_point(b.k_len, tile)
        parts = [ScoreBlock(b.q_row, b.k_row, b.q_len, h, b.q_pos, b.k_pos, FULL),
                 ScoreBlock(b.q_row, b.k_row + h, b.q_len, b.k_len - h, b.q_pos, b.k_pos + h, FULL)]
    return [x for p in parts for x in _windowed(p, w, tile)]


def _merge(blocks: list[ScoreBlock]) -> list[ScoreBlock]:
    """Full blocks over the same query rows and adjacent key rows joined (then the same across query
    rows): fewer, larger kernel calls. Positions do not matter to a block without a mask."""
    for along_keys in (True, False):
        def key(b: ScoreBlock, along_keys: bool = along_keys) -> tuple:
            return (b.kind != FULL, b.q_row, b.q_len, b.k_row) if along_keys else \
                (b.kind != FULL, b.k_row, b.k_len, b.q_row)
        out: list[ScoreBlock] = []
        for b in sorted(blocks, key=key):
            p = out[-1] if out else None
            if p is not None and p.kind == b.kind == FULL:
                if along_keys and (p.q_row, p.q_len) == (b.q_row, b.q_len) and p.k_row + p.k_len == b.k_row:
                    out[-1] = ScoreBlock(p.q_row, p.k_row, p.q_len, p.k_len + b.k_len, p.q_pos, p.k_pos, FULL)
                    continue
                if not along_keys and (p.k_row, p.k_len) == (b.k_row, b.k_len) and p.q_row + p.q_len == b.q_row:
                    out[-1] = ScoreBlock(p.q_row, p.k_row, p.q_len + b.q_len, p.k_len, p.q_pos, p.k_pos, FULL)
                    continue
            out.append(b)
        blocks = out
    return blocks


def plan(q_segments: Segments, k_segments: Segments, window: int | None = None, doc_starts: DocStarts = (),
         tile: int | None = None) -> tuple[ScoreBlock, ...]:
    """The blocks that cover exactly the seen pairs of ``q_segments`` x ``k_segments``, in query-row
    order; masked blocks at most ``tile`` (default TILE) a side."""
    return _plan(q_segments, k_segments, window, doc_starts, TILE if tile is None else tile)


@functools.lru_cache(maxsize=512)
def _plan(q_segments: Segments, k_segments: Segments, window: int | None, doc_starts: DocStarts,
          tile: int) -> tuple[ScoreBlock, ...]:
    """(cached: every layer of a micro-batch asks for the same few)"""
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window}: must be at least 1")
    q_runs, k_runs = _runs(q_segments, doc_starts), _runs(k_segments, doc_starts)
    blocks: list[ScoreBlock] = []
    for qd, q in q_runs:
        for kd, k in k_runs:
            if qd != kd or k.pos >= q.pos + q.length:
                continue
            for b in _causal(q, k):
                blocks.extend([b] if window is None else _windowed(b, window, tile))
    return tuple(sorted(_merge(blocks), key=lambda b: (b.q_row, b.k_row)))


def doc_starts_of(doc_ids: Sequence[int]) -> DocStarts:
    """The positions where a new document id begins (``doc_ids``: every position's document)."""
    return tuple(p for p in range(1, len(doc_ids)) if doc_ids[p] != doc_ids[p - 1])


def plan_pairs(blocks: Sequence[ScoreBlock]) -> int:
    """Query-key products a plan computes (the cost model's and the benchmark's count)."""
    return sum(b.pairs for b in blocks)
