"""ParallelLayout and the one validator every entry point uses (docs/architecture.md, principle 4).

validate() runs before any process group exists. Each rule raises a ConfigError whose single line
names the key, its value, the rule, and the values that would be valid. Rules run in the order a
user can act on them: value ranges, model compatibility, features that are specified but not
implemented yet (rejected, never silently ignored), world size, batch arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from mpformer.core import partition
from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.model_config import ModelConfig, divisors
from mpformer.core.topology import MESH_DIMS, Topology

CP_KINDS = ("ring", "allgather", "ulysses", "hybrid")  # Megatron --cp-comm-type p2p | allgather | a2a | a2a+p2p
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev")
# schedules that run a backward as BI then BW (a WeightGradStore)
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zb-v", "dualpipev")
V_SCHEDULES = ("zb-v", "dualpipev")  # two chunks per rank in a V (pipeline/actions.py): vpp = 2
SLICED_SCHEDULES = ("gpipe", "1f1b")  # token-level pipelining (pipeline/schedules.py)
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
PP_PARTITIONS = ("uniform", "balanced")
OFFLOAD_MODES = ("none", "auto", "all")  # pipeline/offload.py
GRAD_REDUCE_DTYPES = ("fp32", "bf16")  # the dtype gradients travel in (Megatron's --grad-reduce-in-bf16)
EP_DISPATCHERS = ("alltoall", "allgather")  # layers/moe_dispatch.py; Megatron --moe-token-dispatcher-type


@dataclass(frozen=True)
class ParallelLayout:
    """How one training job is split. dp=-1 means "whatever the world size leaves"."""

    dp: int = -1  # -1: world size / (tp * pp * cp)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_kind: str = "ring"
    cp_ulysses: int = 1  # cp_kind=hybrid: the Ulysses degree inside a ring of cp / cp_ulysses
    vpp: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    recompute: str = "none"
    recompute_layers: int | None = None  # recompute only the first K layers of each pipeline chunk (None: all)
    pp_split: tuple[int, ...] | None = None  # transformer layers per global stage (pp * vpp entries)
    pp_partition: str = "uniform"  # without pp_split: equal layer counts, or balanced by compute cost
    grad_reduce_dtype: str = "fp32"  # data-parallel gradient reductions in fp32 or bf16 (accumulation: fp32)
    pp_token_slices: int = 1  # token-level pipelining (TeraPipe): each micro-batch in this many sequence slices
    offload: str = "none"  # activations of units waiting for their backward to host memory (pipeline/offload.py)
    offload_keep: int = 1  # offload=auto: units a rank keeps in flight on the device before it offloads
    ep: int = 1  # expert parallelism: experts split over ep ranks carved from dp x cp (core/topology.py expert_groups)
    etp: int | None = None  # tensor parallelism inside an expert (None: tp)
    ep_dispatcher: str = "alltoall"  # how tokens reach their experts' ranks (layers/moe_dispatch.py)

    @property
    def topology(self) -> Topology:
        if self.dp < 1:
            raise AssertionError("resolve the layout (validate()) before asking for its topology")
        return Topology.of(self)

    @property
    def world_size(self) -> int:
        return self.dp * self.others()

    def others(self) -> int:
        """The product of every mesh dimension's size but dp (core/topology.py MESH_DIMS): the ranks of one replica."""
        return math.prod(d.size(self) for d in MESH_DIMS if d.name != "dp")

    def local_positions(self, seq_length: int) -> int:
        """Positions of a sequence one rank's activations hold between layers: 1/cp of it, and 1/tp of
        that under sequence parallelism (the pipeline's boundary shape is [this, b, h])."""
        return seq_length // self.cp // (self.tp if self.sequence_parallel else 1)

    def boundary_positions(self, seq_length: int) -> int:
        """Positions of one pipeline message ``[this, b, h]``: a rank's positions, or one token slice of them."""
        return self.local_positions(seq_length) // self.pp_token_slices

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pp_split"] = list(self.pp_split) if self.pp_split is not None else None
        return d


# (predicate, key, what) for features whose config exists but whose runtime lands in a later issue.
NOT_IMPLEMENTED: list[tuple[Callable[[ParallelLayout], bool], str, str, str]] = []


def ulysses_degree(L: ParallelLayout) -> int:
    """Over how many ranks heads are scattered by all-to-all: all of cp (ulysses), cp_ulysses (hybrid), else 1."""
    return {"ulysses": L.cp, "hybrid": L.cp_ulysses}.get(L.cp_kind, 1) if L.cp > 1 else 1


def valid_tp_values(model: ModelConfig) -> list[int]:
    """tp must divide query heads and ffn size; kv heads are split if tp divides them, else
    replicated, which needs tp to be a multiple of kv heads."""
    heads, kv, ffn = model.num_attention_heads, model.kv_heads, model.ffn_size
    return [t for t in divisors(heads) if ffn % t == 0 and (kv % t == 0 or t % kv == 0)]


def valid_pp_values(model: ModelConfig, vpp: int = 1) -> list[int]:
    return [p for p in divisors(model.num_layers) if model.num_layers % (p * vpp) == 0]


def min_microbatches(name: str, pp: int) -> int:
    """The fewest microbatches a schedule accepts (interleaved also needs a multiple of pp)."""
    return {"zb-h1": pp, "zb-h2": 2 * pp - 1, "interleaved": pp, "dualpipev": 2 * pp}.get(name, 1)


def check_args(name: str, pp: int, microbatches: int, vpp: int, slices: int = 1) -> None:
    """Raise a one-line ConfigError naming the valid values, or return."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    for key, val in (("pp", pp), ("microbatches", microbatches), ("vpp", vpp), ("slices", slices)):
        if not isinstance(val, int) or val < 1:
            raise ConfigError(f"{key}={val} must be an integer >= 1")
    if slices > 1 and name not in SLICED_SCHEDULES:
        raise ConfigError(f"schedule {name} cannot run token slices (pp_token_slices={slices}); valid: schedule "
                          f"{' or '.join(SLICED_SCHEDULES)}, or pp_token_slices=1")
    if name == "interleaved" and pp > 1 and vpp < 2:
        raise ConfigError(f"schedule interleaved needs vpp >= 2 at pp={pp} (vpp={vpp}); valid: vpp in 2, 3, 4, ...")
    if vpp > 1 and pp == 1:
        raise ConfigError(f"vpp={vpp} needs pp > 1; valid at pp=1: vpp=1")
    if name in V_SCHEDULES and (vpp != 2 or pp < 2):
        raise ConfigError(f"schedule {name} runs two chunks per rank in a V: it needs vpp=2 and pp >= 2 "
                          f"(got vpp={vpp}, pp={pp}); valid: vpp=2")
    if vpp > 1 and name not in ("interleaved", *V_SCHEDULES):
        raise ConfigError(f"schedule {name} has no virtual stages (vpp={vpp}); valid: vpp=1, or schedule "
                          f"interleaved or {', '.join(V_SCHEDULES)}")
    low = min_microbatches(name, pp)
    if microbatches < low:
        raise ConfigError(f"schedule {name} at pp={pp} needs microbatches >= {low}, got {microbatches}")
    if name == "interleaved" and microbatches % pp:
        raise ConfigError(f"schedule interleaved needs microbatches divisible by pp={pp}, got {microbatches}; "
                          f"valid: {', '.join(str(pp * k) for k in range(1, 5))}, ...")


def _check_values(L: ParallelLayout) -> None:
    for key in ("tp", "pp", "cp", "vpp", "cp_ulysses", "pp_token_slices", "offload_keep", "ep"):
        v = getattr(L, key)
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"parallel.{key}={v} must be an integer >= 1")
    if not isinstance(L.dp, int) or (L.dp < 1 and L.dp != -1):
        raise ConfigError(f"parallel.dp={L.dp} must be an integer >= 1, or -1 to use what the world size leaves")
    for key, choices in (("cp_kind", CP_KINDS), ("schedule", SCHEDULES), ("recompute", RECOMPUTE),
                         ("zero", ZERO_STAGES), ("pp_partition", PP_PARTITIONS), ("offload", OFFLOAD_MODES),
                         ("grad_reduce_dtype", GRAD_REDUCE_DTYPES), ("ep_dispatcher", EP_DISPATCHERS)):
        if getattr(L, key) not in choices:
            raise ConfigError(f"parallel.{key}={getattr(L, key)!r} is unknown; valid: {format_choices(choices)}")
    if L.etp is not None and L.etp not in (1, L.tp):
        raise ConfigError(f"parallel.etp={L.etp} is not 1 (whole experts on every tp rank) or tp={L.tp} (each expert "
                          f"split over tp like the dense MLP); valid: null (tp), 1, {L.tp}")
    if L.recompute_layers is not None and (not isinstance(L.recompute_layers, int) or L.recompute_layers < 0):
        raise ConfigError(f"parallel.recompute_layers={L.recompute_layers} must be an integer >= 0, or null for "
                          "every layer")
    if L.recompute_layers is not None and L.recompute == "none":
        raise ConfigError(f"parallel.recompute_layers={L.recompute_layers} chooses which layers recompute, but "
                          "parallel.recompute=none; valid: recompute=selective or full, or recompute_layers=null")
    if L.cp_kind == "hybrid" and L.cp > 1:
        ok = [u for u in divisors(L.cp) if 1 < u < L.cp]
        if L.cp_ulysses not in ok:
            raise ConfigError(f"parallel.cp_ulysses={L.cp_ulysses} at cp={L.cp}: hybrid needs a Ulysses degree that "
                              f"divides cp and lies strictly between 1 and cp; valid: "
                              f"{format_choices(ok) if ok else 'none at this cp (use cp_kind ring or ulysses)'}")
    elif L.cp_ulysses != 1:
        raise ConfigError(f"parallel.cp_ulysses={L.cp_ulysses} applies only to cp_kind=hybrid with cp > 1; valid "
                          f"here: cp_ulysses=1")


def _check_model(L: ParallelLayout, model: ModelConfig, seq_length: int | None) -> None:
    heads, kv, ffn = model.num_attention_heads, model.kv_heads, model.ffn_size
    valid_tp = format_choices(valid_tp_values(model))
    if heads % L.tp:
        raise ConfigError(f"parallel.tp={L.tp} does not divide num_attention_heads={heads}; "
                          f"valid tp for this model: {valid_tp}")
    if kv % L.tp and L.tp % kv:
        raise ConfigError(f"parallel.tp={L.tp} neither divides num_kv_heads={kv} nor is a multiple of it "
                          f"(needed to replicate kv heads); valid tp for this model: {valid_tp}")
    if ffn % L.tp:
        raise ConfigError(f"parallel.tp={L.tp} does not divide ffn_hidden_size={ffn}; "
                          f"valid tp for this model: {valid_tp}")
    if L.sequence_parallel and L.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1; valid: false, or tp in "
                          f"{valid_tp}")
    if L.sequence_parallel and seq_length is not None and seq_length % L.tp:
        raise ConfigError(f"train.seq_length={seq_length} must be divisible by parallel.tp={L.tp} under sequence "
                          f"parallelism (each rank keeps seq_length/tp positions); valid: multiples of {L.tp}")
    _check_experts(L, model)
    _check_pipeline(L, model)
    _check_token_slices(L, seq_length)
    _check_offload(L)
    if L.cp > 1:
        _check_context_parallel(L, model, seq_length)


def _check_context_parallel(L: ParallelLayout, model: ModelConfig, seq_length: int | None) -> None:
    """Every cp kind shares one zigzag split of 2*cp chunks; Ulysses scatters this tp rank's heads."""
    heads, kv = model.num_attention_heads // L.tp, max(1, model.kv_heads // L.tp)
    if seq_length is not None and seq_length % (2 * L.cp * (L.tp if L.sequence_parallel else 1)):
        sp = " * tp (sequence parallelism splits each rank's part again)" if L.sequence_parallel else ""
        step = 2 * L.cp * (L.tp if L.sequence_parallel else 1)
        raise ConfigError(f"train.seq_length={seq_length} must be divisible by 2*cp{sp} = {step} (the load-balanced "
                          f"split gives each cp rank chunks i and 2cp-1-i); valid: multiples of {step}")
    u = ulysses_degree(L)
    if u > 1 and heads % u:
        key = "cp" if L.cp_kind == "ulysses" else "cp_ulysses"
        valid = [d for d in divisors(heads) if d > 1]
        raise ConfigError(f"parallel.{key}={u} with cp_kind={L.cp_kind} does not divide the {heads} attention heads "
                          f"per tp rank (num_attention_heads / tp); valid Ulysses degrees: {format_choices(valid)}")
    if u > 1 and kv % u and u % kv:
        key = "cp" if L.cp_kind == "ulysses" else "cp_ulysses"
        raise ConfigError(f"parallel.{key}={u} with cp_kind={L.cp_kind} neither divides the {kv} kv heads per tp "
                          f"rank nor is a multiple of them (kv heads are split or replicated)")


def _check_experts(L: ParallelLayout, model: ModelConfig) -> None:
    """ep splits a mixture-of-experts model's experts (model.num_experts; 0 or absent: a dense model)."""
    experts = model.num_experts
    etp = L.etp if L.etp is not None else L.tp
    if experts and model.expert_ffn_size % etp:
        raise ConfigError(f"parallel.etp={etp} does not divide the experts' ffn width {model.expert_ffn_size} "
                          f"(model.moe_ffn_hidden_size); valid etp: 1, or a tp dividing it")
    if L.ep > 1 and experts < 2:
        raise ConfigError(f"parallel.ep={L.ep} splits experts over ranks, but the model has none (model.num_experts="
                          f"{experts}); valid for a dense model: ep=1")
    if L.ep > 1 and experts % L.ep:
        raise ConfigError(f"parallel.ep={L.ep} does not divide model.num_experts={experts} (each ep rank holds "
                          f"num_experts/ep experts); valid ep: {format_choices(divisors(experts))}")


def _check_expert_ranks(L: ParallelLayout) -> None:
    """Expert parallelism is carved from the data ranks (core/topology.py expert_groups): ep | dp*cp."""
    n = L.dp * L.cp
    if n % L.ep:
        raise ConfigError(f"parallel.ep={L.ep} must divide dp*cp = {L.dp}*{L.cp} = {n} (expert-parallel groups are "
                          f"carved from the data-parallel x context-parallel ranks); valid ep: "
                          f"{format_choices(divisors(n))}")


def _check_pipeline(L: ParallelLayout, model: ModelConfig) -> None:
    layers = model.num_layers
    if L.vpp > 1 and L.pp == 1:
        raise ConfigError(f"parallel.vpp={L.vpp} needs parallel.pp > 1; valid: vpp=1")
    if L.schedule == "interleaved" and L.vpp == 1 and L.pp > 1:
        ok = [v for v in range(2, layers + 1) if layers % (L.pp * v) == 0]
        hint = f"vpp in {format_choices(ok)}" if ok else f"another schedule (num_layers={layers} leaves no vpp >= 2 " \
            f"at pp={L.pp}), or parallel.pp_split"
        raise ConfigError(f"parallel.schedule=interleaved needs parallel.vpp > 1; valid: {hint}")
    stages = L.pp * L.vpp
    if L.pp_split is not None:
        if L.pp_partition != "uniform":
            raise ConfigError(f"parallel.pp_split={list(L.pp_split)} and parallel.pp_partition={L.pp_partition} "
                              "both choose the stages; valid: one of them (pp_partition=uniform with a split)")
        partition.from_split(L.pp_split, layers, stages)
        return
    if L.pp > layers:
        raise ConfigError(f"parallel.pp={L.pp} exceeds num_layers={layers}; valid pp: "
                          f"{format_choices(valid_pp_values(model, L.vpp))}")
    if L.pp_partition == "balanced":
        if stages > layers:
            raise ConfigError(f"pp*vpp={stages} stages exceed num_layers={layers}: every stage needs a layer; "
                              f"valid vpp at pp={L.pp}: 1..{layers // L.pp}")
        return
    if layers % stages:
        alternatives = "parallel.pp_split, or parallel.pp_partition=balanced"
        if L.vpp == 1:
            raise ConfigError(f"num_layers={layers} cannot be split into pp={L.pp} equal stages; valid pp: "
                              f"{format_choices(valid_pp_values(model))} (or give {alternatives})")
        vpps = [v for v in range(2, layers // L.pp + 1) if layers % (L.pp * v) == 0]
        pps = [p for p in valid_pp_values(model, L.vpp) if p > 1]
        items = [x for x in (f"vpp in {format_choices(vpps)} at pp={L.pp}" if vpps else "",
                             f"pp in {format_choices(pps)} at vpp={L.vpp}" if pps else "") if x]
        valid = "; ".join(items) + ("; or " if items else "") + f"give {alternatives}"
        raise ConfigError(f"num_layers={layers} cannot be split into pp*vpp={stages} equal stages; valid: {valid}")


def _check_token_slices(L: ParallelLayout, seq_length: int | None) -> None:
    """Token-level pipelining (pipeline/schedules.py): slices of equal length through gpipe or 1f1b."""
    k = L.pp_token_slices
    if k == 1:
        return
    if L.pp == 1:
        raise ConfigError(f"parallel.pp_token_slices={k} pipelines slices of a sequence between stages and needs "
                          "parallel.pp > 1; valid at pp=1: pp_token_slices=1")
    if L.schedule not in SLICED_SCHEDULES:
        ok = " or ".join(SLICED_SCHEDULES)
        raise ConfigError(f"parallel.pp_token_slices={k} runs under schedule {ok}, not {L.schedule}; valid: "
                          f"parallel.schedule={ok}, or pp_token_slices=1")
    if L.cp > 1:
        raise ConfigError(f"parallel.pp_token_slices={k} with parallel.cp={L.cp}: a slice's context-parallel split is "
                          "not implemented; valid: cp=1, or pp_token_slices=1")
    if seq_length is not None:
        step = k * (L.tp if L.sequence_parallel else 1)
        if seq_length % step:
            ok = [d for d in divisors(seq_length // (L.tp if L.sequence_parallel else 1) or 1)
                  if seq_length % (d * (L.tp if L.sequence_parallel else 1)) == 0]
            sp = f" (times tp={L.tp}: sequence parallelism splits each slice again)" if L.sequence_parallel else ""
            raise ConfigError(f"parallel.pp_token_slices={k}{sp} does not divide train.seq_length={seq_length} into "
                              f"equal slices; valid pp_token_slices: {format_choices(ok)}")


def _check_offload(L: ParallelLayout) -> None:
    """Activation offload moves what a unit saves while it waits for its backward: a pipeline's."""
    if L.offload != "none" and L.pp == 1:
        raise ConfigError(f"parallel.offload={L.offload} moves the activations of micro-batches waiting for their "
                          "backward, and at pp=1 none waits (each backward follows its forward); valid at pp=1: "
                          "offload=none")
    if L.offload_keep != 1 and L.offload != "auto":
        raise ConfigError(f"parallel.offload_keep={L.offload_keep} is the budget of offload=auto, but parallel.offload="
                          f"{L.offload}; valid: offload=auto, or offload_keep=1")


def _check_zero(L: ParallelLayout) -> None:
    if L.zero >= 2 and L.pp > 1:
        # Stage 2 frees full gradients after each micro-batch's reduction; under a pipeline every
        # micro-batch would be reduce-scattered, multiplying dp traffic by the micro-batch count
        # (DeepSpeed disallows it for the same reason).
        raise ConfigError(f"parallel.zero={L.zero} cannot run with parallel.pp={L.pp}: gradients would be "
                          "reduce-scattered once per micro-batch; valid with pipeline parallelism: zero=0 or 1")


def _resolve_dp(L: ParallelLayout, world_size: int) -> ParallelLayout:
    others = L.others()
    if L.dp == -1:
        if world_size % others:
            raise ConfigError(f"world size {world_size} is not divisible by tp*pp*cp={others} "
                              f"(tp={L.tp}, pp={L.pp}, cp={L.cp}); valid tp*pp*cp: "
                              f"{format_choices(divisors(world_size))}")
        return replace(L, dp=world_size // others)
    if L.dp * others != world_size:
        hint = f"parallel.dp={world_size // others}" if world_size % others == 0 else \
            f"tp*pp*cp dividing {world_size}: {format_choices(divisors(world_size))}"
        raise ConfigError(f"dp*tp*pp*cp = {L.dp}*{L.tp}*{L.pp}*{L.cp} = {L.dp * others} but the world size is "
                          f"{world_size}; valid: {hint} (or parallel.dp=-1)")
    return L


def _check_batch(L: ParallelLayout, global_batch_size: int, micro_batch_size: int) -> None:
    if micro_batch_size < 1 or global_batch_size < 1:
        raise ConfigError(f"train.global_batch_size={global_batch_size} and train.micro_batch_size="
                          f"{micro_batch_size} must be >= 1")
    per_step = micro_batch_size * L.dp
    if global_batch_size % per_step:
        mbs_ok = [m for m in divisors(global_batch_size // L.dp)] if global_batch_size % L.dp == 0 else []
        alt = f"; or micro_batch_size in {format_choices(mbs_ok)}" if mbs_ok else ""
        raise ConfigError(f"train.global_batch_size={global_batch_size} is not divisible by "
                          f"micro_batch_size*dp = {micro_batch_size}*{L.dp} = {per_step}; valid global batch "
                          f"sizes: multiples of {per_step}{alt}")


def _check_schedule(L: ParallelLayout, microbatches: int) -> None:
    try:
        check_args(L.schedule, L.pp, microbatches, L.vpp, L.pp_token_slices)
    except ConfigError as e:
        raise ConfigError(f"parallel.schedule={L.schedule} with {microbatches} micro-batches per step "
                          f"(global_batch_size / (micro_batch_size * dp)): {e}") from None


def validate(layout: ParallelLayout, model: ModelConfig, world_size: int, *,
             global_batch_size: int | None = None, micro_batch_size: int | None = None,
             seq_length: int | None = None, check_implemented: bool = True) -> ParallelLayout:
    """Check every rule; return the layout with dp resolved. Raises ConfigError (one line).
    ``check_implemented=False`` lets the cost model reason about layouts the runtime cannot run yet."""
    model.validate()
    _check_values(layout)
    _check_model(layout, model, seq_length)
    _check_zero(layout)
    for pred, key, what, valid in NOT_IMPLEMENTED:  # before the world size: the more useful message
        if check_implemented and pred(layout):
            raise ConfigError(f"parallel.{key}={getattr(layout, key)}: {what} is not implemented yet; "
                              f"valid: parallel.{key}={valid}")
    resolved = _resolve_dp(layout, world_size)
    _check_expert_ranks(resolved)
    if global_batch_size is not None and micro_batch_size is not None:
        _check_batch(resolved, global_batch_size, micro_batch_size)
        if resolved.pp > 1:
            _check_schedule(resolved, global_batch_size // (micro_batch_size * resolved.dp))
    return resolved
