"""Read-ahead of training batches: the next steps' samples are read while this one computes.

A step's batches are a pure function of the position in the sample stream (``consumed_samples``:
the deterministic sampler), so a background thread can read them ahead without changing what any
step sees, and a resume reads exactly what the uninterrupted run read. On CUDA the batches are
pinned in the thread, so the copy to the device is asynchronous (``non_blocking`` from pageable
memory is a synchronous copy through a staging buffer).

    thread   for position p, p + stride, ...: read(p) -> [pin] -> queue (at most ``depth`` ahead)
    take(p)  the head of the queue if it was read for p, else (a jump: a rollback, a new run state)
             the thread restarts at p; then each tensor copied to the device without blocking

An error in ``read`` (a bad file, a token outside the vocabulary) is raised by the ``take`` of that
position, in the training thread, with its own message and traceback.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch's token ids ``[b, seq + 1]`` and, under document masks, each row's document starts
    in its inputs (host integers, found here on the host copy: on a GPU, finding them from the device's
    tokens would wait for it every micro-batch)."""

    tokens: torch.Tensor
    doc_starts: tuple[tuple[int, ...], ...] | None = None

    def pin_memory(self) -> MicroBatch:
        return MicroBatch(self.tokens.pin_memory(), self.doc_starts)

    def to(self, device: torch.device, non_blocking: bool = False) -> MicroBatch:
        return MicroBatch(self.tokens.to(device, non_blocking=non_blocking), self.doc_starts)


Batches = list[torch.Tensor] | list[MicroBatch]  # a read's result: plain tensors, or micro-batches with their starts


class StepLoader:
    def __init__(self, read: Callable[[int], Batches], stride: int, device: torch.device, *, depth: int = 2) -> None:
        """``read(p)``: the CPU tensors of the step that starts at sample position ``p``; ``stride``:
        samples per step; ``depth``: steps read ahead (0 reads in ``take``, synchronously)."""
        self.read, self.stride, self.device, self.depth = read, stride, device, depth
        self.pin = device.type == "cuda"
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))

    def take(self, position: int) -> Batches:
        """The batches of the step at ``position``, on the device (their copies may still be in flight
        on the current stream, which orders them before any kernel that reads them)."""
        if self.depth == 0:
            return self._to_device(self._prepare(position))
        if self._thread is None:
            self._start(position)
        got, item = self._queue.get()
        if got != position:
            self._start(position)
            got, item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        return self._to_device(item)

    def close(self) -> None:
        """Stop the thread (it may be blocked on a full queue: drain it so that it sees the flag)."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread = None

    def _start(self, position: int) -> None:
        self.close()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._run, args=(position, self._stop, self._queue),
                                        name="mpformer-data", daemon=True)
        self._thread.start()

    def _run(self, position: int, stop: threading.Event, out: queue.Queue) -> None:
        while not stop.is_set():
            try:
                item: Batches | BaseException = self._prepare(position)
            except BaseException as err:  # handed to the training thread, which raises it
                item = err
            while not stop.is_set():
                try:
                    out.put((position, item), timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            position += self.stride

    def _prepare(self, position: int) -> Batches:
        batches = self.read(position)
        return [b.pin_memory() for b in batches] if self.pin else batches

    def _to_device(self, batches: Batches) -> Batches:
        if self.device.type == "cpu":
            return batches
        return [b.to(self.device, non_blocking=True) for b in batches]
