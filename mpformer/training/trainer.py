"""The training loop over the parts build_run (build.py) assembled: steps, logging, validation,
checkpoints, the SIGTERM stop.

    for each step: stepper.step (or OverlappedSteps.step) -> record -> validation / trace /
                   checkpoint as due -> stop here on an agreed SIGTERM

One step's work is step.py's; the trainer decides only when a step must be seen settled (under
train.overlap_validation), what is logged, and when the run saves and ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from mpformer.parallel.kernel_choice import uninstall
from mpformer.training.build import RunParts
from mpformer.training.evaluation import validation_loss
from mpformer.training.guard import agree
from mpformer.training.metrics import StepTimer
from mpformer.training.overlap import Settled
from mpformer.training.reporting import TraceWindow, banner, memory_report
from mpformer.training.startup import StartupStop


class Trainer:
    def __init__(self, parts: RunParts, startup: StartupStop | None = None) -> None:
        """``startup``: the CLI's SIGTERM-at-start-up stop (startup.py), ended once the first step has
        finished, when the step-boundary preemption takes SIGTERM over."""
        self.parts, self.startup = parts, startup
        self.spec, self.groups, self.device = parts.spec, parts.groups, parts.groups.device
        self.cfg, self.layout = parts.spec.cfg, parts.spec.layout
        self.model, self.engine, self.pipeline = parts.model, parts.engine, parts.pipeline
        self.progress, self.metrics, self.stepper = parts.progress, parts.metrics, parts.stepper
        self.ckpt, self.overlap, self.loader = parts.checkpoint, parts.overlap, parts.loader
        self.checkpointer, self.save_dir = self.ckpt.checkpointer, self.ckpt.save_dir
        self.is_logger = self.groups.is_logging_rank
        self._saved_step: int | None = None  # the step of this run's newest checkpoint
        self.on_phase: Callable[[str], None] = lambda phase: None  # the heartbeat's (parallel/watchdog.py)

    def train_step(self) -> dict[str, float] | None:
        """One synchronous step (step.py); None: rolled back."""
        return self.stepper.step()

    def fit(self) -> list[float]:
        """Train until train.steps (or train.stop_at); return the losses of the steps run here."""
        t = self.cfg.train
        end = t.stop_at if t.stop_at is not None else t.steps
        self.metrics.message(banner(self.cfg, self.layout, self.parts.micro_steps, self.device.kind,
                                    self.progress.step, end, self.spec.run_dir, self.parts.kernels.describe()))
        memory_report(self.engine, self.layout, self.model, self.metrics, self.spec.run_dir, self.is_logger)
        if self.layout.offload != "none" and self.device.kind == "cpu":
            self.metrics.message(f"note: parallel.offload={self.layout.offload} on cpu: host memory is the device's, "
                                 "so the copies save nothing here (they run, on a thread)")
        trace = TraceWindow(self.pipeline, t.pipeline_trace_steps, self.progress.step, end, self.groups.pp)
        losses: list[float] = []
        timer = StepTimer()
        self._fit_t0 = time.perf_counter()
        try:
            self._loop(end, trace, timer, losses)
        finally:
            self.parts.preemption.uninstall()
            self._end_startup()
            self.loader.close()
            uninstall()  # the run's kernel choice goes with it (a process may build other models after)
        if (done := self.checkpointer.wait()) is not None:
            self.metrics.message(f"saved checkpoint {done} (in the background)")
        if losses and self._saved_step != self.progress.step:  # the final (stop_at, preempted) checkpoint;
            self.save()  # a run that had nothing left to do writes none
        self.metrics.close()
        return losses

    def _loop(self, end: int, trace: TraceWindow, timer: StepTimer, losses: list[float]) -> None:
        while self.progress.step < end:
            trace.before(self.progress.step)
            self.on_phase(f"step {self.progress.step + 1}")
            settled = self._steps(end, trace, timer)
            if not self.parts.preemption.installed:  # the first step is done: SIGTERM now waits for a boundary
                self._end_startup()
                self.parts.preemption.install()
            for i, (step, m, dt) in enumerate(settled):
                if m is None:  # rolled back: the steps since the checkpoint run again
                    timer.restart()
                    continue
                if self._after_step(step, m, dt, end, trace, timer, losses):
                    # SIGTERM: the steps settled after this one and the one in flight are in the
                    # checkpoint, so they are logged too
                    rest = settled[i + 1:] + (self.overlap.drain() if self.overlap is not None else [])
                    for step, m, dt in rest:
                        if m is not None:
                            self.metrics.log(step, self._record(step, m, dt, end, timer, losses))
                    return

    def _end_startup(self) -> None:
        if self.startup is not None:
            self.startup.end()

    def _steps(self, end: int, trace: TraceWindow, timer: StepTimer) -> list[Settled]:
        """The next step; the steps it settled (overlap.py), each with its wall time."""
        if self.overlap is None:
            m = self.train_step()
            return [(self.progress.step, m, timer.lap() if m is not None else 0.0)]
        ck, s = self.cfg.checkpoint, self.progress.step + 1
        # Settled at once where it must be seen done: the last step, validation, a checkpoint, the trace.
        settle_now = (s >= end or (self.spec.eval_tokens is not None and s % self.cfg.eval.interval == 0)
                      or bool(ck.save_interval and s % ck.save_interval == 0) or (s - 1) in trace.steps)
        return self.overlap.step(settle_now, timer.lap)

    def _record(self, step: int, m: dict, dt: float, end: int, timer: StepTimer, losses: list[float]) -> dict:
        """The step's metrics with its time, traffic and memory."""
        t = self.cfg.train
        losses.append(m["loss"])
        # Under overlap_validation: the traffic and blocked time of the call that settled it.
        comm = self.groups.ledger.take()  # this step's training traffic (validation's is dropped after it)
        # Host time blocked in communication: what the step did not hide behind compute (comm.py).
        blocked = {k: v for k, v in self.groups.ledger.take_seconds().items() if not k.startswith("metrics.")}
        m.update({"tokens_per_s": t.global_batch_size * t.seq_length / dt, "step_time_s": dt,
                  "comm_bytes": sum(v for k, v in comm.items() if not k.startswith("metrics.")),
                  "comm_bytes_by_kind": comm, "exposed_comm_s": sum(blocked.values()),
                  "exposed_comm_s_by_kind": {k: round(v, 6) for k, v in blocked.items()},
                  "elapsed_s": time.perf_counter() - self._fit_t0,  # with saves and validation
                  "eta_s": timer.eta(end - step)})
        if self.pipeline is not None and self.pipeline.offload is not None:  # this rank's, to host and back
            m["offload_bytes"] = self.pipeline.offload.moved_bytes
        peak = self.device.max_memory_allocated()  # CUDA: the allocator's peak since start-up
        if peak is not None:
            m["mem_peak_bytes"] = peak
        if self.spec.prediction is not None:
            m["predicted_step_time_s"] = self.spec.prediction.step_time_s
        return m

    def _after_step(self, step: int, m: dict, dt: float, end: int, trace: TraceWindow, timer: StepTimer,
                    losses: list[float]) -> bool:
        """Log step ``step``, then validation, trace, checkpoints as due; True: stop here (SIGTERM)."""
        ck = self.cfg.checkpoint
        m = self._record(step, m, dt, end, timer, losses)
        if self.spec.eval_tokens is not None and (step % self.cfg.eval.interval == 0 or step == end):
            m["val_loss"] = self.validate()
            self.groups.ledger.take()
            self.groups.ledger.take_seconds()
        self.metrics.log(step, m)
        trace.after(step, self.spec.run_dir, self.layout.vpp, self.metrics if self.is_logger else None)
        if self.checkpointer.pending is not None and (path := self.checkpointer.poll(self._everywhere)):
            self.metrics.message(f"saved checkpoint {path} (in the background)")
        if ck.save_interval and step % ck.save_interval == 0 and step != end:
            self.save(background=ck.async_save)
        # SIGTERM, agreed in the step's check (no collective of its own: it would hold every rank at the
        # end of each step): a checkpoint now, then a clean end
        if step != end and self.stepper.stop_agreed:
            self.metrics.message(f"SIGTERM: stopping after step {self.progress.step} with a checkpoint; resume with "
                                 "checkpoint.load=auto" if self.cfg.checkpoint.enabled else
                                 f"SIGTERM: stopping after step {self.progress.step} (checkpoint.enabled=false: "
                                 "none written)")
            return True
        timer.restart()
        return False

    def validate(self) -> float:
        """Mean loss on eval.tokens (evaluation.py)."""
        self.on_phase(f"validation after step {self.progress.step}")
        self.engine.wait_params()
        plan = self.parts.rank.plan if self.layout.pp > 1 else None
        return validation_loss(self.model, plan, self.layout, self.groups, self.spec.eval_tokens,
                               self.cfg.eval.micro_batch_size, autocast=self.parts.precision.autocast)

    # ---- checkpoints -------------------------------------------------------------------------------
    def save(self, background: bool = False) -> Path | None:
        """A checkpoint of this step (collective); in the background, committed at a later step boundary.
        None without one (checkpoint.enabled=false: nothing is written, a SIGTERM stop included)."""
        if not self.cfg.checkpoint.enabled:
            return None
        self.on_phase(f"the checkpoint save after step {self.progress.step}")
        if (done := self.checkpointer.wait()) is not None:  # at most one in flight: the previous one first
            self.metrics.message(f"saved checkpoint {done} (in the background)")
        path = self.checkpointer.save(self.progress.step, group=self.ckpt.save_group, background=background)
        self._saved_step = self.progress.step
        if path is not None:
            self.metrics.message(f"saved checkpoint {path}")
        return path

    def _everywhere(self, mine: bool) -> bool:
        """True on every rank if it is true on every rank (a one-element all-reduce MIN)."""
        return agree(mine, self.device.torch_device, any_rank=False)
