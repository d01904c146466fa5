"""ZeRO stage 3: parameters sharded too, all-gathered per layer just before use and freed after.

Units: every transformer layer is one, and the root (embedding, positions, final norm, LM head) is
another. Each unit's parameters are views into one flat buffer ``full`` whose storage exists only
while the unit is gathered (FSDP's storage trick: ``resize_(0)`` frees it, the views stay valid and
see the data again once it is re-grown and all-gathered). Each rank keeps, per unit, its shard of
the parameters, of the fp32 gradients, of the master weights (16-bit models) and of the
optimizer state: 16 Psi / N_d bytes in the ZeRO table's terms, plus the units in flight.

    forward   root: gather it, prefetch layer 0;   layer i: wait for it, prefetch layer i+1, run,
              free it (unless its backward has begun: activation recompute runs forward again)
    backward  a hook on each unit's output fires when its gradient arrives: gather the unit (and
              prefetch the one before it); when all of a unit's parameter gradients are in, reduce-
              scatter them into the gradient shard (async) and free the unit
    step      the wrapped optimizer on the shards; 16-bit parameters get the cast masters; nothing
              is gathered until the next forward

Per micro-batch that is Psi all-gathered in forward, Psi again in backward and Psi reduce-scattered:
docs/formulas.md's 3 Psi. Not supported yet (validate() says so): pipeline parallelism.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mpformer.optim.buffers import BucketLayout, Slot, plan_buckets
from mpformer.optim.sharded import ShardedBase
from mpformer.optim.zero_state import ShardParam
from mpformer.parallel.comm import Comm


@dataclass
class _Unit:
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    layout: BucketLayout
    full: torch.Tensor  # parameter dtype; storage freed while the unit is not gathered
    shard: torch.Tensor  # parameter dtype, this rank's part of ``full``
    grad_shard: torch.Tensor  # fp32
    init: torch.Tensor | None  # fp32 initial values of this rank's part (the masters start from them)
    gathered: bool = True
    gathering: dist.Work | None = None
    backward_pending: bool = False
    grad_buf: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    pending: tuple[dist.Work | None, torch.Tensor, torch.Tensor] | None = None


class Zero3Optimizer(ShardedBase):
    def __init__(self, model: nn.Module, comm: Comm, *, make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 groups: Sequence[dict], param_dtype: torch.dtype) -> None:
        super().__init__(model, comm, stage=3, param_dtype=param_dtype)
        layers = list(model.layers)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        root = [p for p in self.params if id(p) not in in_layers]
        index = {id(p): i for i, p in enumerate(self.params)}
        self.units = [self._make_unit("root", model, root, index)]
        self.units += [self._make_unit(f"layers.{i}", layer, [p for p in layer.parameters() if p.requires_grad],
                                       index) for i, layer in enumerate(layers)]
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._slot_of = {id(p): s for u in self.units for p, s in zip(u.params, u.layout.slots)}
        self.shards = self._shard_params()
        self._in_flight: list[_Unit] = []
        self._build_optimizer(groups, make_optimizer)
        for u in self.units:
            self._free(u)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        for k, u in enumerate(self.units):
            self._hooks.append(u.module.register_forward_pre_hook(lambda m, a, k=k: self._pre_forward(k)))
            self._hooks.append(u.module.register_forward_hook(lambda m, a, out, k=k: self._post_forward(k, out)))

    # ---- construction ------------------------------------------------------------------------
    def _make_unit(self, name: str, module: nn.Module, params: list[nn.Parameter], index: dict[int, int]) -> _Unit:
        (layout,) = plan_buckets([p.numel() for p in params], self.comm.size, cap=2**62)
        ordered = [params[s.index] for s in layout.slots]
        # Slots name parameters by their index in the model's list (what ShardParam.piece refers to).
        layout = BucketLayout(tuple(Slot(index[id(params[s.index])], s.start, s.numel) for s in layout.slots),
                              layout.size, layout.dp)
        dev = params[0].device
        init = torch.zeros(layout.size, dtype=torch.float32, device=dev)
        full = torch.zeros(layout.size, dtype=self.param_dtype, device=dev)
        for p, s in zip(ordered, layout.slots):
            init[s.start:s.end].copy_(p.detach().reshape(-1))
            full[s.start:s.end].copy_(p.detach().reshape(-1))
            p.data = full[s.start:s.end].view_as(p)
        lo, hi = layout.shard_range(self.comm.rank)
        return _Unit(name, module, ordered, layout, full, full[lo:hi].clone(),
                     torch.zeros(layout.shard_size, dtype=torch.float32, device=dev), init[lo:hi].clone())

    def _shard_params(self) -> list[ShardParam]:
        out = []
        for k, u in enumerate(self.units):
            for piece in u.layout.pieces(self.comm.rank):
                at = slice(piece.shard_offset, piece.shard_offset + piece.numel)
                assert u.init is not None
                master = u.shard[at] if self.param_dtype == torch.float32 else u.init[at].clone()
                master.grad = u.grad_shard[at]
                out.append(ShardParam(self.names[piece.index], self.params[piece.index], piece, k, master))
            u.init = None  # only needed to start the masters (a view would keep the storage)
        return out

    # ---- gather / free -------------------------------------------------------------------------
    def _gather(self, u: _Unit, async_op: bool = False) -> None:
        if u.gathered or u.gathering is not None:
            if not async_op:
                self._wait_gather(u)
            return
        u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
        u.gathering = self.comm.all_gather_into(u.full, u.shard, async_op=True)
        if u.gathering is None:
            u.gathered = True
        elif not async_op:
            self._wait_gather(u)

    def _wait_gather(self, u: _Unit) -> None:
        if u.gathering is not None:
            u.gathering.wait()
            u.gathering = None
        u.gathered = True

    def _free(self, u: _Unit) -> None:
        if u.gathering is not None:
            self._wait_gather(u)
        u.full.untyped_storage().resize_(0)
        u.gathered = False

    # ---- hooks ---------------------------------------------------------------------------------
    def _pre_forward(self, k: int) -> None:
        u = self.units[k]
        self._gather(u)
        # The next layer's parameters arrive while this one computes; not when this forward is the
        # recompute inside this unit's backward (the next layer's backward is already done).
        if k + 1 < len(self.units) and not u.backward_pending:
            self._gather(self.units[k + 1], async_op=True)

    def _post_forward(self, k: int, out: object) -> None:
        u = self.units[k]
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, k=k: self._pre_backward(k, g))
        if not u.backward_pending:
            self._free(u)

    def _pre_backward(self, k: int, grad: torch.Tensor) -> torch.Tensor:
        u = self.units[k]
        u.backward_pending = True
        self._gather(u)
        if k > 1:  # layer k-1 is next in backward (the root, unit 0, is gathered by its own hook)
            self._gather(self.units[k - 1], async_op=True)
        return grad

    def grad_ready(self, p: torch.Tensor) -> None:
        self._on_grad(p)

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:
            return
        u = self._unit_of[id(p)]
        if u.grad_buf is None:
            u.grad_buf = torch.zeros(u.layout.size, dtype=torch.float32, device=u.shard.device)
        slot = self._slot_of[id(p)]
        u.grad_buf[slot.start:slot.end].view_as(p).add_(p.grad)
        p.grad = None
        u.ready.add(id(p))
        if len(u.ready) == len(u.params):
            self._launch(u)

    def _launch(self, u: _Unit) -> None:
        if u.pending is not None:
            self._in_flight.remove(u)
            self._complete(u)
        if u.grad_buf is None:
            u.grad_buf = torch.zeros(u.layout.size, dtype=torch.float32, device=u.shard.device)
        u.grad_buf.div_(self.comm.size)
        out = torch.empty_like(u.grad_shard)
        u.pending = (self.comm.reduce_scatter_into(out, u.grad_buf, async_op=True), u.grad_buf, out)
        u.grad_buf = None
        u.ready.clear()
        u.backward_pending = False
        self._free(u)
        self._in_flight.append(u)
        while len(self._in_flight) > 2:
            self._complete(self._in_flight.pop(0))

    def _complete(self, u: _Unit) -> None:
        assert u.pending is not None
        work, _, out = u.pending
        if work is not None:
            work.wait()
        u.grad_shard.add_(out)
        u.pending = None

    # ---- the DistributedOptimizer calls -------------------------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # stage 3 reduces every micro-batch: nothing to hold back

    def start(self) -> None:
        for u in self.units:
            if u.grad_buf is not None and u.pending is None:
                self._launch(u)

    def finish(self) -> None:
        self.start()
        while self._in_flight:
            self._complete(self._in_flight.pop(0))
        for u in self.units:  # nothing stays gathered: the next step's forward must see updated weights
            u.backward_pending = False
            if u.gathered or u.gathering is not None:
                self._free(u)

    def zero_grad(self) -> None:
        for u in self.units:
            assert u.pending is None, "zero_grad() with a reduction in flight: call finish() first"
            u.grad_shard.zero_()
            u.grad_buf = None
            u.ready.clear()

    def main_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        raise AssertionError("ZeRO-3 keeps no full gradients; validate() rejects it with pipelines")

    def grad_shard_buffers(self) -> list[torch.Tensor]:
        return [u.grad_shard for u in self.units]

    def _write_back(self) -> None:
        """Masters -> the 16-bit parameter shards (gathered by the next forward)."""
        if self.param_dtype == torch.float32:
            return
        for s in self.shards:
            u = self.units[s.bucket]
            u.shard[s.piece.shard_offset:s.piece.shard_offset + s.piece.numel].copy_(s.master)

    def step(self) -> None:
        self.optimizer.step()
        self.steps_taken += 1
        self._write_back()

    def weight_buffers(self) -> list[torch.Tensor]:
        return [u.shard for u in self.units]
