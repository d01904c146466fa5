"""Host buffers reused from one copy to the next: the CPU side of HostCopies (parallel/device.py).

On CUDA, the pinned host buffers of activation offload come from torch's caching host allocator: after
the first step, a copy out lands in a block that an earlier copy freed, already mapped. A plain CPU
tensor has no such cache: a freed buffer of more than glibc's mmap threshold (at most 32 MiB; a layer's
MLP activations are larger) goes back to the kernel, and the next one is faulted in afresh, page by
page. In a virtual machine whose memory the host lends lazily (this project's CI machines), a page
touched for the first time costs the host a fault too: a 352 MiB copy then took 0.15 s or, when the
pages were new, 1 to 2 s, and the copy thread fell three layers behind the forward (benchmarks/
bench_offload.py at its default size). This cache keeps freed buffers for the next copy of the same
size, so the copies of a steady step touch no new page, as on CUDA.

A buffer comes back to the cache when the last tensor viewing it dies (from any thread: hence the
lock). What the cache holds free is bounded by the most bytes ever in use at once, so shapes that
change from step to step cannot make it grow without end.
"""

from __future__ import annotations

import threading
import weakref

import torch


class HostBufferCache:
    """Buffers keyed by their exact size in bytes; ``empty_like`` is ``torch.empty_like`` on the CPU
    (a dense tensor's strides kept, as ``clone`` keeps them) from a reused buffer where one fits."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.in_use = 0  # bytes of the buffers lent out now
        self.free_bytes = 0
        self.high_water = 0  # the most bytes lent out at once: the bound on what is kept free
        self.reused = 0  # buffers lent again (for tests and benchmarks)
        self.allocated = 0  # buffers made new

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return torch.empty_like(t, device="cpu")
        with self._lock:
            bucket = self._free.get(nbytes)
            buf = bucket.pop() if bucket else None
            if buf is not None:
                self.free_bytes -= nbytes
                self.reused += 1
            else:
                self.allocated += 1
            self.in_use += nbytes
            self.high_water = max(self.high_water, self.in_use)
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        out = buf.view(t.dtype).as_strided(t.shape, dense_strides(t))
        weakref.finalize(out, self._give_back, buf)  # holds buf until out dies
        return out

    def _give_back(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel()
        with self._lock:
            self.in_use -= nbytes
            if self.free_bytes + nbytes <= self.high_water:
                self._free.setdefault(nbytes, []).append(buf)
                self.free_bytes += nbytes

    def clear(self) -> None:
        """Let the kernel have the free buffers back (those lent out return to the cache as they die)."""
        with self._lock:
            self._free.clear()
            self.free_bytes = 0


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides where it is dense and non-overlapping (a transposed view, a permuted tensor),
    else the contiguous ones: the layout ``torch.empty_like`` gives."""
    expected = 1
    for d in sorted((d for d in range(t.dim()) if t.size(d) != 1), key=t.stride):
        if t.stride(d) != expected:
            return _contiguous(t.shape)
        expected *= t.size(d)
    return tuple(t.stride())


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))
