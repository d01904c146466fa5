"""Dropout randomness under tensor parallelism, held by an explicit object (no global tracker).

Two streams: the default generator, seeded alike on every tp rank, so that dropout on tensors that
every tp rank holds in full (the residual stream without sequence parallelism) draws the same mask
everywhere and the replicas stay identical; and a tp-rank stream for tensors that differ per rank
(attention heads, sequence-parallel chunks), so that their masks are independent.

``fork()`` swaps the tp-rank stream in for the default one around a region (Megatron's CUDA RNG
tracker, made explicit). Activation recompute must replay the same masks: ``checkpoint_contexts()``
gives torch.utils.checkpoint the pair of contexts that rewind the stream for the recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mpformer.parallel.device import Device

TP_SEED_OFFSET = 2718  # Megatron's offset between the default and the tensor-parallel stream


class TPRandom:
    def __init__(self, seed: int, tp_rank: int, device: Device) -> None:
        self.device, self.tp_rank = device, tp_rank
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Start the tp-rank stream afresh from ``seed`` (offset per tp rank)."""
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(seed + TP_SEED_OFFSET + self.tp_rank)
            self.state = self.device.rng_state()

    def load_state(self, state: dict) -> None:
        """A saved ``state`` (a checkpoint's) becomes this stream's."""
        self.state = state

    def _devices(self) -> list[int]:
        return [self.device.index] if self.device.live_cuda else []

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body with the tp-rank stream as the default generator."""
        outside = self.device.rng_state()
        self.device.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = self.device.rng_state()
            self.device.set_rng_state(outside)

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(forward, recompute) contexts for ``torch.utils.checkpoint(context_fn=...)``: the recompute
        starts the tp-rank stream where the original forward started it, then leaves it where the
        original forward left it."""
        start: dict[str, dict] = {}

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            start["state"] = {k: v.clone() for k, v in self.state.items()}
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            after, self.state = self.state, start["state"]
            try:
                yield
            finally:
                self.state = after

        return forward(), recompute()


class DropoutStreams:
    """This rank's dropout streams as one checkpoint part: the default generator and, with tp, the
    tp-rank stream. ``seed`` already differs per data-parallel replica, cp rank and pipeline stage
    (ProcessGroups.dropout_offset) and, after a resume that cannot reuse the saved states, the seed
    moves on per step, so no mask sequence repeats."""

    def __init__(self, device: Device, tp_rng: TPRandom | None, seed: int) -> None:
        self.device, self.tp_rng = device, tp_rng
        self.base = seed

    def reseed(self, step: int) -> None:
        seed = self.base + 1_000_003 * step
        torch.manual_seed(seed)
        if self.tp_rng is not None:
            self.tp_rng.reseed(seed)

    def state(self) -> dict:
        return {"default": self.device.rng_state(), "tp": self.tp_rng.state if self.tp_rng is not None else None}

    def load(self, saved: dict) -> None:
        self.device.set_rng_state(saved["default"])
        if saved.get("tp") is not None and self.tp_rng is not None:
            self.tp_rng.load_state(saved["tp"])
