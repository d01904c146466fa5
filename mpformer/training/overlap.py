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
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from mpformer.optim.speculate import Speculation
from mpformer.parallel.comm import Comm, TimedWork
from mpformer.parallel.host_syncs import REPORT_BOUNDARY
from mpformer.training.progress import Progress


class NormSource(Protocol):
    """What the step check reads of the gradient engine (optim/stepping.py)."""

    def norm_square(self, *, world: bool = False) -> torch.Tensor: ...

    def take_norm(self, norm: torch.Tensor, max_norm: float, value: float, *,
                  speculation: Speculation | None = None) -> float: ...


@dataclass
class Check:
    """One step's check in flight: [its rank's squared-norm share, its loss share, SIGTERM seen (0/1)],
    summed over ranks."""

    values: torch.Tensor
    work: TimedWork | None
    host: list[float] | None = None  # the values on the host, read once (``StepCheck.result``)


class StepCheck:
    """The step's one collective over every rank (``comm``; None: a single rank). Each rank adds its
    share of the squared gradient norm (engine.norm_square) and of the mean loss: the loss is counted
    by the first tp rank of each (dp, cp, pp) position, the stages without a loss adding 0, and the
    sum is divided by ``dp``; the same value, and so the same decision, on every rank."""

    def __init__(self, comm: Comm | None, tp_rank: int, dp: int, micro_steps: int) -> None:
        self.comm, self.tp_rank, self.dp, self.micro_steps = comm, tp_rank, dp, micro_steps

    def launch(self, engine: NormSource, loss_sum: torch.Tensor, *, stop: bool = False,
               async_op: bool = False) -> Check:
        """``loss_sum``: this rank's micro-batches' summed loss, on the device. ``stop``: this rank was
        asked to stop (SIGTERM); every rank learns it from ``stopping``."""
        norm = engine.norm_square(world=True)
        loss = loss_sum.float() / self.micro_steps if self.tp_rank == 0 else torch.zeros((), device=norm.device)
        values = torch.stack([norm, loss.to(norm.device), torch.tensor(float(stop), device=norm.device)])
        work = self.comm.all_reduce(values, async_op=async_op) if self.comm is not None else None
        return Check(values, work if async_op else None)

    def result(self, check: Check, engine: NormSource, max_norm: float,
               speculation: Speculation | None = None) -> tuple[float, float]:
        """(global grad norm, global mean loss); the engine takes the norm (clipping, or its decision)."""
        if check.work is not None:
            check.work.wait()
        with torch.profiler.record_function(REPORT_BOUNDARY):
            check.host = check.values.tolist()  # the step's one host read: norm², loss, stop (fp32 values)
        norm2, loss, _ = (np.float32(x) for x in check.host)
        grad_norm = engine.take_norm(check.values[0].sqrt(), max_norm, float(np.sqrt(norm2)), speculation=speculation)
        return grad_norm, float(loss / np.float32(self.dp))  # fp32 arithmetic, as on the device

    @staticmethod
    def stopping(check: Check) -> bool:
        """Whether any rank was asked to stop before it launched ``check`` (after ``result``)."""
        assert check.host is not None, "stopping() reads what result() read"
        return check.host[2] > 0


def check_comm(overlap: bool, ledger) -> Comm | None:
    """The check's group: the whole world; under overlap a copy of it (collective, every rank), so the
    check in flight shares no queue with the collectives the trainer issues meanwhile."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return Comm(dist.new_group() if overlap else dist.group.WORLD, ledger, tag="check.")


@dataclass
class PendingStep:
    """A speculative step whose check is in flight."""

    step: int  # its number (1-based)
    start: int  # its first sample
    lr: float
    speculation: Speculation
    check: Check
    seconds: float = 0.0  # the wall time of the call that ran it


Settled = tuple[int, "dict | None", float]  # (step, its metrics or None when it rolled back, seconds)


class StepOps(Protocol):
    """The step's pieces OverlappedSteps drives (training/step.py's Stepper)."""

    def micro_batches(self) -> list[tuple]: ...

    def gradients(self, batches: list[tuple]) -> torch.Tensor: ...

    def apply_lr(self) -> float: ...

    def launch_check(self, loss_sum: torch.Tensor, async_op: bool = False) -> Check: ...

    def check_result(self, check: Check, speculation: Speculation | None) -> tuple[float, float]: ...

    def verdict(self, step: int, start: int, loss: float, grad_norm: float) -> tuple[bool, bool]: ...

    def metrics(self, start: int, loss: float, grad_norm: float, lr: float, bad: bool,
                extra: dict) -> dict[str, float]: ...


class Speculator(Protocol):
    """The gradient engine's speculative step (optim/stepping.py)."""

    def speculate(self, *, publish: bool = False) -> Speculation | None: ...

    def settle(self, speculation: Speculation, *, skip: bool) -> bool: ...


class Streams(Protocol):
    """The dropout streams (parallel/random.py): a redo draws the same masks."""

    def state(self) -> dict: ...

    def load(self, saved: dict) -> None: ...


class OverlappedSteps:
    """The steps under ``train.overlap_validation``: ``step`` runs the next step and settles the one
    before; ``drain`` settles what is left. It changes ``progress`` (a step's samples consumed) and,
    through ``engine``, the parameters; it reads the rest through ``ops``."""

    def __init__(self, ops: StepOps, engine: Speculator, rng: Streams, progress: Progress,
                 global_batch_size: int) -> None:
        self.ops, self.engine, self.rng, self.progress = ops, engine, rng, progress
        self.global_batch_size = global_batch_size
        self.pending: PendingStep | None = None

    def step(self, settle_now: bool, lap: Callable[[], float]) -> list[Settled]:
        """Step ``progress.step + 1`` speculatively (settled too if ``settle_now``); returns the steps
        settled in this call, in order. ``lap``: the step timer's."""
        ops, progress = self.ops, self.progress
        batches = ops.micro_batches()
        rng = self.rng.state()  # a redo draws the same dropout masks
        loss_sum = ops.gradients(batches)  # reductions done: the check's wait comes after the step's own traffic
        out: list[Settled] = []
        if self.pending is not None:
            settled, changed = self._settle()
            out.append(settled)
            if settled[1] is None:  # rolled back: the checkpoint's weights, step and data position
                return out
            if changed:  # this step ran on parameters the check undid: again, on the settled ones
                self.rng.load(rng)
                loss_sum = ops.gradients(batches)
        lr = ops.apply_lr()
        spec = self.engine.speculate(publish=True)
        assert spec is not None, "overlap_validation runs no fp16 (config.py)"
        check = ops.launch_check(loss_sum, async_op=True)
        self.pending = PendingStep(progress.step + 1, progress.consumed_samples, lr, spec, check)
        progress.advance(self.global_batch_size)  # the next step reads the samples after this one's
        if settle_now:  # no step ran on its parameters yet: nothing to run again
            step, metrics, _ = self._settle()[0]
            out.append((step, metrics, lap()))
        else:
            self.pending.seconds = lap()
        return out

    def drain(self) -> list[Settled]:
        """The step still in flight, settled (before a checkpoint or the end)."""
        return [self._settle()[0]] if self.pending is not None else []

    def _settle(self) -> tuple[Settled, bool]:
        """The pending step's check collected and acted on; True when its parameters changed."""
        p, self.pending = self.pending, None
        grad_norm, loss = self.ops.check_result(p.check, p.speculation)
        bad, rolled_back = self.ops.verdict(p.step, p.start, loss, grad_norm)
        if rolled_back:
            return (p.step, None, p.seconds), True
        changed = self.engine.settle(p.speculation, skip=bad)
        return (p.step, self.ops.metrics(p.start, loss, grad_norm, p.lr, bad, {}), p.seconds), changed
