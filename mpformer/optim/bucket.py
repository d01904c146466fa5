"""One flat bucket of the gradient engine and the state machine of its reduction.

    gradients arrive   full_grads() (created on first use at stages 2-3: fp32, or at stage 3 in the
                       parameter dtype), ready_after(p)
    launch()           divided by dp, cast to the reduce dtype, all-reduced (stage 0, in place) or
                       reduce-scattered into a fresh shard (stages 1-3), asynchronously
    complete()         waited for: into the whole buffer (stage 0), the buffer's own shard (stage 1),
                       or accumulated into the persistent fp32 shard (stages 2-3, every micro-batch)
    reset()            zero_grad

``ShardParam`` names a piece of a bucket this rank's optimizer steps; ``shard_grads`` finds a gradient
spec's block among them (the engine's tensor-parallel sums and the step's norm both read it).

The engine (engine.py) decides when each happens and bounds how many are in flight. At stages 2-3
the full buffers come from a small ``GradPool`` and go back to it once reduced: a fresh 25 MB buffer
every micro-batch costs its page faults (first touch, ~1.4 GB/s on the CPU machines here) each time
(on CUDA the caching allocator would keep them anyway).
The pool is emptied at the end of each step, so that between steps a rank holds its model state alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mpformer.core.buffers import BucketLayout, Piece
from mpformer.parallel.comm import Comm
from mpformer.parallel.tensor_parallel import GradSpec


class GradPool:
    """Idle buffers lent out as zeroed full-gradient buffers, the smallest that fits: at most ``limit``
    of them (stage 2: the engine's bound on buckets in flight) and at most ``limit_bytes`` together
    (stage 3: its reduction budget; a larger buffer is not kept), the smallest dropped first.
    Communication buffers, as DeepSpeed's reduce buckets: not model state (memory.py's table)."""

    def __init__(self, limit: int | None, limit_bytes: float = float("inf")) -> None:
        self.limit, self.limit_bytes, self.idle = limit, limit_bytes, []

    def take(self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        fits = [i for i, b in enumerate(self.idle) if b.numel() >= numel and b.device == device and b.dtype == dtype]
        if fits:
            return self.idle.pop(min(fits, key=lambda i: self.idle[i].numel()))[:numel].zero_()
        return torch.zeros(numel, device=device, dtype=dtype)

    def clear(self) -> None:
        self.idle = []

    def give(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        if base.numel() * base.element_size() > self.limit_bytes:
            return  # freed: never kept beside the budget
        self.idle.append(base)
        while self.idle and ((self.limit is not None and len(self.idle) > self.limit)
                             or self.bytes() > self.limit_bytes):
            self.idle.pop(min(range(len(self.idle)), key=lambda i: self.idle[i].numel()))  # keep the largest

    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.idle)


@dataclass
class Bucket:
    """One flat bucket and its reduction's state (the state machine below; the engine orders it)."""

    layout: BucketLayout
    params: list[nn.Parameter]  # in slot order
    param_buf: torch.Tensor  # the parameters are views into it; stage 3: storage only while gathered
    param_shard: torch.Tensor | None  # this rank's part (a view of param_buf below stage 3; 16-bit stage 3: none)
    grad_shard: torch.Tensor  # fp32, this rank's reduced gradients (a view of grad_buf at stages 0-1)
    grad_buf: torch.Tensor | None  # full gradients (stages 2-3: only while a micro-batch's arrive)
    masters: torch.Tensor | None = None  # fp32 master shard of 16-bit parameters
    module: nn.Module | None = None  # stage 3: the unit
    index: int = 0  # its place in the engine's list
    ready: set[int] = field(default_factory=set)
    launched: bool = False
    pending: tuple[dist.Work | None, torch.Tensor, torch.Tensor] | None = None  # work, input, output
    pool: GradPool | None = None  # stages 2-3: where full buffers come from and go back to
    lent: torch.Tensor | None = None  # the pooled buffer of the reduction in flight
    grad_dtype: torch.dtype = torch.float32  # of the full gradients: stage 3 keeps the parameter dtype
    view: str = "data"  # the mesh view its gradients reduce over and its shards are taken on (engine.py)

    def full_grads(self) -> torch.Tensor:
        if self.grad_buf is None:  # stages 2-3: the first gradient of a micro-batch, or none came
            dev = self.grad_shard.device
            self.grad_buf = (self.pool.take(self.layout.size, dev, self.grad_dtype) if self.pool is not None
                             else torch.zeros(self.layout.size, device=dev, dtype=self.grad_dtype))
        return self.grad_buf

    def ready_after(self, p: nn.Parameter) -> bool:
        """``p``'s gradient is in; True once every gradient of the bucket is."""
        self.ready.add(id(p))
        return len(self.ready) == len(self.params)

    def launch(self, comm: Comm, stage: int, dtype: torch.dtype, persistent: bool, replicas: int) -> None:
        """Start the reduction: divided by the data replicas first (gloo has no AVG; under context
        parallelism the group's cp ranks hold partial sums of one replica's gradient), in ``dtype``;
        all-reduced in place at stage 0 (the "shard" is the whole buffer), reduce-scattered into a
        fresh shard otherwise. A group of one rank (experts' when ep = dp x cp) reduces nothing: its
        shard is the whole buffer, so only the division runs, in place and in fp32 (a copy in
        ``dtype`` and a fresh shard would hold a second buffer of the bucket until the step's end:
        5.6 GB of Mixtral 8x7B's experts on a stage of 8 layers at ZeRO-1)."""
        if comm.size == 1:
            src = self.full_grads().div_(replicas)
            self.pending = (None, src, self.grad_shard if stage == 1 else src)
        elif stage == 0:
            src = self.full_grads().div_(replicas).to(dtype)
            self.pending = (comm.all_reduce(src, async_op=True), src, src)
        else:
            src = self.full_grads().div_(replicas).to(dtype)
            out = torch.empty(self.layout.shard_size, dtype=src.dtype, device=src.device)
            self.pending = (comm.reduce_scatter_into(out, src, async_op=True), src, out)
        self.ready.clear()
        self.launched = True
        if not persistent:
            self.lent, self.grad_buf = self.grad_buf, None  # back to the pool once the reduction is done

    def complete(self, stage: int, persistent: bool) -> None:
        assert self.pending is not None
        work, _, out = self.pending
        if work is not None:
            work.wait()
        if stage == 0:
            if out is not self.grad_buf:  # reduced in another dtype
                self.grad_buf.copy_(out)
        elif persistent:  # stage 1: one reduction a step, into the buffer's own shard
            if out is not self.grad_shard:  # (a group of one divided it there)
                self.grad_shard.copy_(out)
        else:  # stages 2-3 reduce every micro-batch and accumulate in the persistent shard
            self.grad_shard.add_(out)
        if self.lent is not None and self.pool is not None:
            self.pool.give(self.lent)
        self.pending, self.lent = None, None

    def reset(self, persistent: bool) -> None:
        assert self.pending is None, "zero_grad() with a reduction in flight: call finish() first"
        self.ready.clear()
        self.launched = False
        if persistent:
            self.grad_buf.zero_()  # the shard (and with views every p.grad) is a view of it
        else:
            self.grad_shard.zero_()
            self.grad_buf = None


@dataclass(frozen=True)
class ShardParam:
    """A piece of model parameter ``name`` that this rank updates: elements ``[lo, hi)`` of the flat
    parameter, as the tensor ``master`` the wrapped optimizer steps (``bucket``: where it lives)."""

    name: str
    param: nn.Parameter
    piece: Piece
    bucket: int
    master: torch.Tensor


def shard_grads(shards: Sequence[ShardParam], specs: Sequence[GradSpec]) -> list[tuple[torch.Tensor, GradSpec]]:
    """This rank's part of each spec's gradient block (views into the gradient shards)."""
    by_param: dict[int, list[ShardParam]] = {}
    for s in shards:
        by_param.setdefault(id(s.param), []).append(s)
    out = []
    for spec in specs:
        p = spec.param
        row = p.numel() // p.shape[0] if p.dim() > 0 else 1
        lo, hi = (0, p.numel()) if spec.rows is None else (spec.rows[0] * row, spec.rows[1] * row)
        for s in by_param.get(id(p), []):
            a, b = max(lo, s.piece.lo), min(hi, s.piece.hi)
            if a < b:
                out.append((s.master.grad.reshape(-1)[a - s.piece.lo:b - s.piece.lo], spec))
    return out
