"""The composition root: a training run's parts, built in one readable order.

    precision   dtype, autocast, fp16 loss scaler
    kernels     the CPU kernel choice, once for the run and every rank (a resume takes the checkpoint's)
    model       this rank's part (models/parallelize.py build_rank), on meta: the engine places it
    engine      gradient reduction over each parameter's group, ZeRO shards, optimizer (optim/builder.py)
    pipeline    schedule, P2P, offload and engine of this rank's stage (pipeline/build.py), pp > 1
    checkpoint  what a checkpoint holds; the start checkpoint loaded (or fresh dropout streams)
    metrics     metrics.jsonl and wandb, from the (resumed) step
    loader      this data-parallel rank's share of each step's samples, read ahead on a thread
    stepper     one step's work on those parts (step.py); under overlap_validation OverlappedSteps

``build_run(spec, groups)`` returns them as ``RunParts``; the Trainer (trainer.py) only runs the loop
over what it is handed. Every part is given what it reads and what it may change, never the object
that built it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpformer.context_parallel.blockwise import doc_starts
from mpformer.context_parallel.context import document_ids
from mpformer.core.fp8_config import compute_precision
from mpformer.core.model_options import ModelOptions
from mpformer.core.topology import MESH_VIEWS
from mpformer.data.loader import MicroBatch, StepLoader
from mpformer.data.sampler import get_batch, micro_batch_sample_indices, sample_origin
from mpformer.models.fp8 import delayed_experts, delayed_layers, sync_amax_histories, sync_expert_amax_histories
from mpformer.models.parallelize import RankModel, build_rank, grad_specs
from mpformer.optim.builder import build_engine
from mpformer.optim.engine import REDUCE_DTYPES, GradEngine
from mpformer.optim.loss_scale import LossScaler
from mpformer.optim.lr import LRSchedule
from mpformer.optim.reduction import Reduction, TiedCopy, ViewGroup
from mpformer.optim.units import Zero3Settings
from mpformer.parallel.comm import Comm
from mpformer.parallel.device import Device
from mpformer.parallel.groups import ProcessGroups
from mpformer.parallel.kernel_choice import KernelChoice, choose, install
from mpformer.parallel.random import DropoutStreams
from mpformer.pipeline.build import GradHooks, build_pipeline
from mpformer.pipeline.engine import PipelineEngine
from mpformer.training.fp8_steps import DelayedSteps
from mpformer.training.guard import Preemption
from mpformer.training.metrics import MetricsLogger
from mpformer.training.overlap import OverlappedSteps, StepCheck, check_comm
from mpformer.training.preflight import RunSpec
from mpformer.training.progress import Progress
from mpformer.training.reporting import check_vocab
from mpformer.training.router_report import RouterReport
from mpformer.training.run_checkpoint import RunCheckpoint
from mpformer.training.step import Precision, Rollback, Stepper

# fp8 keeps bf16 parameters (fp32 masters) and autocast: only its linears' GEMMs are float8 (models/fp8.py)
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclass
class RunParts:
    """Everything a rank's training loop runs on (build_run)."""

    spec: RunSpec
    groups: ProcessGroups
    precision: Precision
    kernels: KernelChoice
    rank: RankModel
    engine: GradEngine
    pipeline: PipelineEngine | None
    progress: Progress
    checkpoint: RunCheckpoint
    metrics: MetricsLogger
    loader: StepLoader
    preemption: Preemption
    stepper: Stepper
    overlap: OverlappedSteps | None
    micro_steps: int

    @property
    def model(self) -> torch.nn.Module:
        return self.rank.model


@dataclass(frozen=True)
class StepReader:
    """A data-parallel rank's share of the samples of the step that starts at a position, one
    [micro_batch, seq + 1] tensor per micro-batch (whole sequences: under cp the model keeps its own
    positions), with its rows' document starts under document masks. Runs in the loader's thread."""

    spec: RunSpec
    dp_rank: int
    micro_steps: int

    def __call__(self, position: int) -> list[MicroBatch]:
        t, dp, out, eos = self.spec.cfg.train, self.spec.layout.dp, [], self.spec.document_eos
        for j in range(self.micro_steps):
            offsets = micro_batch_sample_indices(0, j, dp_rank=self.dp_rank, dp_size=dp,
                                                 global_batch_size=t.global_batch_size,
                                                 micro_batch_size=t.micro_batch_size)
            indices = [position + i for i in offsets]
            batch = get_batch(self.spec.dataset, indices)
            check_vocab(batch, self.spec.cfg.model.vocab_size,
                        lambda row, ix=indices: sample_origin(self.spec.dataset, ix[row]))
            starts = doc_starts(document_ids(batch[:, :-1], eos)) if eos is not None else None  # on the host
            out.append(MicroBatch(batch, starts))
        return out


def build_precision(spec: RunSpec, device: Device) -> Precision:
    t = spec.cfg.train
    scaler = (LossScaler(t.initial_loss_scale, t.loss_scale_window, t.min_loss_scale)
              if t.precision == "fp16" else None)
    return Precision(PARAM_DTYPES[t.precision], device, scaler)


def build_engine_for(spec: RunSpec, groups: ProcessGroups, rank: RankModel, precision: Precision) -> GradEngine:
    """The gradient engine of this rank's model: its reduction groups, a tied embedding copy on the
    last stage, ZeRO's stage and the optimizer; the model's parameters allocated in its buckets."""
    cfg, layout, t = spec.cfg, spec.layout, spec.cfg.train
    plan = rank.plan if layout.pp > 1 else None
    tied = None
    # The embedding's copy on the last stage; a V schedule puts the first and the last stage on one
    # rank, which ties the two itself (the same module, as at pp=1).
    if plan is not None and cfg.model.tie_embeddings and not plan.v:
        pair = groups.embedding_comm()  # collective; None on the stages between the first and the last
        tied = TiedCopy(rank.model.embed.weight, pair, owner=plan.has_embedding) if pair else None
    # Dense weights over dp x cp ("data"; a replica's cp ranks hold partial sums of its gradient, each its
    # part of the sequence); a parameter whose spec names another mesh view over that view's group.
    specs = grad_specs(rank.model)
    views = {v: ViewGroup(groups.view(v), groups.view_replicas(v),
                          groups.view(MESH_VIEWS[v].across) if MESH_VIEWS[v].across else None)
             for v in sorted({s.reduce_over for s in specs})}
    red = Reduction(groups.data_comm(), rank.tp.comm, groups.comm("pp") if plan is not None else None,
                    specs, tied, precision.scaler, REDUCE_DTYPES[layout.grad_reduce_dtype], replicas=layout.dp,
                    views={v: g for v, g in views.items() if v != "data"})
    return build_engine(rank.model, red, layout.zero, cfg.optim, groups.device.kind, t.grad_bucket_mb,
                        precision.dtype, init=rank.init, device=groups.device.torch_device,
                        overlap_param_gather=t.overlap_param_gather,
                        zero3=Zero3Settings(t.zero3_unit_numel, t.zero3_prefetch_numel, t.zero3_reduce_numel))


def router_report(spec: RunSpec, groups: ProcessGroups, rank: RankModel) -> RouterReport | None:
    """The routers' per-step work for an MoE model (training/router_report.py), None for a dense one."""
    m = spec.cfg.model
    if m.num_experts == 0:
        return None
    L = spec.layout
    # tp ranks route the same tokens unless each routes its own sequence chunk (SP with whole experts)
    counts = rank.tp.comm.rank == 0 or (L.sequence_parallel and (L.etp if L.etp is not None else L.tp) == 1)
    world = Comm(dist.group.WORLD if dist.is_initialized() else None, groups.ledger, tag="moe.")
    return RouterReport(rank.model, m.num_layers, m.num_experts, m.router_bias_update_rate, world, counts)


def delayed_steps(groups: ProcessGroups, rank: RankModel) -> DelayedSteps | None:
    """fp8 delayed scaling's per-step work (training/fp8_steps.py): under data parallelism the step's amax
    histories all-reduced (max) over the data group, as Transformer Engine does (models/fp8.py says why),
    the routed experts' over the expert-data group; None without delayed scaling."""
    layers, comm = delayed_layers(rank.model), groups.data_comm()
    # routed experts: over the ranks that hold the same experts (their expert-data-parallel replicas)
    experts, ecomm = delayed_experts(rank.model), groups.view("expert_data")
    syncs = []
    if layers and comm.size > 1:
        syncs.append(functools.partial(sync_amax_histories, layers, lambda t: comm.all_reduce(t, op=dist.ReduceOp.MAX)))
    if experts and ecomm.size > 1:
        syncs.append(functools.partial(sync_expert_amax_histories, experts,
                                       lambda t: ecomm.all_reduce(t, op=dist.ReduceOp.MAX)))

    def sync() -> None:
        for s in syncs:
            s()

    if not layers and not experts:
        return None
    return DelayedSteps(rank.model, sync if syncs else None)


def build_run(spec: RunSpec, groups: ProcessGroups) -> RunParts:
    """This rank's parts of the run ``spec`` describes, in the module docstring's order (collective:
    every rank calls it)."""
    cfg, layout, t = spec.cfg, spec.layout, spec.cfg.train
    device = groups.device
    precision = build_precision(spec, device)
    saved = spec.manifest.get("kernels") if spec.manifest is not None else None
    compute = compute_precision(t.precision)  # fp8 runs bf16 kernels outside its float8 GEMMs
    kernels = choose(device.kind, compute, t.cpu_attention, t.cpu_dgrad, saved)  # kernel_choice.py
    install(kernels, compute)
    options = ModelOptions.for_run(layout, t, spec.document_eos)
    # Built on the meta device: the engine allocates the parameters in its buckets and fills them
    # from the blocked initialiser, a ZeRO-3 rank its shard alone (set-up memory ~ the rank's share).
    rank = build_rank(cfg.model, layout, groups, options, seq_length=t.seq_length, seed=t.seed, deferred=True)
    engine = build_engine_for(spec, groups, rank, precision)
    if t.compile:  # after the engine: its flat buffers hold the parameters the graphs read
        rank.model.compile_layers()
    micro_steps = t.global_batch_size // (t.micro_batch_size * layout.dp)
    pipeline = None
    if layout.pp > 1:  # a stage's data-parallel reduction starts right after its last backward
        pipeline = build_pipeline(rank.model, rank.plan, layout, groups, micro_batches=micro_steps,
                                  seq_length=t.seq_length, micro_batch_size=t.micro_batch_size,
                                  dtype=precision.dtype, store=rank.store, autocast=precision.autocast,
                                  grads=GradHooks(engine.start, engine.grad_ready))
    progress = Progress(cfg.data.skip_ranges)
    rng = DropoutStreams(device, rank.tp.rng, t.seed + groups.dropout_offset())
    checkpoint = RunCheckpoint(spec, groups.rank, kernels, engine, progress, precision.scaler, rng,
                               rank.model.canonical_buffers)
    if spec.manifest is not None:
        checkpoint.load_start(spec.manifest)
    else:
        rng.reseed(0)
    metrics = MetricsLogger(spec.run_dir, enabled=groups.is_logging_rank, total_steps=t.stop_at or t.steps,
                            start_step=progress.step, interval=cfg.logging.interval,
                            progress=cfg.logging.progress, wandb_cfg=cfg.logging.wandb,
                            wandb_run_id=progress.wandb_run_id, config=spec.resolved)
    progress.adopt_wandb(metrics.wandb_run_id)
    loader = StepLoader(StepReader(spec, groups.dp_rank, micro_steps), t.global_batch_size, device.torch_device,
                        depth=cfg.data.prefetch)
    # One collective ends each step: the norm and the loss (overlap.py); under overlap_validation it is
    # collected during the next step.
    check = StepCheck(check_comm(t.overlap_validation, groups.ledger), rank.tp.comm.rank, layout.dp, micro_steps)
    o = cfg.optim
    schedule = LRSchedule(lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps,
                          decay_steps=o.decay_steps if o.decay_steps is not None else t.steps, decay=o.decay)
    preemption = Preemption()
    stepper = Stepper(rank.model, engine, pipeline, precision, loader, progress, check, schedule, preemption,
                      Rollback(checkpoint, engine, progress, metrics.message), t, o, micro_steps,
                      router_report(spec, groups, rank), delayed_steps(groups, rank))
    overlap = (OverlappedSteps(stepper, engine, rng, progress, t.global_batch_size) if t.overlap_validation
               else None)
    return RunParts(spec, groups, precision, kernels, rank, engine, pipeline, progress, checkpoint, metrics,
                    loader, preemption, stepper, overlap, micro_steps)
