"""One optimizer step: micro-batches -> gradients -> the step check -> verdict -> update.

    zero_grad -> forward/backward -> finish -> check -> (clip) -> step

Each data-parallel rank runs its share of the global batch as micro-batches (through the pipeline
engine when pp > 1), accumulating gradients until the last, whose backward overlaps the bucketed
reduction; the gradient engine (optim/engine.py) owns everything between backward and the update.
The reported loss is the mean over the whole global batch, identical for every dp size.

``Stepper`` is handed the parts it runs and nothing that built it; a rollback (train.on_nan=rollback)
is a ``Rollback``, which reloads the newest checkpoint through the run's checkpoint. Under
``train.overlap_validation`` the same pieces are driven by OverlappedSteps (overlap.py) through the
methods it names in its ``StepOps``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mpformer.core.config import OptimConfig, TrainConfig
from mpformer.core.errors import RunHalted
from mpformer.data.loader import MicroBatch, StepLoader
from mpformer.optim.engine import GradEngine
from mpformer.optim.loss_scale import LossScaler
from mpformer.optim.lr import LRSchedule
from mpformer.optim.speculate import Speculation
from mpformer.parallel.device import Device
from mpformer.pipeline.engine import PipelineEngine
from mpformer.training.fp8_steps import DelayedSteps
from mpformer.training.guard import MAX_ROLLBACKS, SPIKE_WINDOW, Preemption, bad_step, finite, halt_message
from mpformer.training.overlap import Check, StepCheck
from mpformer.training.progress import Progress
from mpformer.training.router_report import RouterReport
from mpformer.training.run_checkpoint import RunCheckpoint


@dataclass(frozen=True)
class Precision:
    """The run's dtype: 16-bit precisions keep the parameters in that dtype with fp32 masters and main
    gradients (optim/engine.py); autocast on top keeps its per-op policy (fp32 softmax, CPU linear
    path); fp16 scales the loss (``scaler``)."""

    dtype: torch.dtype
    device: Device
    scaler: LossScaler | None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return self.device.autocast(self.dtype)


class Rollback:
    """train.on_nan=rollback: back to the newest checkpoint in save_dir, the bad step's samples added
    to the skip ranges; at most MAX_ROLLBACKS in a process, then halt."""

    def __init__(self, checkpoint: RunCheckpoint, engine: GradEngine, progress: Progress,
                 message: Callable[[str], None]) -> None:
        self.checkpoint, self.engine, self.progress, self.message = checkpoint, engine, progress, message
        self.count = 0

    def __call__(self, step: int, start: int, end: int, loss: float, grad_norm: float, why: str) -> None:
        manifest, passed = self.checkpoint.newest()
        if manifest is None or self.count >= MAX_ROLLBACKS:
            stop = (f"train.on_nan=rollback found no checkpoint in {self.checkpoint.save_dir}" if manifest is None
                    else f"{MAX_ROLLBACKS} rollbacks in this run already")
            raise RunHalted(halt_message(step, loss, grad_norm, start, end, f"{why} ({stop})"))
        for line in passed:
            self.message(f"warning: rollback passes over {line}")
        self.engine.zero_grad()
        self.checkpoint.roll_back_to(manifest)
        self.count += 1
        self.progress.rollbacks += 1
        self.progress.add_skip(start, end)
        self.message(f"step {step}: loss {loss} / grad norm {grad_norm}: {why}; rolled back to "
                     f"{manifest.path.name}, samples [{start}, {end}) will be skipped")


class Stepper:
    """The step's work on the parts it is given; ``stop_agreed``: some rank was sent SIGTERM before the
    last settled step's check (the trainer ends the run after that step)."""

    def __init__(self, model: nn.Module, engine: GradEngine, pipeline: PipelineEngine | None, precision: Precision,
                 loader: StepLoader, progress: Progress, check: StepCheck, schedule: LRSchedule,
                 preemption: Preemption, rollback: Rollback, train: TrainConfig, optim: OptimConfig,
                 micro_steps: int, router: RouterReport | None = None,
                 fp8: DelayedSteps | None = None) -> None:
        self.model, self.engine, self.pipeline, self.precision = model, engine, pipeline, precision
        self.loader, self.progress, self.check, self.schedule = loader, progress, check, schedule
        self.preemption, self.rollback, self.train, self.optim = preemption, rollback, train, optim
        self.micro_steps = micro_steps
        self.router = router  # an MoE model's routers (router_report.py)
        self.fp8 = fp8  # fp8 delayed scaling: histories agreed over dp, a step's records undone (fp8_steps.py)
        self.stop_agreed = False

    def micro_batches(self) -> list[tuple]:
        """This step's (inputs, labels[, document starts]) per micro-batch, on the device (past any skip
        range); the document starts, under document masks, as the loader found them on the host."""
        out = []
        for b in self.loader.take(self.progress.position()):
            if isinstance(b, MicroBatch):
                out.append((b.tokens[:, :-1], b.tokens[:, 1:], b.doc_starts))
            else:
                out.append((b[:, :-1], b[:, 1:]))
        return out

    def forward_backward(self, batches: list[tuple]) -> torch.Tensor:
        """Every micro-batch's forward and backward, gradients accumulated over them; the last one's
        backward overlaps the reductions (a pipeline's: after each stage's last backward). Returns the
        summed loss of this rank's micro-batches, on the device (read once, in the step's check)."""
        scaler = self.precision.scaler
        scale = scaler.scale if scaler is not None else 1.0
        if self.router is not None:  # the router losses' gradients carry each micro-batch loss's factor
            self.router.set_loss_scale(self.model, scale / self.micro_steps)
        if self.pipeline is not None:
            with self.engine.no_sync():
                return self.pipeline.run(batches, loss_scale=scale).sum()
        loss_sum = torch.zeros((), device=self.engine.device)
        for j, (inputs, labels, *docs) in enumerate(batches):
            with self.engine.no_sync() if j < len(batches) - 1 else contextlib.nullcontext(), \
                    torch.profiler.record_function(f"micro-batch {j}"):
                with self.precision.autocast():
                    loss = self.model(inputs, labels, *docs)
                (loss / self.micro_steps if scale == 1.0 else loss * (scale / self.micro_steps)).backward()
            loss_sum += loss.detach().float()
        return loss_sum

    def gradients(self, batches: list[tuple]) -> torch.Tensor:
        """zero_grad -> forward/backward -> finish (reductions over dp, a tied copy, tp partial sums, fp16
        unscaling); the summed loss of this rank's micro-batches (on the device)."""
        self.engine.zero_grad()
        if self.router is not None:
            self.router.begin(self.progress.step + 1)
        if self.fp8 is not None:
            self.fp8.begin(self.progress.step + 1)
        loss_sum = self.forward_backward(batches)
        self.engine.finish()
        if self.fp8 is not None:
            self.fp8.sync()
        if self.router is not None:
            self.router.gather(self.progress.step + 1)
        return loss_sum

    def apply_lr(self) -> float:
        """The learning rate of step ``progress.step + 1``, set on the optimizer."""
        return self.schedule.apply(self.engine.optimizer, self.progress.step)

    def launch_check(self, loss_sum: torch.Tensor, async_op: bool = False) -> Check:
        return self.check.launch(self.engine, loss_sum, stop=self.preemption.requested, async_op=async_op)

    def check_result(self, check: Check, speculation: Speculation | None) -> tuple[float, float]:
        """(global grad norm, global mean loss) of ``check``; whether a rank asked to stop, noted."""
        out = self.check.result(check, self.engine, self.optim.clip_grad, speculation=speculation)
        self.stop_agreed = self.check.stopping(check)
        return out

    def step(self) -> dict[str, float] | None:
        """One synchronous step. None: the step was rolled back (train.on_nan=rollback; guard.py)."""
        extra = {"loss_scale": self.precision.scaler.scale} if self.precision.scaler is not None else {}
        start = self.progress.consumed_samples  # this step's samples: [start, start + global batch)
        loss_sum = self.gradients(self.micro_batches())
        spec = None
        if self.train.post_validation:  # step now, validate after the check's collective (optim/speculate.py)
            self.apply_lr()
            spec = self.engine.speculate()
        # The norm and the loss, the same on every rank: one decision everywhere.
        grad_norm, loss = self.check_result(self.launch_check(loss_sum), spec)
        if self.router is not None:  # its sums' all-reduce came before the check's: the device has them
            self.router.read()
        bad, rolled_back = self.verdict(self.progress.step + 1, start, loss, grad_norm)
        if rolled_back:
            return None
        lr = self.apply_lr()
        if bad:  # on_nan=skip: the weights and optimizer state stay as they were
            self.engine.undo(spec)
        else:
            self.engine.step(spec)  # not on a skipped fp16 step
        self.progress.advance(self.train.global_batch_size)
        return self.metrics(start, loss, grad_norm, lr, bad, extra)

    def verdict(self, step: int, start: int, loss: float, grad_norm: float) -> tuple[bool, bool]:
        """(bad, rolled back) for step ``step`` (samples from ``start``): a bad step halts the run, rolls
        it back to the newest checkpoint, or is to be skipped, as train.on_nan says (guard.py)."""
        t, p = self.train, self.progress
        why = None if self.engine.skipped else bad_step(loss, grad_norm, p.recent_grad_norms, t.spike_factor)
        bad = why is not None
        if bad and t.on_nan == "halt":
            raise RunHalted(halt_message(step, loss, grad_norm, start, start + t.global_batch_size,
                                         f"{why} (train.on_nan=halt)"))
        if bad and t.on_nan == "rollback":
            self.rollback(step, start, start + t.global_batch_size, loss, grad_norm, why)
            if self.router is not None:
                self.router.forget()
            if self.fp8 is not None:
                self.fp8.forget()
            return True, True
        if not bad and not self.engine.skipped and finite(loss, grad_norm):
            p.recent_grad_norms = [*p.recent_grad_norms, grad_norm][-SPIKE_WINDOW:]
        if bad:
            p.skipped_steps += 1
            if self.router is not None:  # a skipped step's bias moves are undone with its update
                self.router.undo(step)
            if self.fp8 is not None:  # and its amax records
                self.fp8.undo(step)
        return bad, False

    def metrics(self, start: int, loss: float, grad_norm: float, lr: float, bad: bool,
                extra: dict) -> dict[str, float]:
        """The step's entry of metrics.jsonl, before its time and traffic (the trainer adds those)."""
        if self.precision.scaler is not None:
            extra["skipped_steps"] = self.precision.scaler.skipped
        elif self.train.on_nan == "skip":
            extra["skipped_steps"] = self.progress.skipped_steps
        if self.progress.rollbacks:
            extra["rollbacks"] = self.progress.rollbacks
        if self.router is not None:
            extra.update(self.router.metrics())
        clip = self.optim.clip_grad
        clipped = grad_norm * min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else grad_norm
        return {"loss": loss, "grad_norm": grad_norm, "grad_norm_clipped": clipped, "lr": lr,
                "consumed_samples": start + self.train.global_batch_size, **({"skipped": 1} if bad else {}),
                **extra}
