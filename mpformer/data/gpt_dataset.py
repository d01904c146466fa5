"""GPT training samples: fixed windows over the concatenated token stream, shuffled per epoch.

Sample order is a pure function of (seed, global sample index): no sample-index arrays are built
or cached, so opening a trillion-token corpus costs the same as opening a small one, and any rank
can compute any sample without coordination. This replaces Megatron's cached doc/sample/shuffle
index files (``*_doc_idx.npy`` etc.), which we neither read nor write.

Windows (Megatron's one-token overlap)::

    window k = tokens[k*L : k*L + L + 1]        L = seq_length, k in [0, W)
    W = samples_per_epoch = (num_tokens - 1) // L
    inputs = window[:-1], labels = window[1:]

Global sample i is window ``permute(i % W, W, key(seed, i // W))``: each epoch is a different
pseudo-random permutation of all windows, computed per index in O(1) memory by a keyed Feistel
network (below). The last ``num_tokens - 1 - W*L`` tokens never start a window.
"""

from __future__ import annotations

import numpy as np

from mpformer.core.errors import ConfigError
from mpformer.data.indexed import IndexedDataset

_MASK64 = (1 << 64) - 1
FEISTEL_ROUNDS = 4  # Luby-Rackoff: 4 rounds of a pseudo-random function give a pseudo-random permutation


def _splitmix64(x: int) -> int:
    """The splitmix64 output function: a fast, well-mixed bijection on 64-bit integers."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix64(*values: int) -> int:
    """Hash a tuple of integers (any sign, any size mod 2**64) to a 64-bit integer; deterministic
    across processes and Python versions, unlike ``hash()``."""
    h = 0x6A09E667F3BCC908
    for v in values:
        h = _splitmix64(h ^ (v & _MASK64))
    return h


def permute(position: int, n: int, key: int) -> int:
    """The image of ``position`` under a pseudo-random permutation of ``range(n)`` chosen by ``key``.

    A balanced Feistel network on ``2b`` bits (2**2b is the smallest even power of two >= n, so
    at most 4n) is a bijection on ``range(2**2b)``; cycle-walking (re-apply until the value lands
    below n) restricts it to a bijection on ``range(n)``. Expected work: < 4 network evaluations.
    """
    if not 0 <= position < n:
        raise IndexError(f"position {position} outside range({n})")
    if n == 1:
        return 0
    bits = max(1, ((n - 1).bit_length() + 1) // 2)  # half width
    half_mask = (1 << bits) - 1
    round_keys = [mix64(key, r) for r in range(FEISTEL_ROUNDS)]
    x = position
    while True:
        left, right = x >> bits, x & half_mask
        for rk in round_keys:
            left, right = right, left ^ (_splitmix64(rk ^ right) & half_mask)
        x = (left << bits) | right
        if x < n:
            return x


def epoch_key(seed: int, epoch: int) -> int:
    """The Feistel key of one epoch; different epochs of one seed get unrelated orders."""
    return mix64(seed, epoch)


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens; ``ds[i]`` is defined for every ``i >= 0`` (epochs repeat
    the windows in a new order), so it has no ``len``; see ``samples_per_epoch``.

    Returns int64 arrays of shape ``[seq_length + 1]``.
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, seed: int) -> None:
        if seq_length < 1:
            raise ConfigError(f"seq_length must be a positive integer, got {seq_length}")
        self.indexed = indexed
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.samples_per_epoch = (indexed.num_tokens - 1) // self.seq_length if indexed.num_tokens else 0
        if self.samples_per_epoch < 1:
            raise ConfigError(
                f"dataset {indexed.prefix} is too small for seq_length {seq_length}: it has "
                f"{indexed.num_tokens} tokens, one sample needs {seq_length + 1}"
            )

    @property
    def num_tokens(self) -> int:
        return self.indexed.num_tokens

    def window_index(self, i: int) -> int:
        """Which window (in stream order) global sample ``i`` reads."""
        if i < 0:
            raise IndexError(f"sample index must be >= 0, got {i}")
        epoch, pos = divmod(int(i), self.samples_per_epoch)
        return permute(pos, self.samples_per_epoch, epoch_key(self.seed, epoch))

    def window(self, k: int) -> np.ndarray:
        """Window ``k`` in stream order: ``tokens[k*L : k*L + L + 1]`` as int64."""
        if not 0 <= k < self.samples_per_epoch:
            raise IndexError(f"window {k} outside range({self.samples_per_epoch})")
        start = k * self.seq_length
        return np.asarray(self.indexed.tokens[start : start + self.seq_length + 1], dtype=np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.window(self.window_index(i))

    def __repr__(self) -> str:
        return (
            f"GPTDataset({self.indexed.prefix!r}, seq_length={self.seq_length}, seed={self.seed}, "
            f"samples_per_epoch={self.samples_per_epoch})"
        )
