"""The training loop: micro-batches -> data-parallel gradients -> clipped AdamW step, with checkpoints.

One step consumes ``global_batch_size`` samples: each data-parallel rank takes its contiguous share
of the step's global sample range and runs it as micro-batches, accumulating gradients locally
(no-sync) until the last micro-batch, whose backward overlaps the bucketed all-reduce. The
reported loss is the mean over the whole global batch, identical for every dp size.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from mpformer.checkpoint.io import open_checkpoint, save_checkpoint
from mpformer.core.config import Config
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout
from mpformer.core.pipeline_plan import stage_plan
from mpformer.data.sampler import build_train_dataset, get_batch, micro_batch_sample_indices
from mpformer.data.tokenizer import copy_tokenizer
from mpformer.models.parallelize import build_model, grad_specs
from mpformer.optim.builder import build_engine
from mpformer.optim.engine import REDUCE_DTYPES, Reduction, TiedCopy
from mpformer.optim.loss_scale import LossScaler
from mpformer.optim.lr import LRSchedule
from mpformer.optim.memory import format_report, write_report
from mpformer.parallel.comm import Comm
from mpformer.parallel.groups import ProcessGroups
from mpformer.parallel.tensor_parallel import kv_replicas
from mpformer.pipeline.engine import PipelineEngine
from mpformer.pipeline.p2p import P2P
from mpformer.pipeline.schedules import build_schedule
from mpformer.pipeline.trace import gather_events, write_trace
from mpformer.training.evaluation import evaluate_loss, load_eval_tokens_for, pipeline_evaluate_loss
from mpformer.training.metrics import MetricsLogger, StepTimer


class Trainer:
    def __init__(self, cfg: Config, layout: ParallelLayout, groups: ProcessGroups, run_dir: Path,
                 resolved_config: dict[str, Any], predicted_step_time_s: float | None = None) -> None:
        self.cfg, self.layout, self.groups = cfg, layout, groups
        self.predicted_step_time_s = predicted_step_time_s  # the auto-configurator's, logged beside the measured
        self.run_dir = run_dir
        self.resolved_config = resolved_config
        self.device = groups.device
        t = cfg.train
        # 16-bit precisions keep the parameters in that dtype with fp32 masters and main gradients
        # (optim/engine.py); autocast on top keeps its per-op policy (fp32 softmax, CPU linear path).
        self.param_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
        self.dtype_ctx = (torch.autocast(self.device.kind, dtype=self.param_dtype) if t.precision != "fp32"
                          else contextlib.nullcontext())
        self.scaler = (LossScaler(t.initial_loss_scale, t.loss_scale_window, t.min_loss_scale)
                       if t.precision == "fp16" else None)
        m = cfg.model
        self.tp = groups.tp_context(kv_replicas(layout.tp, m.kv_heads), seed=t.seed)
        self.plan = stage_plan(m, layout, groups.coords["pp"], t.seq_length) if layout.pp > 1 else None
        self.model = build_model(m, tp=self.tp, device=self.device.torch_device, seed=t.seed,
                                 recompute=layout.recompute, use_apex=t.use_apex, stage=self.plan)
        self.micro_steps = t.global_batch_size // (t.micro_batch_size * layout.dp)
        tied = None
        if self.plan is not None and m.tie_embeddings:  # the embedding's copy on the last stage
            tied = TiedCopy(self.model.embed.weight, groups.embedding_comm(), owner=self.plan.has_embedding)
        red = Reduction(groups.comm("dp"), self.tp.comm, groups.comm("pp") if self.plan is not None else None,
                        grad_specs(self.model), tied, self.scaler, REDUCE_DTYPES[layout.grad_reduce_dtype])
        # Gradient reduction, clipping and the optimizer step for every ZeRO stage (optim/engine.py).
        self.engine = build_engine(self.model, red, layout.zero, cfg.optim, self.device.kind, t.grad_bucket_mb,
                                   self.param_dtype)
        self.optimizer = self.engine.optimizer
        self.pipeline = self._build_pipeline() if self.plan is not None else None
        self.metrics_comm = Comm(groups.dp, groups.ledger, tag="metrics.dp.")
        o = cfg.optim
        self.schedule = LRSchedule(lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps,
                                   decay_steps=o.decay_steps if o.decay_steps is not None else t.steps, decay=o.decay)
        self.dataset = build_train_dataset(list(cfg.data.paths), cfg.data.weights, t.seq_length, t.seed)
        self.eval_tokens = load_eval_tokens_for(cfg) if cfg.eval.interval else None
        self.step = 0
        self.consumed_samples = 0
        self.wandb_run_id: str | None = None
        self.tokenizer_dir = Path(cfg.data.tokenizer) if cfg.data.tokenizer else None
        if cfg.checkpoint.load:
            self._load(cfg.checkpoint.load)
        else:
            self._seed_dropout()
        self.save_dir = Path(cfg.checkpoint.save_dir) if cfg.checkpoint.save_dir else run_dir / "checkpoints"
        self.is_logger = groups.is_logging_rank
        self.metrics = MetricsLogger(run_dir, enabled=self.is_logger, total_steps=t.stop_at or t.steps,
                                     start_step=self.step,
                                     interval=cfg.logging.interval, progress=cfg.logging.progress,
                                     wandb_cfg=cfg.logging.wandb, wandb_run_id=self.wandb_run_id,
                                     config=resolved_config)
        self.wandb_run_id = self.metrics.wandb_run_id

    # ---- one optimizer step -----------------------------------------------------------------------
    def _micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This data-parallel rank's share of the step's samples, as (inputs, labels) per micro-batch."""
        t, out = self.cfg.train, []
        for j in range(self.micro_steps):
            offsets = micro_batch_sample_indices(0, j, dp_rank=self.groups.dp_rank, dp_size=self.layout.dp,
                                                 global_batch_size=t.global_batch_size,
                                                 micro_batch_size=t.micro_batch_size)
            batch = get_batch(self.dataset, [self.consumed_samples + i for i in offsets])
            if int(batch.max()) >= self.cfg.model.vocab_size:
                raise ConfigError(f"the data holds token id {int(batch.max())} but model.vocab_size="
                                  f"{self.cfg.model.vocab_size}; valid: a vocabulary that covers the tokenizer's")
            batch = batch.to(self.device.torch_device, non_blocking=True)
            out.append((batch[:, :-1], batch[:, 1:]))
        return out

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
        schedule = build_schedule(L.schedule, L.pp, self.micro_steps, L.vpp)
        seq = t.seq_length // L.tp if L.sequence_parallel else t.seq_length
        p2p = P2P(self.groups.pp, self.groups.ledger, (seq, t.micro_batch_size, self.cfg.model.hidden_size),
                  self.param_dtype, self.device.torch_device)
        # A stage's data-parallel reduction starts right after its last backward (engine.start).
        return PipelineEngine(self.model, self.plan, schedule, p2p, autocast=lambda: self.dtype_ctx,
                              on_grads_done=self.engine.start, on_weight_grad=self.engine.grad_ready,
                              split_backward=True)

    def train_step(self) -> dict[str, float]:
        """zero_grad -> forward/backward -> finish -> clip -> step."""
        extra = {"loss_scale": self.scaler.scale} if self.scaler is not None else {}  # this step's
        self.engine.zero_grad()
        loss_sum = self._forward_backward(self._micro_batches())
        self.engine.finish()  # reductions over dp (and a tied copy, tp partial sums, fp16 unscaling)
        grad_norm = self.engine.clip(self.cfg.optim.clip_grad)
        lr = self.schedule.apply(self.optimizer, self.step)
        self.engine.step()  # not on a skipped fp16 step
        if self.scaler is not None:
            extra["skipped_steps"] = self.scaler.skipped
        clip = self.cfg.optim.clip_grad
        clipped = grad_norm * min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else grad_norm
        self.step += 1
        self.consumed_samples += self.cfg.train.global_batch_size
        return {"loss": self._global_loss(loss_sum), "grad_norm": grad_norm, "grad_norm_clipped": clipped, "lr": lr,
                **extra}

    def _global_loss(self, loss_sum: float) -> float:
        """The mean loss over the global batch, on every rank (a metric: its own ledger kinds)."""
        loss_mean = torch.tensor(loss_sum / self.micro_steps, device=self.device.torch_device)
        if self.pipeline is not None:  # the loss lives on the last stage
            Comm(self.groups.pp, self.groups.ledger, tag="metrics.pp.").all_reduce(loss_mean)
        if self.layout.dp > 1:
            self.metrics_comm.all_reduce(loss_mean)
            loss_mean /= self.layout.dp
        return float(loss_mean)

    def fit(self) -> list[float]:
        """Train until train.steps (or train.stop_at); return the losses of the steps run here."""
        t, ck = self.cfg.train, self.cfg.checkpoint
        end = t.stop_at if t.stop_at is not None else t.steps
        tokens_per_step = t.global_batch_size * t.seq_length
        self.metrics.message(self._banner(end))
        self._memory_report()
        losses: list[float] = []
        timer = StepTimer()
        self._first_step = self.step
        while self.step < end:
            self._trace_begin(end)
            m = self.train_step()
            dt = timer.lap()  # also restarts the clock: saving and validation below are not step time
            losses.append(m["loss"])
            comm = self.groups.ledger.take()  # this step's training traffic (validation's is dropped below)
            m.update({"tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                      "comm_bytes": sum(v for k, v in comm.items() if not k.startswith("metrics.")),
                      "comm_bytes_by_kind": comm,
                      "consumed_samples": self.consumed_samples, "eta_s": timer.eta(end - self.step)})
            if self.predicted_step_time_s is not None:
                m["predicted_step_time_s"] = self.predicted_step_time_s
            if self.eval_tokens is not None and (self.step % self.cfg.eval.interval == 0 or self.step == end):
                m["val_loss"] = self.validate()
                self.groups.ledger.take()
            self.metrics.log(self.step, m)
            self._trace_end(end)
            if ck.save_interval and self.step % ck.save_interval == 0 and self.step != end:
                self.save()
            timer.restart()
        if losses:  # the final (or stop_at) checkpoint; a run that had nothing left to do writes none
            self.save()
        self.metrics.close()
        return losses

    def _memory_report(self) -> None:
        """Model-state bytes per rank (counted from the tensors held), printed and in memory.json."""
        import torch.distributed as dist

        mine = self.engine.memory()
        per_rank = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            per_rank = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(per_rank, mine)
        if self.is_logger:
            worst = max(range(len(per_rank)), key=lambda r: per_rank[r]["total"])
            self.metrics.message(format_report(worst, per_rank[worst]) + " (the largest rank)")
            write_report(self.run_dir / "memory.json", per_rank,
                         {"zero": self.layout.zero, "layout": self.layout.to_dict(),
                          "param_dtype": str(next(self.model.parameters()).dtype)})

    # ---- pipeline trace ----------------------------------------------------------------------------
    def _trace_window(self, end: int) -> range:
        """Steps whose pipeline actions are timed: ``pipeline_trace_steps`` after the first of this run
        (which warms up allocators), or fewer if the run is shorter."""
        n = self.cfg.train.pipeline_trace_steps
        first = min(self._first_step + 1, end - 1)
        return range(first, min(first + n, end)) if self.pipeline is not None and n > 0 else range(0)

    def _trace_begin(self, end: int) -> None:
        if self.step in self._trace_window(end):
            assert self.pipeline is not None
            self.pipeline.start_trace()

    def _trace_end(self, end: int) -> None:
        window = self._trace_window(end)
        if window and self.step == window[-1] + 1:
            assert self.pipeline is not None
            events = gather_events(self.pipeline.take_trace(), self.groups.pp)
            if self.is_logger:
                path = write_trace(self.run_dir / "pipeline_trace.json", events, self.layout.vpp)
                self.metrics.message(f"pipeline trace of {len(window)} step(s): {path}")

    def validate(self) -> float:
        """Mean loss on eval.tokens, rows split over the data-parallel ranks."""
        assert self.eval_tokens is not None
        self.model.eval()
        if self.plan is not None:  # the stage's layers only: the schedule's forward passes
            loss, _ = pipeline_evaluate_loss(self.model, self.plan, self.layout, self.groups, self.eval_tokens,
                                             self.cfg.eval.micro_batch_size, autocast=lambda: self.dtype_ctx)
        else:
            loss, _ = evaluate_loss(self.model, self.eval_tokens, self.cfg.eval.micro_batch_size,
                                    self.device.torch_device, Comm(self.groups.dp, self.groups.ledger, tag="eval.dp."),
                                    autocast=lambda: self.dtype_ctx)
        self.model.train()
        return loss

    # ---- checkpoints -------------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        t = self.cfg.train
        return {"step": self.step, "consumed_samples": self.consumed_samples, "wandb_run_id": self.wandb_run_id,
                "data": {"paths": list(self.cfg.data.paths), "weights": self.cfg.data.weights,
                         "seq_length": t.seq_length, "global_batch_size": t.global_batch_size, "seed": t.seed},
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def save(self) -> Path:
        tensors = self.engine.tensors()
        manifest = {"model": self.cfg.model.to_dict(), "layout": self.layout.to_dict(), "has_optimizer": True,
                    "trainer": self.trainer_state(), "world_size": self.layout.world_size,
                    "config": self.resolved_config}
        tok = self.tokenizer_dir
        if tok is not None:
            manifest["tokenizer"] = "tokenizer"  # checkpoints carry their tokenizer, so exports are complete
        rng = {"default": self.device.rng_state(), "tp": self.tp.rng.state if self.tp.rng is not None else None}
        path = save_checkpoint(self.save_dir, self.step, tensors, manifest, keep=self.cfg.checkpoint.keep,
                               rank_files={f"rng/rank_{self.groups.rank:05d}.pt": rng},
                               populate=(lambda d: copy_tokenizer(tok, d / "tokenizer")) if tok else None)
        self.metrics.message(f"saved checkpoint {path}")
        return path

    def _load(self, path: str) -> None:
        finetune = self.cfg.checkpoint.finetune
        manifest = open_checkpoint(path)
        manifest["loaded_optimizer"] = bool(manifest.get("has_optimizer")) and not finetune
        self.engine.load(manifest["path"], optimizer=manifest["loaded_optimizer"])
        if self.tokenizer_dir is None and manifest.get("tokenizer"):
            self.tokenizer_dir = Path(manifest["path"]) / manifest["tokenizer"]  # keep carrying it
        state = manifest.get("trainer")
        if not (finetune or not manifest["loaded_optimizer"] or state is None):
            self.step, self.consumed_samples = state["step"], state["consumed_samples"]
            self.wandb_run_id = state.get("wandb_run_id")
            if self.scaler is not None and state.get("loss_scaler"):
                self.scaler.load_state_dict(state["loss_scaler"])
        rng_file = Path(manifest["path"]) / "rng" / f"rank_{self.groups.rank:05d}.pt"
        same_layout = manifest.get("layout") == self.layout.to_dict()
        if self.step and same_layout and rng_file.is_file():
            saved = torch.load(rng_file, weights_only=True)
            self.device.set_rng_state(saved["default"])
            if saved.get("tp") is not None and self.tp.rng is not None:
                self.tp.rng.state = saved["tp"]
        else:
            self._seed_dropout()

    def _seed_dropout(self) -> None:
        """Dropout masks differ per data-parallel replica and pipeline stage (Megatron's offsets) and,
        after a resume whose RNG states cannot be reused, per step, so no mask sequence repeats."""
        c = self.groups.coords
        seed = self.cfg.train.seed + 100 * c["pp"] + 10 * c["dp"] + 1_000_003 * self.step
        torch.manual_seed(seed)
        if self.tp.rng is not None:
            self.tp.rng.reseed(seed)

    def _banner(self, end: int) -> str:
        t, L = self.cfg.train, self.layout
        n = self.cfg.model.num_params()  # the whole model, not this rank's shard
        start = f"resuming at step {self.step}" if self.step else "starting at step 0"
        return (f"mpformer: {self.cfg.model.arch} {n / 1e6:.2f}M params | dp={L.dp} tp={L.tp} pp={L.pp} cp={L.cp} | "
                f"global batch {t.global_batch_size} x {t.seq_length} tokens, {self.micro_steps} micro-batches of "
                f"{t.micro_batch_size} per rank | {t.precision} on {self.device.kind} | {start}, training to {end} | "
                f"run dir {self.run_dir}")


