"""How a sequence is split over context-parallel ranks: pure arithmetic, no torch.

Every cp kind shares one split. The sequence of ``s`` positions is cut into ``2 * cp`` equal chunks
and cp rank ``i`` holds chunks ``i`` and ``2cp - 1 - i`` (the zigzag of Megatron-LM's context
parallelism and Llama 3): under a causal mask a chunk near the start attends to little and one near
the end to much, so pairing them gives every rank the same attention work. A rank's part is a tuple
of *segments*, runs of consecutive global positions in the order the rank stores them.

    s = 16, cp = 2:  chunks of 4;  rank 0: [0..3] + [12..15]   rank 1: [4..7] + [8..11]

Attention cost is counted as the kernels run it: a (query segment, key segment) block whose keys all
come after its queries is skipped, a block on the diagonal runs whole (the mask inside it is free).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SPLITS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Segment:
    """Global positions ``[start, start + length)``."""

    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


Segments = tuple[Segment, ...]


def rank_segments(seq_len: int, cp: int, rank: int, split: str = "zigzag") -> Segments:
    """The segments cp rank ``rank`` holds, in its storage order."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}; valid: {', '.join(SPLITS)}")
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} outside [0, {cp})")
    if split == "contiguous":
        if seq_len % cp:
            raise ValueError(f"sequence length {seq_len} does not split into {cp} equal parts")
        n = seq_len // cp
        return (Segment(rank * n, n),)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not split into 2*cp={2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    if cp == 1:
        return (Segment(0, seq_len),)
    return Segment(rank * c, c), Segment((2 * cp - 1 - rank) * c, c)


def positions(segments: Segments) -> list[int]:
    """Every global position of ``segments``, in storage order."""
    return [p for seg in segments for p in range(seg.start, seg.stop)]


def merge(segments: Segments) -> Segments:
    """Adjacent runs joined (positions in the same order)."""
    out: list[Segment] = []
    for seg in segments:
        if out and out[-1].stop == seg.start:
            out[-1] = Segment(out[-1].start, out[-1].length + seg.length)
        else:
            out.append(seg)
    return tuple(out)


def concat(parts: Sequence[Segments]) -> Segments:
    """The segments of several ranks' parts laid end to end (what an all-gather or all-to-all holds),
    kept apart: the kernels skip masked blocks chunk by chunk."""
    return tuple(seg for part in parts for seg in part)


def block_visible(q: Segment, k: Segment, window: int | None = None) -> bool:
    """Whether any query of ``q`` may see any key of ``k`` under the causal (and sliding-window) mask."""
    if k.start > q.stop - 1:
        return False
    return window is None or q.start - (k.stop - 1) < window


def block_needs_mask(q: Segment, k: Segment, window: int | None = None) -> bool:
    """Whether a visible block has masked pairs (False: every query sees every key)."""
    causal_full = k.stop - 1 <= q.start
    window_full = window is None or (q.stop - 1) - k.start < window
    return not (causal_full and window_full)


def attention_pairs(q_segments: Segments, k_segments: Segments, window: int | None = None) -> int:
    """Query-key products the block kernels compute (skipped blocks cost nothing; visible blocks run whole)."""
    return sum(q.length * k.length for q in q_segments for k in k_segments if block_visible(q, k, window))


def load_balance(seq_len: int, cp: int, split: str = "zigzag") -> float:
    """Largest over smallest attention work across cp ranks (each rank's queries against every key)."""
    every_key = tuple(seg for r in range(cp) for seg in rank_segments(seq_len, cp, r, split))
    work = [attention_pairs(rank_segments(seq_len, cp, r, split), every_key) for r in range(cp)]
    return max(work) / min(work)
