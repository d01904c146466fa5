"""The gradient engine's end of a step: the global norm, clipping, the fp16 inf check, the optimizer step
and its speculative form (optimizer post-validation, speculate.py), and the parameters written back
and gathered.

Owned by ``GradEngine`` (engine.py), which builds it from exactly what the step reads (the buckets'
gradient shards and masters, this rank's shards, the optimizer, the norm's groups and specs, the
parameters' gather) and delegates to it; it changes the gradient shards, the optimizer's state and the
parameters, and keeps the step's own flags (skipped, the clip coefficient, the optimizer steps taken).
Kept apart because the step's order is what post-validation changes, and it reads best in one place:

    synchronous            clip (norm over dp, tp, pp; scale) -> step -> publish
    post-validation        speculate (step on unclipped) -> clip -> step(speculation): kept, or
                           restored and redone clipped
    overlap_validation     speculate(publish=True) -> the next step's forward/backward -> take_norm
                           (the trainer's one all-reduce) -> settle: kept, or restored, redone or
                           skipped, published again
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from mpformer.optim.bucket import ShardParam, shard_grads
from mpformer.optim.speculate import Speculation
from mpformer.parallel.comm import Comm
from mpformer.parallel.host_syncs import REPORT_BOUNDARY
from mpformer.parallel.tensor_parallel import GradSpec

if TYPE_CHECKING:
    from mpformer.optim.bucket import Bucket
    from mpformer.optim.loss_scale import LossScaler
    from mpformer.optim.param_gather import ParamGather


class ShardStep:
    """The step over the engine's buckets and shards. ``view_comms``: each gradient view's group (past
    stage 0 a view's shards differ over it, so its part of the norm and of the fp16 overflow flag is
    reduced there first; at stage 0 its replicas hold the same gradients, so only its rank 0 counts
    them in a world-wide sum); ``norm_comms``: the groups the whole norm is reduced over next, in
    order (tp, pp; one of size 1 is skipped); ``view_across``: for a view whose parameters differ over
    other ranks too (experts over the ep ranks), those ranks, summed over at every stage (a world-wide
    sum needs nothing more: each ep rank's stage-0 replica rank 0 counts its own experts)."""

    def __init__(self, *, buckets: Sequence[Bucket], shards: Sequence[ShardParam], optimizer: torch.optim.Optimizer,
                 stage: int, view_comms: Mapping[str, Comm], norm_comms: Sequence[Comm],
                 norm_specs: Sequence[GradSpec], param_gather: ParamGather | None,
                 view_across: Mapping[str, Comm] | None = None) -> None:
        self.buckets, self.shards, self.optimizer = buckets, shards, optimizer
        self.view_across = dict(view_across or {})
        self.stage, self.view_comms, self.norm_comms, self.norm_specs = stage, view_comms, norm_comms, norm_specs
        self.param_gather = param_gather
        self.skipped, self.steps_taken = False, 0
        self._coeff: torch.Tensor | None = None
        self._clipped = False

    def begin(self, scaler: LossScaler | None) -> None:
        """A step's gradients are final: nothing clipped yet; fp16's loss scale divided out, an inf or
        nan anywhere skipping the step."""
        self.skipped, self._coeff, self._clipped = False, None, False
        if scaler is not None:
            self.skipped = scaler.update(self._unscale(1.0 / scaler.scale))

    def _world_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        for comm in self.norm_comms:
            if comm.size > 1:
                comm.all_reduce(t, op=op)

    def _view_reduce(self, t: torch.Tensor, view: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        comm = self.view_comms[view]
        if self.stage > 0 and comm.size > 1:
            comm.all_reduce(t, op=op)
        if view in self.view_across:
            self.view_across[view].all_reduce(t, op=op)

    def _view_sums(self, world: bool) -> dict[str, torch.Tensor]:
        """Each view's part of the squared norm on this rank (``world``: stage 0's replicas count once)."""
        sums = {v: torch.zeros((), device=self.buckets[0].grad_shard.device) for v in self.view_comms}
        for g, spec in shard_grads(self.shards, self.norm_specs):
            if world and self.stage == 0 and self.view_comms[spec.reduce_over].rank != 0:
                continue
            sums[spec.reduce_over] += torch.linalg.vector_norm(g, dtype=torch.float32).square() / spec.replicas
        return sums

    def norm_square(self, *, world: bool = False) -> torch.Tensor:
        """This rank's share of the squared global gradient norm. ``world``: for one sum over every rank
        (the trainer's step check), where the replicas of stage 0, holding the same gradients, count
        once; otherwise each view's part reduced over its group, for ``_world_reduce``'s groups."""
        total = torch.zeros((), device=self.buckets[0].grad_shard.device)
        for view, part in self._view_sums(world).items():
            if not world:
                self._view_reduce(part, view)
            total += part
        return total

    def clip(self, max_norm: float, *, speculation: Speculation | None = None) -> float:
        """The global gradient norm before clipping (nan on a skipped step); scales the gradient shards
        when it exceeds ``max_norm`` (0: no clipping). After a speculative step (``speculate``) the
        scaling waits for ``step(speculation)``, which redoes the step when it is needed."""
        if self.skipped:
            return float("nan")
        total = self.norm_square()
        self._world_reduce(total)
        norm = total.sqrt()
        return self.take_norm(norm, max_norm, float(norm), speculation=speculation)

    def take_norm(self, norm: torch.Tensor, max_norm: float, value: float, *,
                  speculation: Speculation | None = None) -> float:
        """``clip`` given the global norm, reduced elsewhere (the trainer's one collective per step):
        ``norm`` on the device, ``value`` its host copy (read once with the step's other values). The
        gradients are scaled on the device; whether they were is decided on the host from ``value``, in
        the device's fp32 arithmetic, so the two agree and no second read is needed."""
        if self.skipped:
            return float("nan")
        self._coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else None
        self._clipped = max_norm > 0 and bool(np.float32(max_norm) / (np.float32(value) + np.float32(1e-6)) < 1)
        if self._coeff is not None and speculation is None:
            torch._foreach_mul_([b.grad_shard for b in self.buckets], self._coeff)
        return value

    def speculate(self, *, publish: bool = False) -> Speculation | None:
        """Optimizer post-validation (speculate.py): the step taken now, on unclipped gradients, the
        state it changes saved first; None on a skipped fp16 step (nothing to take). ``publish``: the
        parameters written and gathered at once, for the next step to run on before the check
        (train.overlap_validation); the gradients are kept too, to redo the step clipped after the next
        step's reductions have overwritten them; ``settle`` ends it."""
        if self.skipped:
            return None
        spec = Speculation.take(self.optimizer, grads=[b.grad_shard for b in self.buckets] if publish else None)
        self.optimizer.step()
        if publish:
            self.steps_taken += 1
            self._publish()
        return spec

    def settle(self, speculation: Speculation, *, skip: bool) -> bool:
        """A published speculative step after its check (``take_norm``): kept, or undone and, unless
        ``skip``, redone on its clipped gradients, its parameters written and gathered again. True when
        the parameters changed: what ran on them since must run again."""
        if not skip and not self._clipped:
            return False
        self.wait_params()  # the speculative gather must not land on the restored parameters
        speculation.restore(self.optimizer)
        if skip:
            self.steps_taken -= 1
        else:
            for b, g in zip(self.buckets, speculation.grads):
                b.grad_shard.copy_(g)
            torch._foreach_mul_([b.grad_shard for b in self.buckets], self._coeff)
            self.optimizer.step()
        self._publish()
        return True

    def undo(self, speculation: Speculation | None) -> None:
        """A speculative step that should not have happened (a bad step skipped): state as before."""
        if speculation is not None:
            speculation.restore(self.optimizer)

    def _unscale(self, inv_scale: float) -> bool:
        """Divide the gradient shards by the loss scale; True if any rank found an inf or nan (fp16's
        overflow flag: read on the host here, the step's reporting boundary's other value)."""
        found = torch.zeros((), device=self.buckets[0].grad_shard.device)
        for b in self.buckets:
            b.grad_shard.mul_(inv_scale)
            found = torch.maximum(found, (~torch.isfinite(b.grad_shard)).any().float())
        for view in self.view_comms:
            self._view_reduce(found, view, op=dist.ReduceOp.MAX)
        self._world_reduce(found, op=dist.ReduceOp.MAX)
        with torch.profiler.record_function(REPORT_BOUNDARY):
            return bool(found)

    def write_back(self) -> None:
        """16-bit parameters: the masters cast into this rank's part of them."""
        for s in self.shards:
            b = self.buckets[s.bucket]
            if b.masters is not None and b.param_shard is not None:  # stage 3 casts the masters when gathering
                b.param_shard[s.piece.shard_offset:s.piece.shard_offset + s.piece.numel].copy_(s.master)

    def step(self, speculation: Speculation | None = None) -> None:
        """The wrapped optimizer on this rank's shard, then (stages 1-2) the parameters all-gathered.
        After a speculative step: kept when ``clip`` found no clipping, else undone and redone on the
        clipped gradients (the synchronous step's arithmetic, in its order)."""
        if self.skipped:
            return
        if speculation is None:
            self.optimizer.step()
        elif self._clipped:
            speculation.restore(self.optimizer)
            torch._foreach_mul_([b.grad_shard for b in self.buckets], self._coeff)
            self.optimizer.step()
        self.steps_taken += 1
        self._publish()

    def _publish(self) -> None:
        """The stepped masters into the 16-bit parameters and (stages 1-2) gathered."""
        self.write_back()
        if self.param_gather is not None:
            self.param_gather.launch()  # each block waits for its own buckets in its next forward

    def wait_params(self) -> None:
        """Every parameter gathered (stages 1-2: what the step's overlapped all-gathers still owe)."""
        if self.param_gather is not None:
            self.param_gather.wait()
