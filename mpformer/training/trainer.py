"""The training loop: micro-batches -> gradients -> clipped optimizer step, with checkpoints.

One step consumes ``global_batch_size`` samples: each data-parallel rank takes its contiguous share
of the step's global sample range and runs it as micro-batches (through the pipeline engine when
pp > 1), accumulating gradients until the last, whose backward overlaps the bucketed reduction.
The reported loss is the mean over the whole global batch, identical for every dp size. A step is

    zero_grad -> forward/backward -> finish -> clip -> step

where the gradient engine (optim/engine.py) owns everything between backward and the update. The
trainer takes only the run specification that preflight resolved (config, layout, dataset, eval
tokens, prediction) and the process groups; its checkpoint is a list of parts (run_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mpformer.core.errors import RunHalted
from mpformer.data.loader import StepLoader
from mpformer.data.sampler import get_batch, micro_batch_sample_indices, sample_origin
from mpformer.models.parallelize import build_rank, grad_specs
from mpformer.optim.builder import build_engine
from mpformer.optim.engine import REDUCE_DTYPES, Reduction, TiedCopy
from mpformer.optim.loss_scale import LossScaler
from mpformer.optim.lr import LRSchedule
from mpformer.optim.units import Zero3Settings
from mpformer.parallel.device import HostCopies
from mpformer.parallel.groups import ProcessGroups
from mpformer.parallel.kernel_choice import choose, install, uninstall
from mpformer.parallel.random import DropoutStreams
from mpformer.pipeline.engine import PipelineEngine
from mpformer.pipeline.offload import ActivationOffload, offload_units
from mpformer.pipeline.p2p import P2P
from mpformer.pipeline.schedules import build_schedule
from mpformer.training.evaluation import validation_loss
from mpformer.training.guard import MAX_ROLLBACKS, SPIKE_WINDOW, Preemption, agree, bad_step, finite, halt_message
from mpformer.training.metrics import MetricsLogger, StepTimer
from mpformer.training.overlap import OverlappedSteps, Settled, StepCheck, check_comm
from mpformer.training.preflight import RunSpec
from mpformer.training.progress import Progress
from mpformer.training.reporting import TraceWindow, banner, check_vocab, memory_report
from mpformer.training.run_checkpoint import RunCheckpoint

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer:
    def __init__(self, spec: RunSpec, groups: ProcessGroups) -> None:
        cfg, layout, t = spec.cfg, spec.layout, spec.cfg.train
        self.spec, self.cfg, self.layout, self.groups, self.device = spec, cfg, layout, groups, groups.device
        # 16-bit precisions keep the parameters in that dtype with fp32 masters and main gradients
        # (optim/engine.py); autocast on top keeps its per-op policy (fp32 softmax, CPU linear path).
        self.param_dtype = PARAM_DTYPES[t.precision]
        self.dtype_ctx = (torch.autocast(self.device.kind, dtype=self.param_dtype) if t.precision != "fp32"
                          else contextlib.nullcontext())
        self.scaler = (LossScaler(t.initial_loss_scale, t.loss_scale_window, t.min_loss_scale)
                       if t.precision == "fp16" else None)
        # The CPU kernels, once for the run and every rank (a resume takes the checkpoint's): kernel_choice.py.
        saved = spec.manifest.get("kernels") if spec.manifest is not None else None
        self.kernels = choose(self.device.kind, t.precision, t.cpu_attention, t.cpu_dgrad, saved)
        install(self.kernels, t.precision)
        # Built on the meta device: the engine allocates the parameters in its buckets and fills them
        # from the blocked initialiser, a ZeRO-3 rank its shard alone (set-up memory ~ the rank's share).
        self.rank = build_rank(cfg.model, layout, groups, seq_length=t.seq_length, seed=t.seed, use_apex=t.use_apex,
                               document_eos=spec.document_eos, fused_cross_entropy=t.fused_cross_entropy,
                               cross_entropy_chunk=t.cross_entropy_chunk, deferred=True)
        self.model, self.tp = self.rank.model, self.rank.tp
        self.plan = self.rank.plan if layout.pp > 1 else None
        self.micro_steps = t.global_batch_size // (t.micro_batch_size * layout.dp)
        tied = None
        # The embedding's copy on the last stage; a V schedule puts the first and the last stage on one
        # rank, which ties the two itself (the same module, as at pp=1).
        if self.plan is not None and cfg.model.tie_embeddings and not self.plan.v:
            pair = groups.embedding_comm()  # collective; None on the stages between the first and the last
            tied = TiedCopy(self.model.embed.weight, pair, owner=self.plan.has_embedding) if pair else None
        # Over dp x cp: a replica's cp ranks hold partial sums of its gradient (each its part of the sequence).
        red = Reduction(groups.data_comm(), self.tp.comm, groups.comm("pp") if self.plan is not None else None,
                        grad_specs(self.model), tied, self.scaler, REDUCE_DTYPES[layout.grad_reduce_dtype],
                        replicas=layout.dp)
        self.engine = build_engine(self.model, red, layout.zero, cfg.optim, self.device.kind, t.grad_bucket_mb,
                                   self.param_dtype, init=self.rank.init, device=self.device.torch_device,
                                   overlap_param_gather=t.overlap_param_gather,
                                   zero3=Zero3Settings(t.zero3_unit_numel, t.zero3_prefetch_numel,
                                                       t.zero3_reduce_numel))
        if t.compile:  # after the engine: its flat buffers hold the parameters the graphs read
            self.model.compile_layers()
        self.pipeline = self._build_pipeline() if self.plan is not None else None
        o = cfg.optim
        self.schedule = LRSchedule(lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps,
                                   decay_steps=o.decay_steps if o.decay_steps is not None else t.steps, decay=o.decay)
        self.progress = Progress(cfg.data.skip_ranges)
        self.preemption = Preemption()
        self.stop_agreed = False  # some rank was sent SIGTERM before the last settled step's check
        self._saved_step: int | None = None  # the step of this run's newest checkpoint
        self._rollbacks = 0
        self.on_phase: Callable[[str], None] = lambda phase: None  # the heartbeat's (parallel/watchdog.py)
        self.rng = DropoutStreams(self.device, self.tp.rng, t.seed + groups.dropout_offset())
        self.ckpt = RunCheckpoint(self)
        self.checkpointer, self.save_dir = self.ckpt.checkpointer, self.ckpt.save_dir
        if spec.manifest is not None:
            self.ckpt.load_start(spec.manifest)
        else:
            self.rng.reseed(0)
        self.is_logger = groups.is_logging_rank
        self.metrics = MetricsLogger(spec.run_dir, enabled=self.is_logger, total_steps=t.stop_at or t.steps,
                                     start_step=self.progress.step, interval=cfg.logging.interval,
                                     progress=cfg.logging.progress, wandb_cfg=cfg.logging.wandb,
                                     wandb_run_id=self.progress.wandb_run_id, config=spec.resolved)
        self.progress.adopt_wandb(self.metrics.wandb_run_id)
        # One collective ends each step: the norm and the loss (overlap.py); under overlap_validation it is
        # collected during the next step.
        self.check = StepCheck(check_comm(t.overlap_validation, groups.ledger), self.tp.comm.rank, layout.dp,
                               self.micro_steps)
        self.overlap = OverlappedSteps(self) if t.overlap_validation else None
        self.loader = StepLoader(self._read_step, t.global_batch_size, self.device.torch_device,
                                 depth=cfg.data.prefetch)

    # ---- one optimizer step -----------------------------------------------------------------------
    def _read_step(self, position: int) -> list[torch.Tensor]:
        """This data-parallel rank's share of the samples of the step that starts at ``position``, one
        [micro_batch, seq + 1] tensor per micro-batch (whole sequences: under cp the model keeps its own
        positions). Runs in the loader's thread."""
        t, out = self.cfg.train, []
        for j in range(self.micro_steps):
            offsets = micro_batch_sample_indices(0, j, dp_rank=self.groups.dp_rank, dp_size=self.layout.dp,
                                                 global_batch_size=t.global_batch_size,
                                                 micro_batch_size=t.micro_batch_size)
            indices = [position + i for i in offsets]
            batch = get_batch(self.spec.dataset, indices)
            check_vocab(batch, self.cfg.model.vocab_size,
                        lambda row, ix=indices: sample_origin(self.spec.dataset, ix[row]))
            out.append(batch)
        return out

    def _micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This step's (inputs, labels) per micro-batch, on the device (past any skip range)."""
        return [(b[:, :-1], b[:, 1:]) for b in self.loader.take(self.progress.position())]

    def _forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Every micro-batch's forward and backward, gradients accumulated over them; the last one's
        backward overlaps the reductions (a pipeline's: after each stage's last backward)."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.pipeline is not None:
            with self.engine.no_sync():
                return sum(self.pipeline.run(batches, loss_scale=scale))
        loss_sum = torch.zeros((), device=self.device.torch_device)
        for j, (inputs, labels) in enumerate(batches):
            with self.engine.no_sync() if j < len(batches) - 1 else contextlib.nullcontext():
                with self.dtype_ctx:
                    loss = self.model(inputs, labels)
                (loss / self.micro_steps if scale == 1.0 else loss * (scale / self.micro_steps)).backward()
            loss_sum += loss.detach().float()
        return float(loss_sum)

    def _build_pipeline(self) -> PipelineEngine:
        t, L = self.cfg.train, self.layout
        schedule = build_schedule(L.schedule, L.pp, self.micro_steps, L.vpp, slices=L.pp_token_slices)
        p2p = P2P(self.groups.pp, self.groups.ledger,
                  (L.boundary_positions(t.seq_length), t.micro_batch_size, self.cfg.model.hidden_size),
                  self.param_dtype, self.device.torch_device)
        offload = None
        if L.offload != "none":  # activations of units waiting for their backward to host memory
            units = offload_units(schedule.actions[self.plan.rank], L.offload, L.offload_keep)
            offload = ActivationOffload(HostCopies(self.device), self.model, units)
        # A stage's data-parallel reduction starts right after its last backward (engine.start).
        return PipelineEngine(self.model, self.plan, schedule, p2p, autocast=lambda: self.dtype_ctx,
                              on_grads_done=self.engine.start, on_weight_grad=self.engine.grad_ready,
                              store=self.rank.store, offload=offload)

    def train_step(self) -> dict[str, float] | None:
        """zero_grad -> forward/backward -> finish -> check -> step. None: the step was rolled back
        (train.on_nan=rollback; training/guard.py)."""
        extra = {"loss_scale": self.scaler.scale} if self.scaler is not None else {}  # this step's
        t = self.cfg.train
        self.engine.zero_grad()
        loss_sum = self._forward_backward(self._micro_batches())
        start = self.progress.consumed_samples  # this step's samples: [start, start + global batch)
        self.engine.finish()  # reductions over dp (and a tied copy, tp partial sums, fp16 unscaling)
        spec = None
        if t.post_validation:  # step now, validate after the check's collective (optim/speculate.py)
            self.schedule.apply(self.engine.optimizer, self.progress.step)
            spec = self.engine.speculate()
        # The norm and the loss, the same on every rank: one decision everywhere.
        check = self.check.launch(self.engine, loss_sum, stop=self.preemption.requested)
        grad_norm, loss = self.check.result(check, self.engine, self.cfg.optim.clip_grad, speculation=spec)
        self.stop_agreed = self.check.stopping(check)
        bad, rolled_back = self._verdict(self.progress.step + 1, start, loss, grad_norm)
        if rolled_back:
            return None
        lr = self.schedule.apply(self.engine.optimizer, self.progress.step)
        if bad:  # on_nan=skip: the weights and optimizer state stay as they were
            self.engine.undo(spec)
        else:
            self.engine.step(spec)  # not on a skipped fp16 step
        self.progress.advance(t.global_batch_size)
        return self._step_metrics(start, loss, grad_norm, lr, bad, extra)

    def _verdict(self, step: int, start: int, loss: float, grad_norm: float) -> tuple[bool, bool]:
        """(bad, rolled back) for step ``step`` (samples from ``start``): a bad step halts the run, rolls
        it back to the newest checkpoint, or is to be skipped, as train.on_nan says (guard.py)."""
        t = self.cfg.train
        why = None if self.engine.skipped else bad_step(loss, grad_norm, self.progress.recent_grad_norms,
                                                         t.spike_factor)
        bad = why is not None
        if bad and t.on_nan == "halt":
            raise RunHalted(halt_message(step, loss, grad_norm, start, start + t.global_batch_size,
                                         f"{why} (train.on_nan=halt)"))
        if bad and t.on_nan == "rollback":
            self._rollback(step, start, loss, grad_norm, why)
            return True, True
        if not bad and not self.engine.skipped and finite(loss, grad_norm):
            self.progress.recent_grad_norms = [*self.progress.recent_grad_norms, grad_norm][-SPIKE_WINDOW:]
        if bad:
            self.progress.skipped_steps += 1
        return bad, False

    def _step_metrics(self, start: int, loss: float, grad_norm: float, lr: float, bad: bool,
                      extra: dict) -> dict[str, float]:
        t = self.cfg.train
        if self.scaler is not None:
            extra["skipped_steps"] = self.scaler.skipped
        elif t.on_nan == "skip":
            extra["skipped_steps"] = self.progress.skipped_steps
        if self.progress.rollbacks:
            extra["rollbacks"] = self.progress.rollbacks
        clip = self.cfg.optim.clip_grad
        clipped = grad_norm * min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else grad_norm
        return {"loss": loss, "grad_norm": grad_norm, "grad_norm_clipped": clipped, "lr": lr,
                "consumed_samples": start + t.global_batch_size, **({"skipped": 1} if bad else {}), **extra}

    def _rollback(self, step: int, start: int, loss: float, grad_norm: float, why: str) -> None:
        """Back to the newest checkpoint in save_dir, step ``step``'s samples added to the skip ranges."""
        end = start + self.cfg.train.global_batch_size
        manifest, passed = self.ckpt.newest()
        if manifest is None or self._rollbacks >= MAX_ROLLBACKS:
            stop = (f"train.on_nan=rollback found no checkpoint in {self.save_dir}" if manifest is None
                    else f"{MAX_ROLLBACKS} rollbacks in this run already")
            raise RunHalted(halt_message(step, loss, grad_norm, start, end, f"{why} ({stop})"))
        for line in passed:
            self.metrics.message(f"warning: rollback passes over {line}")
        self.engine.zero_grad()
        self.ckpt.roll_back_to(manifest)
        self._rollbacks += 1
        self.progress.rollbacks += 1
        self.progress.add_skip(start, end)
        self.metrics.message(f"step {step}: loss {loss} / grad norm {grad_norm}: {why}; rolled back to "
                             f"{manifest.path.name}, samples [{start}, {end}) will be skipped")

    def fit(self) -> list[float]:
        """Train until train.steps (or train.stop_at); return the losses of the steps run here."""
        t = self.cfg.train
        end = t.stop_at if t.stop_at is not None else t.steps
        self.metrics.message(banner(self.cfg, self.layout, self.micro_steps, self.device.kind, self.progress.step,
                                    end, self.spec.run_dir, self.kernels.describe()))
        memory_report(self.engine, self.layout, self.model, self.metrics, self.spec.run_dir, self.is_logger)
        if self.layout.offload != "none" and self.device.kind == "cpu":
            self.metrics.message(f"note: parallel.offload={self.layout.offload} on cpu: host memory is the device's, "
                                 "so the copies save nothing here (they run, on a thread)")
        trace = TraceWindow(self.pipeline, t.pipeline_trace_steps, self.progress.step, end, self.groups.pp)
        losses: list[float] = []
        timer = StepTimer()
        self._fit_t0 = time.perf_counter()
        self.preemption.install()
        try:
            self._loop(end, trace, timer, losses)
        finally:
            self.preemption.uninstall()
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
        if step != end and self.stop_agreed:
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
        return validation_loss(self.model, self.plan, self.layout, self.groups, self.spec.eval_tokens,
                               self.cfg.eval.micro_batch_size, autocast=lambda: self.dtype_ctx)

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
