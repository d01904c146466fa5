"""Deterministic, resumable batching: which global samples each rank reads at each step.

The training stream is an infinite sequence of global samples 0, 1, 2, ... whose contents are a
pure function of (seed, index) (GPTDataset / BlendedDataset). A step consumes the next
``global_batch_size`` indices; the data-parallel ranks split that range into contiguous chunks
and each chunk into micro-batches::

    step s, dp rank r, micro-step m  ->  s*GBS + r*(GBS/dp) + m*mbs + [0, mbs)

Reading the ranks in order and each rank's micro-steps in order gives back the step's range in
global order, whatever dp is, so a run resumed at step s with another dp size (or micro-batch
size) continues at exactly sample s*GBS. The only resume state is the step number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mpformer.core.errors import ConfigError
from mpformer.data.blend import BlendedDataset, SampleSource
from mpformer.data.gpt_dataset import GPTDataset, mix64
from mpformer.data.indexed import IndexedDataset

if TYPE_CHECKING:  # torch is imported where it is used, so the preprocessing CLI starts fast
    import torch


def build_train_dataset(
    paths: Sequence[str], weights: Sequence[float] | None, seq_length: int, seed: int
) -> GPTDataset | BlendedDataset:
    """One data prefix -> GPTDataset; several -> BlendedDataset of GPTDatasets.

    Sub-dataset d is shuffled with seed ``mix64(seed, d)`` so that two prefixes holding the same
    data still get different orders. ``weights=None`` with several paths weights each dataset by
    its number of samples per epoch (plain concatenation, as Megatron does without weights).
    """
    paths = list(paths)
    if not paths:
        raise ConfigError("data.paths is empty; give at least one dataset prefix (P for P.bin/P.idx)")
    if len(paths) == 1:
        if weights is not None and len(weights) != 1:
            raise ConfigError(f"got {len(weights)} weights for 1 data path; give one weight per path")
        return GPTDataset(IndexedDataset(paths[0]), seq_length, seed)
    if weights is not None and len(weights) != len(paths):
        raise ConfigError(f"got {len(weights)} weights for {len(paths)} data paths; give one weight per path")
    parts = [GPTDataset(IndexedDataset(p), seq_length, mix64(seed, d)) for d, p in enumerate(paths)]
    w = list(weights) if weights is not None else [float(p.samples_per_epoch) for p in parts]
    return BlendedDataset(parts, w, seed)


def num_micro_batches(*, dp_size: int, global_batch_size: int, micro_batch_size: int) -> int:
    """Micro-batches per step per data-parallel rank: GBS / (dp * mbs), which must be an integer."""
    if dp_size < 1 or global_batch_size < 1 or micro_batch_size < 1:
        raise ConfigError(
            f"dp_size, global_batch_size and micro_batch_size must be positive, got "
            f"{dp_size}, {global_batch_size}, {micro_batch_size}"
        )
    if global_batch_size % (dp_size * micro_batch_size):
        valid = [m for m in range(1, global_batch_size + 1) if global_batch_size % (dp_size * m) == 0]
        raise ConfigError(
            f"train.global_batch_size={global_batch_size} is not divisible by dp*micro_batch_size="
            f"{dp_size}*{micro_batch_size}; micro_batch_size values that fit dp={dp_size}: {valid or 'none'}"
        )
    return global_batch_size // (dp_size * micro_batch_size)


def micro_batch_sample_indices(
    step: int,
    micro_step: int,
    *,
    dp_rank: int,
    dp_size: int,
    global_batch_size: int,
    micro_batch_size: int,
) -> list[int]:
    """Global sample indices of micro-batch ``micro_step`` of rank ``dp_rank`` at ``step`` (0-based)."""
    n_micro = num_micro_batches(dp_size=dp_size, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside range({dp_size})")
    if not 0 <= micro_step < n_micro:
        raise ValueError(f"micro_step {micro_step} outside range({n_micro})")
    start = step * global_batch_size + dp_rank * (global_batch_size // dp_size) + micro_step * micro_batch_size
    return list(range(start, start + micro_batch_size))


def get_batch(dataset: SampleSource, indices: Sequence[int]) -> torch.Tensor:
    """Stack samples into a LongTensor ``[len(indices), seq_length + 1]`` (inputs = [:, :-1],
    labels = [:, 1:])."""
    import torch

    if len(indices) == 0:
        raise ValueError("get_batch needs at least one index")
    rows = np.stack([np.asarray(dataset[int(i)], dtype=np.int64) for i in indices])
    return torch.from_numpy(rows)


def sample_origin(dataset: SampleSource, i: int) -> str:
    """Where global sample ``i`` is read from: the data file and its token range (for error messages)."""
    from mpformer.data.blend import BlendedDataset
    from mpformer.data.gpt_dataset import GPTDataset

    if isinstance(dataset, BlendedDataset):
        d, i = dataset.source(i)
        dataset = dataset.datasets[d]
    if isinstance(dataset, GPTDataset):
        start = dataset.window_index(i) * dataset.seq_length
        return f"{dataset.indexed.prefix}.bin, tokens [{start}, {start + dataset.seq_length + 1})"
    return repr(dataset)
