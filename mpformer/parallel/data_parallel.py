"""Data parallelism: bucketed gradient all-reduce, overlapped with backward, with a no-sync context.

Each parameter's ``.grad`` is a view into one flat fp32 buffer per bucket (DDP's "gradient as
bucket view"): autograd accumulates into it in place, so a bucket needs no copy before or after
its collective. Buckets are filled in reverse parameter order, roughly the order backward
produces gradients; when the last gradient of a bucket is accumulated (a post-accumulate-grad
hook), the bucket's all-reduce starts asynchronously while backward carries on with earlier
layers. ``finish()`` waits for all of them before the optimizer step.

Gradients are divided by the group size before summing (gloo has no AVG reduction), so after
finish() every rank holds the mean gradient over the data-parallel group.

Requirement: every rank produces gradients for the same parameters in each step (no rank-dependent
conditional computation), so that buckets launch in the same order everywhere; collectives issued
in different orders would pair up wrong buckets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mpformer.parallel.comm import Comm


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    pending: int = 0
    handle: dist.Work | None = None
    ready: set[int] = field(default_factory=set)


class DataParallel:
    """Owns the gradients of ``model``'s parameters and reduces them over ``group``."""

    def __init__(self, model: nn.Module, comm: Comm | None, *, bucket_mb: float = 25.0,
                 grad_dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.comm = comm
        self.size = comm.size if comm is not None else 1
        self.sync = True
        self.params = [p for p in model.parameters() if p.requires_grad]
        # One rank has nothing to reduce: plain autograd gradients, no buffers, no hooks.
        cap = int(bucket_mb * 2**20 / torch.finfo(grad_dtype).bits * 8)
        self.buckets = self._make_buckets(cap, grad_dtype) if self.size > 1 else []
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params] \
            if self.size > 1 else []

    def _make_buckets(self, cap_elems: int, dtype: torch.dtype) -> list[_Bucket]:
        groups: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(self.params):
            if groups[-1] and size + p.numel() > cap_elems:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel()
        buckets = []
        for ps in groups:
            device = ps[0].device
            buf = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=device)
            offset = 0
            for p in ps:
                # Parameters and grads must match dtypes for AccumulateGrad to write into the view.
                assert p.dtype == dtype, "mixed-dtype gradients need a main-grad buffer (ZeRO issue)"
                p.grad = buf[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
            buckets.append(_Bucket(params=ps, buffer=buf, pending=len(ps)))
        return buckets

    # ---- hooks and synchronisation ------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (earlier micro-batches of a step); the last one syncs."""
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync or self.size == 1:
            return
        b = self._bucket_of[id(p)]
        assert b.handle is None, "a second synchronising backward before finish(): use no_sync() for all but the last"
        if id(p) in b.ready:
            return
        b.ready.add(id(p))
        if len(b.ready) == len(b.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        b.buffer.div_(self.size)
        assert self.comm is not None
        b.handle = self.comm.all_reduce(b.buffer, async_op=True)

    def start(self) -> None:
        """Launch every bucket not launched yet (a pipeline stage after its last backward: its
        gradients are final, the reductions overlap the schedule's remaining sends)."""
        if self.size == 1:
            return
        for b in self.buckets:
            if b.handle is None:
                self._launch(b)

    def finish(self) -> None:
        """Wait for every bucket's all-reduce; buckets whose hooks never fired (parameters unused in
        this step's graph) are reduced now so ranks stay in lockstep."""
        if self.size == 1:
            return
        for b in self.buckets:
            if b.handle is None:
                self._launch(b)
        for b in self.buckets:
            assert b.handle is not None
            b.handle.wait()
            b.handle = None
            b.ready.clear()

    def zero_grad(self) -> None:
        if self.size == 1:
            for p in self.params:
                p.grad = None
            return
        for b in self.buckets:
            b.buffer.zero_()
            for p in b.params:
                assert p.grad is not None and p.grad.data_ptr() >= b.buffer.data_ptr(), \
                    "a gradient stopped being a bucket view (set_to_none or replaced grad)"

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
