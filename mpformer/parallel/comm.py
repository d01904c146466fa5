"""Collectives: a byte-counting ``Comm`` per group, and autograd-aware dual pairs on top of it.

Every collective mpformer issues goes through a :class:`Comm`, which records what this rank moves
into a :class:`CommLedger`, ring-adjusted (what a bandwidth-optimal ring sends per rank)::

    all-reduce of N bytes        2 (n-1)/n N       (reduce-scatter + all-gather)
    all-gather to N bytes          (n-1)/n N
    reduce-scatter of N bytes      (n-1)/n N
    all-to-all of N bytes          (n-1)/n N
    all-to-all with row splits     the rows sent to other ranks, exactly (equal splits: (n-1)/n N)

so the ledger can be compared with the analytic volumes of docs/formulas.md. It also keeps the host
seconds this rank spent blocked in communication, per kind (``blocked``): a synchronous collective from
call to return, an asynchronous one from ``wait()`` to its return. What overlaps compute never blocks,
so the sum is the communication a step did not hide (the trainer's ``exposed_comm_s``). On gloo that is
exact; NCCL calls return once queued on the GPU, so on CUDA it counts only host waits (a lower bound:
the profiler's NCCL kernels tell the rest).

The autograd pairs follow Megatron's mappings.py; each backward calls its dual::

    copy_to_region       fwd identity          bwd all-reduce
    reduce_from_region   fwd all-reduce        bwd identity
    scatter_to_region    fwd keep own chunk    bwd all-gather      (along ``dim``)
    gather_from_region   fwd all-gather        bwd keep own chunk  (along ``dim``)
    all_gather_seq       fwd all-gather        bwd reduce-scatter  (sequence dim 0: SP)
    reduce_scatter_seq   fwd reduce-scatter    bwd all-gather      (sequence dim 0: SP)
    all_to_all           fwd all-to-all        bwd all-to-all with the dims swapped

gloo and NCCL concatenate all-gather / reduce-scatter along dim 0; other dims are handled here,
once, by moving the dim to the front.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mpformer.parallel import pairwise

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor (deprecated, warning on every call);
# older torch, as GPU users may install, only has the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommLedger:
    """Bytes moved by this rank, per collective kind; the trainer reads and resets it every step."""

    def __init__(self) -> None:
        self.bytes: dict[str, float] = defaultdict(float)
        self.seconds: dict[str, float] = defaultdict(float)

    def record(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += nbytes  # fractional: (n-1)/n of a buffer; rounded once, in take()

    def blocked(self, kind: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, its duration counted as time blocked in ``kind``."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds[kind] += time.perf_counter() - t0

    def take(self) -> dict[str, int]:
        """Bytes per kind since the last take (the blocked seconds: ``take_seconds``)."""
        out = {k: round(v) for k, v in self.bytes.items()}
        self.bytes = defaultdict(float)
        return out

    def take_seconds(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


class TimedWork:
    """An asynchronous collective's work whose ``wait`` counts as blocked time in the ledger."""

    def __init__(self, work: dist.Work, ledger: CommLedger, kind: str) -> None:
        self.work, self.ledger, self.kind = work, ledger, kind
        self.keep: torch.Tensor | None = None  # an input that must outlive the collective

    def wait(self) -> bool:
        return self.ledger.blocked(self.kind, self.work.wait)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Comm:
    """One process group plus the ledger its traffic is written to. ``group=None`` is a group of one."""

    def __init__(self, group: dist.ProcessGroup | None, ledger: CommLedger, tag: str = "") -> None:
        self.group = group
        self.ledger = ledger
        self.tag = tag  # prefixes the ledger kinds, e.g. "tp." or "dp."
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.pairwise = pairwise.usable(group)  # gloo: reduce-scatter / all-gather as p2p (pairwise.py)

    def _rs(self, t: torch.Tensor) -> Callable[..., Any]:
        return pairwise.reduce_scatter if self.pairwise and t.device.type == "cpu" else _reduce_scatter

    def _ag(self, t: torch.Tensor) -> Callable[..., Any]:
        return pairwise.all_gather if self.pairwise and t.device.type == "cpu" else _all_gather

    def _note(self, kind: str, nbytes: int, factor: float) -> None:
        self.ledger.record(self.tag + kind, factor * nbytes * (self.size - 1) / self.size)

    def _run(self, kind: str, call: Callable[..., Any], *args: Any, async_op: bool = False, **kw: Any) -> Any:
        """Issue a collective: a synchronous one timed as blocked, an asynchronous one's wait likewise."""
        if async_op:
            return TimedWork(call(*args, group=self.group, async_op=True, **kw), self.ledger, self.tag + kind)
        return self.ledger.blocked(self.tag + kind, lambda: call(*args, group=self.group, **kw))

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = False) -> dist.Work | None:
        """In place. Ring-adjusted: 2 (n-1)/n of the buffer."""
        if self.size == 1:
            return None
        self._note("all_reduce", t.numel() * t.element_size(), 2.0)
        return self._run("all_reduce", dist.all_reduce, t, op=op, async_op=async_op)

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim``."""
        if self.size == 1:
            return t
        src = t.movedim(dim, 0).contiguous()
        out = torch.empty((self.size * src.shape[0], *src.shape[1:]), dtype=t.dtype, device=t.device)
        self._note("all_gather", out.numel() * out.element_size(), 1.0)
        self._run("all_gather", self._ag(src), out, src)
        return out.movedim(0, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's chunk along ``dim`` (which must divide evenly)."""
        if self.size == 1:
            return t
        if t.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} does not split into {self.size}")
        src = t.movedim(dim, 0).contiguous()
        out = torch.empty((src.shape[0] // self.size, *src.shape[1:]), dtype=t.dtype, device=t.device)
        self._note("reduce_scatter", src.numel() * src.element_size(), 1.0)
        self._run("reduce_scatter", self._rs(src), out, src)
        return out.movedim(0, dim)

    def reduce_scatter_into(self, out: torch.Tensor, src: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Flat ``src`` summed over ranks; this rank's 1/n of it into ``out`` (ZeRO's gradient shards)."""
        if self.size == 1:
            out.copy_(src)
            return None
        self._note("reduce_scatter", src.numel() * src.element_size(), 1.0)
        return self._run("reduce_scatter", self._rs(src), out, src, async_op=async_op)

    def all_gather_into(self, out: torch.Tensor, src: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """Every rank's flat ``src`` concatenated into ``out`` (ZeRO's parameter shards). ``src`` may be
        this rank's part of ``out`` (in place: NCCL and the pairwise form take it as is; gloo's own
        must not read what it writes, so it gets a copy)."""
        if self.size == 1:
            if src.data_ptr() != out.data_ptr():
                out.copy_(src)
            return None
        inside = out.data_ptr() <= src.data_ptr() < out.data_ptr() + out.numel() * out.element_size()
        if inside and src.device.type == "cpu" and not self.pairwise:
            src = src.clone()
        self._note("all_gather", out.numel() * out.element_size(), 1.0)
        work = self._run("all_gather", self._ag(src), out, src, async_op=async_op)
        if work is not None:
            work.keep = src  # alive until waited for (a copy made here has no other owner)
        return work

    def all_to_all(self, t: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Split ``t`` along ``scatter_dim`` into one chunk per rank, exchange, concatenate along ``gather_dim``."""
        if self.size == 1:
            return t
        if t.shape[scatter_dim] % self.size:
            raise ValueError(f"all_to_all: dim {scatter_dim} of size {t.shape[scatter_dim]} does not split into "
                             f"{self.size}")
        chunks = [c.contiguous() for c in t.chunk(self.size, dim=scatter_dim)]
        src = torch.stack(chunks)  # [n, ...chunk]: dim 0 is the destination rank
        out = torch.empty_like(src)
        self._note("all_to_all", src.numel() * src.element_size(), 1.0)
        self._run("all_to_all", dist.all_to_all_single, out, src)
        return torch.cat(out.unbind(0), dim=gather_dim)

    def all_to_all_single(self, t: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows of ``t`` (dim 0), ``send_splits[j]`` of them to rank j in rank order; returns the rows received,
        ``recv_splits[j]`` from rank j, in rank order (either may be 0). Ledger "all_to_all": the bytes that
        leave this rank, exactly (its own rows stay): ``(sum(send_splits) - send_splits[rank]) * row bytes``."""
        if len(send_splits) != self.size or len(recv_splits) != self.size or sum(send_splits) != t.shape[0]:
            raise ValueError(f"all_to_all_single: splits {send_splits} -> {recv_splits} need {self.size} entries "
                             f"each and to sum to the {t.shape[0]} rows sent")
        if self.size == 1:
            return t
        src = t.contiguous()
        out = src.new_empty((sum(recv_splits), *src.shape[1:]))
        row = math.prod(src.shape[1:]) * src.element_size()
        self.ledger.record(self.tag + "all_to_all", (sum(send_splits) - send_splits[self.rank]) * row)
        self._run("all_to_all", dist.all_to_all_single, out, src, output_split_sizes=list(recv_splits),
                  input_split_sizes=list(send_splits))
        return out

    def chunk(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunk along ``dim`` (no communication)."""
        if self.size == 1:
            return t
        if t.shape[dim] % self.size:
            raise ValueError(f"dim {dim} of size {t.shape[dim]} does not split into {self.size} equal chunks")
        return t.chunk(self.size, dim=dim)[self.rank].contiguous()


# ---- autograd dual pairs ------------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        ctx.comm.all_reduce(g)
        return g, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        x = x.contiguous().clone()
        comm.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllReduceSum(torch.autograd.Function):
    """A sum every rank goes on to use differently (a statistic over a split dimension: each rank
    normalises its own slice by it): each rank's loss reaches every rank's term, so the gradient of a
    term is the sum of every rank's gradient of the sum. Its own dual (forward and backward all-reduce),
    unlike _ReduceFromRegion, whose identity backward is right only for a replicated continuation."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        x = x.contiguous().clone()
        comm.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        ctx.comm.all_reduce(g)
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return comm.chunk(x, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_gather(g, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return comm.all_gather(x, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.chunk(g, ctx.dim), None, None


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_gather(x, 0)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.reduce_scatter(g, 0), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.reduce_scatter(x, 0)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_gather(g, 0), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, scatter_dim, gather_dim):
        ctx.comm, ctx.dims = comm, (scatter_dim, gather_dim)
        return comm.all_to_all(x, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        s, gd = ctx.dims
        return ctx.comm.all_to_all(g, gd, s), None, None, None


def copy_to_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if comm.size == 1 else _CopyToRegion.apply(x, comm)


def reduce_from_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceFromRegion.apply(x, comm)


def all_reduce_sum(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum over ``comm`` whose backward also sums (see _AllReduceSum)."""
    return x if comm.size == 1 else _AllReduceSum.apply(x, comm)


def scatter_to_region(x: torch.Tensor, comm: Comm, dim: int = -1) -> torch.Tensor:
    return x if comm.size == 1 else _ScatterToRegion.apply(x, comm, dim % x.dim())


def gather_from_region(x: torch.Tensor, comm: Comm, dim: int = -1) -> torch.Tensor:
    return x if comm.size == 1 else _GatherFromRegion.apply(x, comm, dim % x.dim())


def all_gather_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if comm.size == 1 else _AllGatherSeq.apply(x, comm)


def reduce_scatter_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceScatterSeq.apply(x, comm)


def all_to_all(x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    if comm.size == 1:
        return x
    return _AllToAll.apply(x, comm, scatter_dim % x.dim(), gather_dim % x.dim())
