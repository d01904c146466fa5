"""One pipeline rank alone: a stand-in for its neighbours, for measuring that rank's compute and memory
(benchmarks/bench_offload.py, tests/unit/test_offload_memory.py) without starting a process group."""

from __future__ import annotations

import torch

from mpformer.pipeline.p2p import Pending


class LoopbackP2P:
    """The neighbours of one rank: sends go nowhere, and every receive holds a random tensor of the
    boundary's shape at once, so the rank computes back to back as a rank whose messages are always in
    time."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)

    def buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def post(self, sends: list, recvs: list) -> tuple[Pending, list[Pending]]:
        for _, t in recvs:
            t.normal_(0.0, 1e-3)
        return Pending([], []), [Pending([], []) for _ in recvs]
