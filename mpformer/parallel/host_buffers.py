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

A buffer comes back when its memory is no longer used: each loan is a tensor over a fresh numpy view of
the cached block, which only the loan's storage refers to, so every view, ``detach`` or ``numpy()`` of
the loan keeps the block lent. Its finalizer may run on any thread, and inside this module's own locked
code when a garbage collection starts there, so it takes no lock: it puts the block on a queue (whose
``put`` is reentrant), and the queue is emptied under the lock when a buffer is asked for. What is lent
and what is kept free together stay within the most ever lent at once: a size not seen before evicts
the free blocks freed longest ago, so a change of shapes replaces the stale sizes instead of leaving
them held and the new ones uncached.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch


class HostBufferCache:
    """Blocks keyed by their exact size in bytes. ``empty_like`` is ``torch.empty_like`` on the CPU (the
    same shape, dtype and strides) over a reused block where one of the size is free."""

    def __init__(self) -> None:
        self._free: OrderedDict[int, list[np.ndarray]] = OrderedDict()  # the size freed longest ago first
        self._returned: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()  # freed, not yet filed
        self._lock = threading.Lock()
        self._in_use = 0  # bytes lent out (as of the last filing)
        self._free_bytes = 0
        self.high_water = 0  # the most bytes lent out at once: the bound on lent + free
        self.reused = 0  # loans from a free block (for tests and benchmarks)
        self.allocated = 0  # loans of a new block

    @property
    def in_use(self) -> int:
        with self._lock:
            self._file_returned()
            return self._in_use

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._file_returned()
            return self._free_bytes

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or t.layout != torch.strided:  # sparse and the like keep their own form
            return torch.empty_like(t, device="cpu")
        with self._lock:
            self._file_returned()
            block = self._take(nbytes)
            self._in_use += nbytes
            self.high_water = max(self.high_water, self._in_use)
        if block is None:
            block = np.empty(nbytes, dtype=np.uint8)
        loan = block[:]  # only the storage below refers to this view: it dies with the last tensor on it
        strides = torch.empty_like(t, device="meta").stride()  # empty_like's own choice (dense: t's)
        out = torch.from_numpy(loan).view(t.dtype).as_strided(t.shape, strides)
        done = weakref.finalize(loan, self._returned.put, block)  # no lock here (module docstring)
        done.atexit = False
        return out

    def clear(self) -> None:
        """Let the kernel have the free blocks back (those lent out are kept again as they come back)."""
        with self._lock:
            self._file_returned()
            self._free.clear()
            self._free_bytes = 0

    def _take(self, nbytes: int) -> np.ndarray | None:
        # Under the lock. A free block of the size, or None after making room for a new one.
        bucket = self._free.get(nbytes)
        if bucket:
            block = bucket.pop()
            if not bucket:
                del self._free[nbytes]
            self._free_bytes -= nbytes
            self.reused += 1
            return block
        self.allocated += 1
        limit = max(self.high_water, self._in_use + nbytes)
        while self._free and self._in_use + nbytes + self._free_bytes > limit:
            size, blocks = next(iter(self._free.items()))
            blocks.pop(0)
            self._free_bytes -= size
            if not blocks:
                del self._free[size]
        return None

    def _file_returned(self) -> None:
        # Under the lock: the blocks whose loans died since, filed as free (the newest size last).
        while True:
            try:
                block = self._returned.get_nowait()
            except queue.Empty:
                return
            n = block.nbytes
            self._in_use -= n
            self._free.setdefault(n, []).append(block)
            self._free.move_to_end(n)
            self._free_bytes += n
