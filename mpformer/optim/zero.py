"""ZeRO stages 1 and 2 by composition: flat buffers, sharded gradients, any elementwise optimizer.

Each data-parallel rank owns 1/dp of every bucket (buffers.py). What it keeps:

    stage 0   (16-bit models only; fp32 ones use DataParallel) everything: the "shard" is the whole
              bucket, gradients are all-reduced, and the fp32 masters are full copies

    stage 1   full parameters, full fp32 main gradients (accumulated over micro-batches), and the
              optimizer state and master weights of its shard only; after the last micro-batch each
              bucket's gradients are reduce-scattered as soon as backward has finished them.
    stage 2   as stage 1, but a bucket's full gradients live only from its first gradient of a
              micro-batch until that micro-batch's reduce-scatter: every micro-batch reduces, and
              the rank keeps just its fp32 gradient shard between micro-batches.

After the optimizer step on the shard, every bucket's parameters are all-gathered. Per step that
is Psi elements reduce-scattered and Psi all-gathered: the 2 Psi of docs/formulas.md (stage 2: per
micro-batch for the gradients).

The wrapped optimizer (any torch optimizer whose update is elementwise: AdamW, Adam, SGD) sees
one 1-D "shard parameter" per model parameter piece this rank owns: for fp32 models a view into
the model's own parameter storage (the update lands in place), for 16-bit models an fp32 master
copy that is cast back into the parameter buffer after the step. Its gradient is a view into the
rank's fp32 gradient shard. Elementwise updates make the sharded step equal to the unsharded one.

How gradients reach the buffers: a post-accumulate-grad hook adds each parameter's ``.grad`` into
its slot of the bucket's fp32 main-gradient buffer and drops ``.grad`` (Megatron's ``main_grad``),
so 16-bit parameters accumulate in fp32 and stage 2 can free a bucket without touching autograd.
Gradients are divided by dp before the sum (gloo has no AVG), as in data_parallel.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mpformer.optim.buffers import BucketLayout, plan_buckets
from mpformer.optim.sharded import ShardedBase
from mpformer.optim.zero_state import ShardParam
from mpformer.parallel.comm import Comm


@dataclass
class _Bucket:
    layout: BucketLayout
    params: list[nn.Parameter]  # in slot order
    param_buf: torch.Tensor  # model dtype, full bucket; the parameters are views into it
    grad_shard: torch.Tensor  # fp32, this rank's shard of the reduced gradients (stage 1: a view of grad_buf)
    grad_buf: torch.Tensor | None = None  # fp32 full main gradients (stage 2: only while reducing)
    ready: set[int] = field(default_factory=set)
    launched: bool = False  # stage 1: reduced this step
    pending: tuple[dist.Work | None, torch.Tensor, torch.Tensor] | None = None  # work, input, output


class ZeroOptimizer(ShardedBase):
    """The gradient synchronisation (no_sync / start / finish / zero_grad, as DataParallel) and the
    optimizer step of ZeRO stage 0 (16-bit), 1 or 2 over the data-parallel ``comm``; ``param_dtype``
    is the dtype the model's parameters are cast to (fp32 masters are kept when it is 16-bit)."""

    def __init__(self, model: nn.Module, comm: Comm, *, stage: int,
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 groups: Sequence[dict], bucket_mb: float = 25.0, param_dtype: torch.dtype = torch.float32) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroOptimizer runs stages 0, 1 and 2, not {stage}")
        super().__init__(model, comm, stage=stage, param_dtype=param_dtype)
        # Stage 0 keeps the whole bucket on every rank: lay it out for one "rank".
        self.shard_rank, shard_dp = (0, 1) if stage == 0 else (comm.rank, comm.size)
        cap = max(1, int(bucket_mb * 2**20 / 4))  # fp32 main-gradient elements per bucket
        layouts = plan_buckets([p.numel() for p in self.params], shard_dp, cap)
        self.buckets = [self._materialise(b) for b in layouts]
        self._where = {id(p): (k, s) for k, b in enumerate(self.buckets) for p, s in zip(b.params, b.layout.slots)}
        self.shards = self._shard_params()
        self._in_flight: list[_Bucket] = []
        self._build_optimizer(groups, make_optimizer)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    # ---- construction ------------------------------------------------------------------------
    def _materialise(self, layout: BucketLayout) -> _Bucket:
        params = [self.params[s.index] for s in layout.slots]
        dev = params[0].device
        buf = torch.zeros(layout.size, dtype=self.param_dtype, device=dev)
        self._fp32_init = getattr(self, "_fp32_init", {})
        for p, s in zip(params, layout.slots):
            if self.param_dtype != p.dtype:  # the masters start from the full-precision values
                self._fp32_init[id(p)] = p.detach().float().reshape(-1).clone()
            buf[s.start:s.end].copy_(p.detach().reshape(-1))
            p.data = buf[s.start:s.end].view_as(p)  # the parameter now lives in the bucket
        if self.stage < 2:  # the shard is a view of the full buffer (Megatron's layout): no extra copy
            grads = self._zeros(layout, dev)
            lo, hi = layout.shard_range(self.shard_rank)
            return _Bucket(layout, params, buf, grads[lo:hi], grads)
        shard = torch.zeros(layout.shard_size, dtype=torch.float32, device=dev)
        return _Bucket(layout, params, buf, shard, None)

    @staticmethod
    def _zeros(layout: BucketLayout, device: torch.device) -> torch.Tensor:
        return torch.zeros(layout.size, dtype=torch.float32, device=device)

    def _shard_params(self) -> list[ShardParam]:
        out = []
        for k, b in enumerate(self.buckets):
            lo, _ = b.layout.shard_range(self.shard_rank)
            for piece in b.layout.pieces(self.shard_rank):
                start = lo + piece.shard_offset
                view = b.param_buf[start:start + piece.numel]
                p = self.params[piece.index]
                if self.param_dtype == torch.float32:
                    master = view
                else:  # from the full-precision initial values, not their 16-bit rounding
                    full = self._fp32_init.get(id(p))
                    master = full[piece.lo:piece.hi].clone() if full is not None else view.detach().float()
                master.grad = b.grad_shard[piece.shard_offset:piece.shard_offset + piece.numel]
                out.append(ShardParam(self.names[piece.index], p, piece, k, master))
        self._fp32_init = {}
        return out

    # ---- gradients ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stages 0-1: accumulate locally (earlier micro-batches). Stage 2 reduces every micro-batch."""
        prev, self.sync = self.sync, self.stage == 2
        try:
            yield
        finally:
            self.sync = prev

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:  # a split backward's BI: the weight gradient comes later, from BW
            return
        k, slot = self._where[id(p)]
        b = self.buckets[k]
        if b.grad_buf is None:
            b.grad_buf = self._zeros(b.layout, p.device)
        b.grad_buf[slot.start:slot.end].view_as(p).add_(p.grad)
        p.grad = None
        if not self.sync:
            return
        b.ready.add(id(p))
        if len(b.ready) == len(b.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        if b.pending is not None:  # stage 2: this bucket's previous micro-batch is still reducing
            self._in_flight.remove(b)
            self._complete(b)
        if b.grad_buf is None:  # no gradient reached this bucket (unused parameters)
            b.grad_buf = self._zeros(b.layout, b.param_buf.device)
        b.grad_buf.div_(self.comm.size)
        if self.stage == 0:  # in place: the "shard" is the whole buffer
            b.pending = (self.comm.all_reduce(b.grad_buf, async_op=True), b.grad_buf, b.grad_buf)
        else:
            out = torch.empty_like(b.grad_shard)
            b.pending = (self.comm.reduce_scatter_into(out, b.grad_buf, async_op=True), b.grad_buf, out)
        b.ready.clear()
        b.launched = True
        if self.stage == 2:
            b.grad_buf = None  # the pending tuple keeps it alive until the reduction is done
        self._in_flight.append(b)
        while self.stage == 2 and len(self._in_flight) > 2:  # bound the full buffers alive at once
            self._complete(self._in_flight.pop(0))

    def _complete(self, b: _Bucket) -> None:
        assert b.pending is not None
        work, _, out = b.pending
        if work is not None:
            work.wait()
        if self.stage == 1:  # one reduction per step, into the buffer's own shard
            b.grad_shard.copy_(out)
        elif self.stage == 2:  # stage 2 reduces every micro-batch and accumulates in the persistent shard
            b.grad_shard.add_(out)
        b.pending = None

    def start(self) -> None:
        """Launch every reduction still owed this step (a pipeline stage after its last backward)."""
        for b in self.buckets:
            owed = not b.launched if self.stage < 2 else b.grad_buf is not None
            if owed and b.pending is None:
                self._launch(b)

    def finish(self) -> None:
        """Wait for every reduction; afterwards each rank holds its shard of the mean gradient."""
        self.start()
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    def zero_grad(self) -> None:
        for b in self.buckets:
            assert b.pending is None, "zero_grad() with a reduction in flight: call finish() first"
            b.ready.clear()
            b.launched = False
            if self.stage < 2:
                assert b.grad_buf is not None
                b.grad_buf.zero_()  # the shard is a view of it
            else:
                b.grad_shard.zero_()
                b.grad_buf = None

    # ---- step ------------------------------------------------------------------------------------
    def _write_back(self) -> None:
        if self.param_dtype == torch.float32:  # the masters are views of the parameters
            return
        for s in self.shards:  # masters -> this rank's part of the 16-bit parameters
            b = self.buckets[s.bucket]
            start = b.layout.shard_range(self.shard_rank)[0] + s.piece.shard_offset
            b.param_buf[start:start + s.piece.numel].copy_(s.master)

    def step(self) -> None:
        """The wrapped optimizer on this rank's shard, then every bucket's parameters all-gathered."""
        self.optimizer.step()
        self.steps_taken += 1
        self._write_back()
        if self.stage == 0:
            return
        works = []
        for b in self.buckets:
            lo, hi = b.layout.shard_range(self.comm.rank)
            mine = b.param_buf[lo:hi].clone()  # the collective's input must not alias its output
            works.append(self.comm.all_gather_into(b.param_buf, mine, async_op=True))
        for w in works:
            if w is not None:
                w.wait()

    # ---- what ShardedBase and the trainer read --------------------------------------------------
    def grad_shard_buffers(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets]

    def weight_buffers(self) -> list[torch.Tensor]:
        return [b.param_buf for b in self.buckets]

    def _full_grads(self) -> list[torch.Tensor]:
        return [b.grad_buf for b in self.buckets if b.grad_buf is not None]

    def grad_ready(self, p: torch.Tensor) -> None:
        self._on_grad(p)

    def main_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        k, slot = self._where[id(p)]
        buf = self.buckets[k].grad_buf
        return None if buf is None else buf[slot.start:slot.end].view_as(p)
