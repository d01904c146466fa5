"""The step check, and steps whose check overlaps the next step (``train.overlap_validation``).

Every step ends in one collective over all ranks, the *step check*: the squared gradient norm, the
loss and whether a rank was sent SIGTERM, summed in one all-reduce (``StepCheck``); no other
collective separates two steps, so that under overlap a rank whose part of a step ends early (the
first stage of ZB-H2) starts the next one while the last stage still finishes this one.
Synchronously, every rank waits for it before it updates (or, under ``train.post_validation``, right
after its speculative update: optim/speculate.py).

Under ``train.overlap_validation`` nobody waits: a rank takes its speculative step, writes and gathers
the parameters, launches the check and starts the next step's forward/backward at once, so one step's
tail (the last stage's backward, the reductions) overlaps the next step's head, as Qi et al.'s
post-validation does across iterations (section 4). The check is collected after that forward/backward
and the data-parallel reductions. When it says the step needed clipping or must be skipped, the
speculative step is undone and redone (engine.settle), and the step that ran on its parameters runs
again on the same samples with the same dropout streams: the weights are bit for bit the synchronous
run's. A step that must be seen settled (the last, one before a validation, a checkpoint or in the
pipeline trace window) is collected at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mpformer.optim.speculate import Speculation
from mpformer.parallel.comm import Comm, TimedWork

if TYPE_CHECKING:
    from mpformer.optim.engine import GradEngine
    from mpformer.training.trainer import Trainer


@dataclass
class Check:
    """One step's check in flight: [its rank's squared-norm share, its loss share, SIGTERM seen (0/1)],
    summed over ranks."""

    values: torch.Tensor
    work: TimedWork | None


class StepCheck:
    """The step's one collective over every rank (``comm``; None: a single rank). Each rank adds its
    share of the squared gradient norm (engine.norm_square) and of the mean loss: the loss is counted
    by the first tp rank of each (dp, cp, pp) position, the stages without a loss adding 0, and the
    sum is divided by ``dp``; the same value, and so the same decision, on every rank."""

    def __init__(self, comm: Comm | None, tp_rank: int, dp: int, micro_steps: int) -> None:
        self.comm, self.tp_rank, self.dp, self.micro_steps = comm, tp_rank, dp, micro_steps

    def launch(self, engine: GradEngine, loss_sum: float, *, stop: bool = False, async_op: bool = False) -> Check:
        """``stop``: this rank was asked to stop (SIGTERM); every rank learns it from ``stopping``."""
        norm = engine.norm_square(world=True)
        loss = torch.tensor(loss_sum / self.micro_steps if self.tp_rank == 0 else 0.0, device=norm.device)
        values = torch.stack([norm, loss, torch.tensor(float(stop), device=norm.device)])
        work = self.comm.all_reduce(values, async_op=async_op) if self.comm is not None else None
        return Check(values, work if async_op else None)

    def result(self, check: Check, engine: GradEngine, max_norm: float,
               speculation: Speculation | None = None) -> tuple[float, float]:
        """(global grad norm, global mean loss); the engine takes the norm (clipping, or its decision)."""
        if check.work is not None:
            check.work.wait()
        grad_norm = engine.take_norm(check.values[0].sqrt(), max_norm, speculation=speculation)
        return grad_norm, float(check.values[1] / self.dp)

    @staticmethod
    def stopping(check: Check) -> bool:
        """Whether any rank was asked to stop before it launched ``check`` (after ``result``)."""
        return bool(check.values[2] > 0)


def check_comm(overlap: bool, ledger) -> Comm | None:
    """The check's group: the whole world; under overlap a copy of it (collective, every rank), so the
    check in flight shares no queue with the collectives the trainer issues meanwhile."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return Comm(dist.new_group() if overlap else dist.group.WORLD, ledger, tag="check.")


@dataclass
class Pending:
    """A speculative step whose check is in flight."""

    step: int  # its number (1-based)
    start: int  # its first sample
    lr: float
    speculation: Speculation
    check: Check
    seconds: float = 0.0  # the wall time of the call that ran it


Settled = tuple[int, "dict | None", float]  # (step, its metrics or None when it rolled back, seconds)


class OverlappedSteps:
    """The trainer's steps under ``train.overlap_validation``: ``step`` runs the next step and settles
    the one before; ``drain`` settles what is left."""

    def __init__(self, trainer: Trainer) -> None:
        self.tr = trainer
        self.pending: Pending | None = None

    def step(self, settle_now: bool, lap: Callable[[], float]) -> list[Settled]:
        """Step ``progress.step + 1`` speculatively (settled too if ``settle_now``); returns the steps
        settled in this call, in order. ``lap``: the step timer's."""
        tr, t = self.tr, self.tr.cfg.train
        batches = tr._micro_batches()
        rng = tr.rng.state()  # a redo draws the same dropout masks
        loss_sum = self._forward_backward(batches)
        out: list[Settled] = []
        if self.pending is not None:
            settled, changed = self._settle()
            out.append(settled)
            if settled[1] is None:  # rolled back: the checkpoint's weights, step and data position
                return out
            if changed:  # this step ran on parameters the check undid: again, on the settled ones
                tr.rng.load(rng)
                loss_sum = self._forward_backward(batches)
        lr = tr.schedule.apply(tr.engine.optimizer, tr.progress.step)
        spec = tr.engine.speculate(publish=True)
        assert spec is not None, "overlap_validation runs no fp16 (config.py)"
        check = tr.check.launch(tr.engine, loss_sum, stop=tr.preemption.requested, async_op=True)
        self.pending = Pending(tr.progress.step + 1, tr.progress.consumed_samples, lr, spec, check)
        tr.progress.advance(t.global_batch_size)  # the next step reads the samples after this one's
        if settle_now:  # no step ran on its parameters yet: nothing to run again
            step, metrics, _ = self._settle()[0]
            out.append((step, metrics, lap()))
        else:
            self.pending.seconds = lap()
        return out

    def drain(self) -> list[Settled]:
        """The step still in flight, settled (before a checkpoint or the end)."""
        return [self._settle()[0]] if self.pending is not None else []

    def _forward_backward(self, batches: list) -> float:
        tr = self.tr
        tr.engine.zero_grad()
        loss_sum = tr._forward_backward(batches)
        tr.engine.finish()  # reductions done: the check's wait comes after the step's own traffic
        return loss_sum

    def _settle(self) -> tuple[Settled, bool]:
        """The pending step's check collected and acted on; True when its parameters changed."""
        p, self.pending = self.pending, None
        tr = self.tr
        grad_norm, loss = tr.check.result(p.check, tr.engine, tr.cfg.optim.clip_grad, speculation=p.speculation)
        tr.stop_agreed = tr.check.stopping(p.check)
        bad, rolled_back = tr._verdict(p.step, p.start, loss, grad_norm)
        if rolled_back:
            return (p.step, None, p.seconds), True
        changed = tr.engine.settle(p.speculation, skip=bad)
        return (p.step, tr._step_metrics(p.start, loss, grad_norm, p.lr, bad, {}), p.seconds), changed
