"""Typed configuration: the Hydra schema (dataclasses in the ConfigStore) for every entry point.

The YAML files under configs/ only choose values; these dataclasses decide which keys exist and
their types, so an unknown key or a wrong type is an error (Hydra structured configs are strict).
Entry points turn the composed config into these objects and hand each component its own section.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from mpformer.core.buffers import ZERO3_PREFETCH_NUMEL, ZERO3_REDUCE_NUMEL, ZERO3_UNIT_NUMEL
from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.fp8_config import Fp8Config, check_fp8_config
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")  # fp8: core/fp8_config.py
CPU_ATTENTION = ("auto", "native", "fp32")  # parallel/kernels.py ATTENTION_CHOICES, plus auto
CPU_DGRAD = ("auto", "nn", "transposed")
DECAYS = ("cosine", "linear", "constant")
WANDB_MODES = ("online", "offline", "disabled")
ON_NAN = ("skip", "halt", "rollback")
LOAD_AUTO = "auto"  # checkpoint.load=auto: the newest complete checkpoint in the save_dir, or a fresh start


_L = ParallelLayout  # the defaults below are the layout's own: one list of values, spelled once


@dataclass
class ParallelConfig:
    """``parallel.*``: every ParallelLayout field under its own name, type and default (pp_split is a list,
    as YAML gives it), and ``auto``: parallel=auto lets the auto-configurator pick the layout (and
    train.micro_batch_size) for the world size, keys set on the command line staying as given (pinned).
    Written out so type checkers and IDEs see the fields; tests/unit/test_config_fields.py fails if a
    field of ParallelLayout is missing here or in FixedPlan, or differs in type or default."""

    dp: int = _L.dp
    tp: int = _L.tp
    pp: int = _L.pp
    cp: int = _L.cp
    cp_kind: str = _L.cp_kind
    cp_ulysses: int = _L.cp_ulysses
    vpp: int = _L.vpp
    sequence_parallel: bool = _L.sequence_parallel
    zero: int = _L.zero
    schedule: str = _L.schedule
    recompute: str = _L.recompute
    recompute_layers: int | None = _L.recompute_layers
    pp_split: list[int] | None = None
    pp_partition: str = _L.pp_partition
    grad_reduce_dtype: str = _L.grad_reduce_dtype
    pp_token_slices: int = _L.pp_token_slices
    offload: str = _L.offload
    offload_keep: int = _L.offload_keep
    ep: int = _L.ep
    etp: int | None = _L.etp
    ep_dispatcher: str = _L.ep_dispatcher
    auto: bool = False

    def layout(self) -> ParallelLayout:
        """The layout these keys describe."""
        values = {f.name: getattr(self, f.name) for f in fields(ParallelLayout)}
        if self.pp_split is not None:
            values["pp_split"] = tuple(self.pp_split)
        return ParallelLayout(**values)


@dataclass
class TrainConfig:
    steps: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seq_length: int = 256
    seed: int = 1234
    precision: str = "fp32"
    fp8: Fp8Config = field(default_factory=Fp8Config)  # train.precision=fp8's recipe (core/fp8_config.py)
    stop_at: int | None = None  # end cleanly after this step (checkpoint written); schedules aim at `steps`
    device: str = "auto"  # auto | cpu | cuda
    threads: int | None = None  # CPU threads per rank (torch.set_num_threads); None keeps torch's default
    use_apex: bool = False  # apex fused kernels when installed (optional fast path)
    compile: bool = False  # torch.compile each transformer block (Transformer.compile_layers; benchmarks/README)
    # 16-bit runs on CPU (parallel/kernel_choice.py): the attention core in the run's dtype (native, what a
    # GPU runs) or in fp32; input gradients dY @ W (nn) or through a contiguous W^T (transposed). auto:
    # the environment's MPFORMER_CPU_*, else a resumed checkpoint's, else rank 0's probe, for every rank.
    cpu_attention: str = "auto"  # auto | native | fp32
    cpu_dgrad: str = "auto"  # auto | nn | transposed
    tf32: bool = True  # CUDA: fp32 matmuls on TF32 tensor cores (as torchtitan, Megatron-LM); nothing on CPU
    deterministic: bool = False  # kernels with the same bits every run (CUDA: a bit-exact resume; slower)
    dist_timeout_s: int = 600  # a collective waiting longer than this fails instead of hanging
    # A rank whose heartbeat (a thread beating over the rendezvous store) stops this long counts as
    # dead: every rank then exits naming it (parallel/watchdog.py). 0: no heartbeat, only dist_timeout_s.
    heartbeat_timeout_s: float = 15.0
    # A step whose global loss or grad norm is not finite: skip its update, halt the run (exit 3), or
    # roll back to the last checkpoint and skip that step's samples (training/guard.py).
    on_nan: str = "halt"
    # A loss spike: a step whose grad norm exceeds this many times the median of the last 50 steps' norms
    # is treated as a non-finite one (train.on_nan says what happens). 0: off.
    spike_factor: float = 0.0
    # Optimizer post-validation: each rank steps as soon as its gradients are final, before the global
    # norm and inf check, and undoes the step exactly when they say it needed clipping or skipping
    # (optim/speculate.py); holds a copy of the optimizer's state for the step.
    post_validation: bool = False
    # With post_validation: the next step's forward/backward runs on the speculative weights while the
    # check is in flight, so one step's tail overlaps the next one's head (training/overlap.py); a
    # failed check (clipping, a skipped step) runs that step again. Pays when few steps clip.
    overlap_validation: bool = False
    grad_bucket_mb: float = 25.0  # data-parallel all-reduce bucket size
    # ZeRO-3 (elements; why these defaults: core/buffers.py): a layer's submodules merge into units of at
    # most zero3_unit_numel, the next unit is gathered ahead when it has at most zero3_prefetch_numel, and a
    # unit's gradient buffer waits for reductions in flight until they and it hold at most zero3_reduce_numel
    zero3_unit_numel: int = ZERO3_UNIT_NUMEL
    zero3_prefetch_numel: int = ZERO3_PREFETCH_NUMEL
    zero3_reduce_numel: int = ZERO3_REDUCE_NUMEL
    overlap_param_gather: bool = True  # zero 1-2: the step's parameter all-gather hides behind the next forward
    initial_loss_scale: float = 65536.0  # fp16: dynamic loss scaling starts here (2^16) ...
    loss_scale_window: int = 1000  # ... doubles after this many steps without inf/nan, halves on one
    min_loss_scale: float = 1.0
    pipeline_trace_steps: int = 0  # pp > 1: time the actions of this many steps after the first, written
    # as a Chrome trace to <run dir>/pipeline_trace.json (compare with tools/schedule.py --trace)
    # The LM head and its cross entropy fused, a chunk of tokens at a time, without full-vocabulary logits
    # (layers/fused_cross_entropy.py); false: logits, then the cross entropy. Logits alone never fuse.
    fused_cross_entropy: bool = True
    cross_entropy_chunk: int = 1024  # tokens per chunk (= layers/fused_cross_entropy.py DEFAULT_CHUNK)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adam | sgd | adafactor (not with parallel.zero > 0)
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 0
    decay: str = "cosine"
    decay_steps: int | None = None  # None: decay until train.steps
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    fused: bool | None = None  # None: torch's fused AdamW where the device supports it
    momentum: float = 0.0  # sgd only


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)  # indexed-dataset prefixes (P for P.bin / P.idx)
    weights: list[float] | None = None  # blending weights, one per path
    tokenizer: str | None = None  # HF tokenizer folder, copied into checkpoints for export
    # Packed sequences hold several documents: attend only inside each (a document ends with its EOS token).
    document_mask: bool = False
    eos_token_id: int | None = None  # the EOS id for document_mask (None: the tokenizer's)
    prefetch: int = 2  # steps of batches read ahead in a background thread (pinned on cuda); 0: read in the step
    # Sample ranges [start, end) of the global sample stream never trained on: when the data position
    # reaches a start it jumps to the end (a resume past a bad batch; rollbacks add theirs).
    skip_ranges: list[list[int]] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    enabled: bool = True  # false: the run writes no checkpoint at all (benchmarks, throwaway runs)
    save_dir: str | None = None  # default: <run dir>/checkpoints
    save_interval: int = 0  # 0: only at the end (and at stop_at)
    load: str | None = None  # a step directory, a save_dir with a `latest` pointer, or auto (see LOAD_AUTO)
    keep: int = 0  # keep the newest N checkpoints; 0 keeps all
    finetune: bool = False  # load weights only: fresh optimizer, step 0, data from the start
    # Periodic saves in the background (DCP async_save: staged to host memory, written by a thread)
    # while training goes on; committed atomically at a later step boundary, at most one in flight.
    # The command line also takes checkpoint.async=true (`async` is a Python keyword).
    async_save: bool = False


@dataclass
class WandbConfig:
    mode: str = "disabled"
    project: str = "mpformer"
    name: str | None = None
    entity: str | None = None


@dataclass
class LoggingConfig:
    interval: int = 1
    progress: bool = True  # a progress bar on a terminal, plain lines otherwise
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class EvalConfig:
    tokens: str | None = None  # .npy int64 [batch, seq+1]
    micro_batch_size: int = 4
    interval: int = 0  # pretraining: validation loss on eval.tokens every N steps and at the end (0: off)


@dataclass
class FixedPlan:
    """``autoconfig.fixed.*``: layout fields (and the micro-batch size) the auto-configurator keeps as
    given; None: searched, or for the fields it does not search (autoconfig/candidates.py NOT_SEARCHED),
    the run's ``parallel.*`` value. Every ParallelLayout field, typed as there but optional (the test
    in tests/unit/test_config_fields.py keeps the two lists equal)."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    cp_kind: str | None = None
    cp_ulysses: int | None = None
    vpp: int | None = None
    sequence_parallel: bool | None = None
    zero: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    recompute_layers: int | None = None  # pinned with recompute: the first K layers of each chunk recompute
    pp_split: list[int] | None = None  # refused with parallel=auto: the search splits the layers
    pp_partition: str | None = None
    grad_reduce_dtype: str | None = None
    pp_token_slices: int | None = None
    offload: str | None = None
    offload_keep: int | None = None  # offload=auto's budget (searched: the largest that fits)
    ep: int | None = None  # not searched (autoconfig/candidates.py NOT_SEARCHED): the run's value
    etp: int | None = None
    ep_dispatcher: str | None = None
    micro_batch_size: int | None = None

    def pinned(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class AutoconfigConfig:
    # A preset of configs/cluster (`cluster=NAME` on the command line). In pretrain it makes the trainer
    # log the cost model's predicted step time next to the measured one; parallel=auto searches on it
    # (default there: local-cpu on a CPU run).
    cluster: str | None = None
    nodes: int | None = None  # tools/autoconfig.py: nodes of the cluster (None: the preset's)
    fixed: FixedPlan = field(default_factory=FixedPlan)
    top_k: int = 5
    output: str | None = None  # tools/autoconfig.py: the plan JSON (and <stem>.parallel.yaml next to it)
    plot: str | None = None  # tools/autoconfig.py: predicted time against memory of every feasible plan (PNG)
    # tools/autoconfig.py: after the table, the chosen plan term by term against the runner-up and against the
    # plan a person picks first (largest tp in a node, pp across nodes; autoconfig/explain.py); into plan.json too
    explain: bool = False
    # Rehearse the most loaded rank of each printed plan on the cluster's GPU (rehearsal/, one process per
    # plan) and drop a plan whose rehearsed peak exceeds the device's usable memory. None: on for a GPU
    # cluster whose GPU the rehearsal knows (rehearsal/devices.py), off for a CPU host.
    rehearse: bool | None = None
    # train.precision values the search may choose among (autoconfig/precision.py: each searched, the fastest
    # plan's wins; one the cluster's device has no rate for is left out, fp8 on an A100). Empty: train.precision.
    precisions: list[str] = field(default_factory=list)


@dataclass
class RehearseConfig:
    """mpformer-rehearse (rehearsal/): which GPU, which ranks, how many steps, where the JSON goes."""

    device: str = "h100-80gb"  # one of rehearsal/devices.py's presets
    ranks: list[int] | None = None  # None: one rank of each distinct shape (every stage, first and last tp/cp rank)
    steps: int = 1
    json: str | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    autoconfig: AutoconfigConfig = field(default_factory=AutoconfigConfig)
    rehearse: RehearseConfig = field(default_factory=RehearseConfig)


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is unknown; valid: {format_choices(choices)}")


OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor")
# ZeRO steps 1-D shards of each tensor: only optimizers whose update is elementwise can be wrapped.
ELEMENTWISE_OPTIMIZERS = ("adamw", "adam", "sgd")


def check_training_config(cfg: Config) -> None:
    """Rules of the train/optim/logging sections (the layout has its own validator)."""
    t, o = cfg.train, cfg.optim
    _choice("train.precision", t.precision, PRECISIONS)
    for p in cfg.autoconfig.precisions:
        _choice("autoconfig.precisions", p, PRECISIONS)
    check_fp8_config(t.precision, t.fp8, t.compile)
    # a float8 GEMM's M (dW's K on CUDA): a micro-batch's tokens on this rank, per token slice of a pipeline
    split = max(cfg.parallel.cp, 1) * max(cfg.parallel.pp_token_slices, 1)
    tokens = t.micro_batch_size * t.seq_length // split
    if t.precision == "fp8" and tokens % 16:
        raise ConfigError(f"train.precision=fp8 with {tokens} tokens per micro-batch and rank (train.micro_batch_size="
                          f"{t.micro_batch_size} x train.seq_length={t.seq_length} / parallel.cp={cfg.parallel.cp} / "
                          f"parallel.pp_token_slices={cfg.parallel.pp_token_slices}): float8 weight-gradient GEMMs "
                          "need a multiple of 16; valid: a micro-batch x sequence length that is")
    _choice("train.cpu_attention", t.cpu_attention, CPU_ATTENTION)
    _choice("train.cpu_dgrad", t.cpu_dgrad, CPU_DGRAD)
    if t.precision == "fp16" and not (t.initial_loss_scale >= t.min_loss_scale > 0 and t.loss_scale_window >= 1):
        raise ConfigError(f"fp16 loss scaling needs initial_loss_scale >= min_loss_scale > 0 and loss_scale_window "
                          f">= 1; got {t.initial_loss_scale}, {t.min_loss_scale}, {t.loss_scale_window}")
    if t.overlap_validation and (not t.post_validation or t.precision == "fp16"):
        why = "train.post_validation=false" if not t.post_validation else "train.precision=fp16"
        raise ConfigError(f"train.overlap_validation=true with {why}: the next step may only run on a speculative "
                          "step (post_validation), and fp16's inf check sets the loss scale it runs with; valid: "
                          "train.post_validation=true with precision fp32|bf16 (or overlap_validation=false)")
    _choice("optim.decay", o.decay, DECAYS)
    _choice("optim.name", o.name, OPTIMIZERS)
    if (cfg.parallel.zero > 0 or t.precision != "fp32") and o.name not in ELEMENTWISE_OPTIMIZERS:
        why = f"parallel.zero={cfg.parallel.zero}" if cfg.parallel.zero > 0 else f"train.precision={t.precision}"
        raise ConfigError(f"optim.name={o.name} cannot be wrapped under {why}: ZeRO and 16-bit masters step 1-D "
                          f"shards of each tensor and {o.name} keeps statistics of whole matrices; valid with "
                          f"zero > 0 or 16-bit: {', '.join(ELEMENTWISE_OPTIMIZERS)} (or zero=0 with fp32)")
    _choice("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    if cfg.parallel.cp > 1 and cfg.model.attention_dropout > 0:  # training only: evaluation runs without dropout
        raise ConfigError(f"model.attention_dropout={cfg.model.attention_dropout} with parallel.cp={cfg.parallel.cp}: "
                          "context-parallel attention has no dropout inside the attention core; valid: "
                          "model.attention_dropout=0 (or cp=1)")
    if t.steps < 1:
        raise ConfigError(f"train.steps={t.steps} must be >= 1")
    if t.seq_length < 1:
        raise ConfigError(f"train.seq_length={t.seq_length} must be >= 1")
    if t.stop_at is not None and not 1 <= t.stop_at <= t.steps:
        raise ConfigError(f"train.stop_at={t.stop_at} must be between 1 and train.steps={t.steps}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)} must be two values in [0, 1)")
    if o.lr < 0 or o.min_lr < 0 or (o.decay != "constant" and o.min_lr > o.lr):
        raise ConfigError(f"optim.lr={o.lr} and optim.min_lr={o.min_lr} need 0 <= min_lr <= lr")
    if not 0 <= o.warmup_steps <= t.steps:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be between 0 and train.steps={t.steps}")
    if o.decay_steps is not None and not o.warmup_steps <= o.decay_steps:
        raise ConfigError(f"optim.decay_steps={o.decay_steps} must be >= optim.warmup_steps={o.warmup_steps} "
                          "(or null: decay until train.steps)")
    if o.clip_grad < 0:
        raise ConfigError(f"optim.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)")
    if t.cross_entropy_chunk < 1:
        raise ConfigError(f"train.cross_entropy_chunk={t.cross_entropy_chunk} must be >= 1 (tokens per chunk)")
    for key in ("zero3_unit_numel", "zero3_prefetch_numel", "zero3_reduce_numel"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 0 (elements; 0: a unit per part of a layer, "
                              "no prefetch, no reduction in flight beside a new buffer)")
    if t.threads is not None and t.threads < 1:
        raise ConfigError(f"train.threads={t.threads} must be >= 1, or null for torch's default")
    for key, value in (("train.micro_batch_size", t.micro_batch_size),
                       ("eval.micro_batch_size", cfg.eval.micro_batch_size)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    if cfg.logging.interval < 1:
        raise ConfigError(f"logging.interval={cfg.logging.interval} must be >= 1")
    _choice("train.on_nan", t.on_nan, ON_NAN)
    if t.spike_factor != 0 and t.spike_factor <= 1:
        raise ConfigError(f"train.spike_factor={t.spike_factor} must be > 1 (a multiple of the recent median grad "
                          "norm), or 0 to turn spike detection off")
    if t.heartbeat_timeout_s < 0:
        raise ConfigError(f"train.heartbeat_timeout_s={t.heartbeat_timeout_s} must be >= 0 (0: no heartbeat)")
    for r in cfg.data.skip_ranges:
        if len(r) != 2 or not 0 <= r[0] < r[1]:
            raise ConfigError(f"data.skip_ranges entry {list(r)} must be [start, end) sample positions with "
                              f"0 <= start < end, e.g. data.skip_ranges=[[1024,1056]]")
    if cfg.checkpoint.save_interval < 0 or cfg.checkpoint.keep < 0:
        raise ConfigError("checkpoint.save_interval and checkpoint.keep must be >= 0")
    ck = cfg.checkpoint
    if not ck.enabled and (ck.save_interval or ck.async_save or ck.keep or t.on_nan == "rollback"):
        what = ("checkpoint.save_interval" if ck.save_interval else "checkpoint.async" if ck.async_save
                else "checkpoint.keep" if ck.keep else "train.on_nan=rollback")
        raise ConfigError(f"checkpoint.enabled=false with {what}: a run that writes no checkpoint has nothing to "
                          "save, keep or roll back to; valid: checkpoint.enabled=true, or drop that setting")
    cfg.model.check_sequence(t.seq_length)  # learned or rotary positions alike (Megatron's rule)
    if cfg.eval.interval < 0 or (cfg.eval.interval and not cfg.eval.tokens):
        raise ConfigError(f"eval.interval={cfg.eval.interval} needs eval.tokens=FILE.npy (and must be >= 0)")
    if cfg.data.weights is not None and (any(w < 0 for w in cfg.data.weights) or not sum(cfg.data.weights) > 0):
        raise ConfigError(f"data.weights={list(cfg.data.weights)}: blending weights must be >= 0 with a positive "
                          "sum")
    if cfg.data.weights is not None and len(cfg.data.weights) != len(cfg.data.paths):
        raise ConfigError(f"data.weights has {len(cfg.data.weights)} entries but data.paths has "
                          f"{len(cfg.data.paths)}; give one weight per path or none")
