"""Synthetic token ids: what a rehearsal trains on (training/preflight.py ``preflight_rehearsal``), so no
data file is needed to run a layout's steps.

Sample ``i`` is a pure function of (seed, i), as a GPTDataset's is, ``seq_length + 1`` ids in
``[0, vocab)``. With ``eos`` (a run with document masks), documents of random lengths between
``seq_length / 8`` and ``seq_length / 2`` end with it, so that a packed sequence holds several, as real
data would; what the attention plan makes of them depends on where they end, which only real data says.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SyntheticTokens:
    seq_length: int
    vocab_size: int
    seed: int = 0
    eos: int | None = None

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, int(i)))
        ids = rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)
        if self.eos is not None:
            ids[ids == self.eos] = (self.eos + 1) % self.vocab_size
            lo, hi = max(1, self.seq_length // 8), max(2, self.seq_length // 2)
            at = -1
            while True:
                at += int(rng.integers(lo, hi))
                if at >= self.seq_length:
                    break
                ids[at] = self.eos
        return ids

    def __repr__(self) -> str:
        return f"synthetic tokens (seed {self.seed}, sample length {self.seq_length + 1})"
