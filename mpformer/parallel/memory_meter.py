"""Peak memory of a block of work on either device: what benchmarks/bench_offload.py reports.

CUDA's caching allocator counts its bytes (read through Device.max_memory_allocated). CPU's allocator counts
nothing, so on CPU a ``StorageMeter`` counts instead: a dispatch mode that sees every op the block runs
(forward and backward alike: autograd carries the mode into the backward) and adds up the storages its
outputs newly allocate, each until it is freed. That is the allocator's live count between ops; what an
op allocates and frees inside itself (a kernel's scratch) is not seen. tests/unit/test_memory_meter.py
checks it against the C library's own count of bytes in use (``mallinfo2``).

Only the thread that entered the meter is counted: a copy that HostCopies makes on its background thread
lands in what stands for host memory on a CPU, as a pinned buffer on a GPU is not device memory either.
The meter runs Python at every op: for measurements, not for training.
"""

from __future__ import annotations

from types import TracebackType

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mpformer.parallel.device import Device


def _storages(tree: object, device: torch.device) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.device == device]


class StorageMeter(TorchDispatchMode):
    """Bytes of the tensor storages allocated while it is on and still alive (``current``), and the most
    of them alive at once (``peak``). Storages that existed before (parameters, a view of one, an
    in-place op's output) are not counted: the count starts at zero, as ``peak - base`` does on CUDA.
    Only ``device``'s storages count (a meta tensor holds no bytes). A storage is counted at the size it
    has when an op first returns it: resizing a storage (``resize_``, an ``out=`` into an empty tensor,
    ZeRO-3's freeing of gathered parameters in optim/gather.py) is not seen, so this is not a meter for
    ZeRO-3."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._current = 0
        self.peak = 0

    @property
    def current(self) -> int:
        self._forget_freed()
        return self._current

    def reset_peak(self) -> None:
        self.peak = self.current

    def _forget_freed(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self._current -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        inputs = {StorageWeakRef(s).cdata for s in _storages((args, kwargs), self.device)}
        out = func(*args, **(kwargs or {}))
        for storage in _storages(out, self.device):
            ref = StorageWeakRef(storage)
            if ref.cdata not in inputs and ref.cdata not in self._live:
                self._live[ref.cdata] = (ref, storage.nbytes())
                self._current += storage.nbytes()
        # Frees matter only where they decide a new peak: looked for then (a pass over every live storage
        # at every op would hold the interpreter's lock long enough to slow the other threads measured,
        # HostCopies' among them). A weak reference keeps its storage's address from being reused.
        if self._current > self.peak:
            self._forget_freed()
            self.peak = max(self.peak, self._current)
        return out


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak``: the most bytes allocated at once during the
    block above what was allocated at its start (CUDA: the allocator's statistics, synchronised at both
    ends; CPU: a StorageMeter)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.peak = 0
        self._meter: StorageMeter | None = None
        self._base = 0

    def __enter__(self) -> PeakMemory:
        if self.device.kind == "cuda":
            self.device.synchronize()
            self.device.reset_peak_memory()
            self._base = self.device.memory_allocated()
        else:
            self._meter = StorageMeter().__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._meter is None:
            self.device.synchronize()
            self.peak = (self.device.max_memory_allocated() or 0) - self._base
            return
        self._meter.__exit__(kind, exc, tb)
        self.peak, self._meter = self._meter.peak, None
