"""The device choice per process, the stopwatch behind pipeline traces, and the read-ahead loader."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mpformer.core.errors import ConfigError
from mpformer.data.loader import StepLoader
from mpformer.parallel.device import Device, Stopwatch, gpu_index


@pytest.mark.parametrize("local_rank,local_world,visible,want", [
    (0, 8, 8, 0), (5, 8, 8, 5),  # torchrun's default: every process sees the node's GPUs
    (0, 1, 1, 0), (3, 8, 1, 0), (7, 8, 1, 0),  # one visible GPU per process (CUDA_VISIBLE_DEVICES per rank)
    (1, 2, 4, 1),  # fewer processes than GPUs
])
def test_gpu_index(local_rank, local_world, visible, want):
    assert gpu_index(local_rank, local_world, visible) == want


def test_gpu_index_refuses_two_ranks_on_one_gpu():
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=3 \(of 4 processes on this node\) but this process sees 2"):
        gpu_index(3, 4, 2)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        gpu_index(0, 1, 0)


def test_cpu_stopwatch_reads_host_seconds():
    watch = Stopwatch(Device("cpu"))
    a = watch.mark()
    time.sleep(0.01)
    b = watch.mark()
    assert watch.seconds(b) - watch.seconds(a) >= 0.01


def _reader(log: list[int], fail_at: int | None = None):
    def read(position: int) -> list[torch.Tensor]:
        log.append(position)
        if position == fail_at:
            raise ValueError(f"bad sample at {position}")
        return [torch.full((2, 3), position), torch.full((2, 3), position + 1)]
    return read


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_loader_gives_each_position_its_batches_and_follows_jumps(depth):
    log: list[int] = []
    loader = StepLoader(_reader(log), stride=8, device=torch.device("cpu"), depth=depth)
    try:
        for p in (0, 8, 16, 24):
            got = loader.take(p)
            assert [int(t[0, 0]) for t in got] == [p, p + 1]
        got = loader.take(8)  # a jump back (a rollback): read again from there
        assert int(got[0][0, 0]) == 8
        assert int(loader.take(16)[0][0, 0]) == 16
    finally:
        loader.close()
    assert not any(t.name == "mpformer-data" and t.is_alive() for t in threading.enumerate())
    if depth:
        assert max(log) <= 24 + 8 * (depth + 1)  # ahead of the furthest take: its queue and the one in hand


def test_loader_raises_the_readers_error_in_take():
    loader = StepLoader(_reader([], fail_at=16), stride=8, device=torch.device("cpu"), depth=2)
    loader.take(0)
    loader.take(8)
    with pytest.raises(ValueError, match="bad sample at 16"):
        loader.take(16)
    loader.close()
