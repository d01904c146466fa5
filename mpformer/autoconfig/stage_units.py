"""A pipeline stage's units, as one micro-batch's backward meets them (step_memory.py walks them).

memory.py's plan_memory reads the plan once into ``PlanInputs`` (the layout, the workload, what a
layer and the head hold, how the gradients are reduced) and builds each stage shape's units from it:
the head, each chunk's layers from the last (a layer is several units under mpformer's ZeRO-3), the
embedding; each with its parameters, what it keeps for backward and what its backward adds, and at
ZeRO-3 what the runtime has gathered while it runs (runtimes.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from mpformer.autoconfig.block_memory import HeadLive, LayerLive, slice_kv_bytes
from mpformer.autoconfig.expert_memory import expert_param_sizes
from mpformer.autoconfig.fp8_terms import Fp8Proj, fp8_projections, gathered_bytes
from mpformer.autoconfig.layer_memory import BYTES, shape
from mpformer.autoconfig.runtimes import Runtime, parts_gathered, zero3_extras
from mpformer.autoconfig.step_memory import ReductionSpec, Unit
from mpformer.autoconfig.workload import Workload
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig


@dataclass(frozen=True)
class PlanInputs:
    """What every stage of one plan_memory call reads, computed once."""

    m: ModelConfig
    L: ParallelLayout  # recompute_layers=0 read as no recompute
    w: Workload  # token slices: a slice's sequence
    runtime: Runtime
    device: str
    micro: int  # units in flight per rank per step: micro-batches (token slices: times the slices)
    peaks: tuple[int, ...]  # per pipeline rank, the schedule's peak units in flight
    counts: tuple[int, ...]  # transformer layers per global stage (pp x vpp)
    recomputed: LayerLive  # a layer that recomputes (under L.recompute)
    plain: LayerLive  # a layer that does not
    head: HeadLive
    layer_units: tuple[tuple[int, ...], ...]  # a layer's ZeRO-3 units' parameter sizes, forward order (else one)
    red: ReductionSpec
    # A model whose layers differ in MLP kind (a mixture of experts' sparse and dense layers): each global
    # layer's kind, and per kind (recomputed, plain, layer_units); empty: every layer is the fields' above.
    kinds: tuple[str, ...] = ()
    by_kind: dict = field(default_factory=dict)
    layer_experts: tuple[int, ...] = ()  # the heaviest kind's routed-expert parameter sizes (experts_of)

    @property
    def wb(self) -> int:
        return BYTES[self.w.precision]

    @property
    def fp8_projs(self) -> tuple[Fp8Proj, ...]:
        """A layer's float8 projections on this rank (none unless precision fp8; fp8_terms.py)."""
        if self.w.precision != "fp8":
            return ()
        return fp8_projections(self.m, self.L.tp, self.runtime.fp8)

    @property
    def n_d(self) -> int:
        return self.L.dp * self.L.cp

    @property
    def stage3(self) -> bool:
        return self.L.zero == 3

    @property
    def vocab(self) -> int:
        return -(-self.m.vocab_size // self.L.tp)

    @property
    def embed(self) -> int:
        m = self.m
        return self.vocab * m.hidden_size + (m.max_position_embeddings * m.hidden_size if m.learned_positions else 0)

    @property
    def boundary(self) -> float:
        """Bytes of one activation received or kept at a stage boundary."""
        x = shape(self.m, self.L, self.w.seq_length, self.w.micro_batch_size)
        return self.wb * x.s_r * x.b * self.m.hidden_size

    @property
    def shared_input(self) -> bool:
        """The first layer's norm keeps the stage's input itself (full recompute, a LayerNorm, fp32)."""
        return self.L.recompute == "full" or self.m.norm_type == "layernorm" or self.wb == 4

    @property
    def leaf_grads(self) -> float:
        """Token slices: from a slice's backward until the earlier slices' own, their keys' and values'
        gradients wait in every layer (context_parallel/token_slices.py): k - 1 slices' worth."""
        return slice_kv_bytes(self.m, replace(self.L, recompute="full"), self.w, "full") * (self.L.pp_token_slices - 1)

    def recomputes(self, i: int) -> bool:
        """A chunk's layer i: the first recompute_layers of each chunk recompute (None: all)."""
        return self.L.recompute != "none" and (self.L.recompute_layers is None or i < self.L.recompute_layers)

    def layer(self, i: int, g: int | None = None) -> LayerLive:
        """A chunk's layer i (``g``: its global index, which names its kind)."""
        if g is not None and self.by_kind:
            recomputed, plain, _ = self.by_kind[self.kinds[g]]
            return recomputed if self.recomputes(i) else plain
        return self.recomputed if self.recomputes(i) else self.plain

    def units_of(self, g: int | None = None) -> tuple[tuple[int, ...], ...]:
        """Global layer ``g``'s units (its parameters, as the engine buckets them)."""
        return self.by_kind[self.kinds[g]][2] if g is not None and self.by_kind else self.layer_units

    def experts_of(self, g: int | None = None) -> tuple[int, ...]:
        """Global layer ``g``'s routed-expert parameter sizes (their own buckets, the expert-data group)."""
        if g is not None and self.kinds:
            return expert_param_sizes(self.m, self.L, self.kinds[g])
        return self.layer_experts

    def reruns(self, layer: Hashable | None) -> bool:
        """Whether a unit's layer ((chunk, index); None: the head, the embedding) runs its forward
        again in its backward (full recompute)."""
        return isinstance(layer, tuple) and self.recomputes(layer[1]) and self.L.recompute == "full"


def stage_units(p: PlanInputs, first: bool, last: bool, chunks: tuple[int, ...],
                starts: tuple[int, ...] | None = None) -> list[Unit]:
    """One micro-batch's units in backward order: the head, each chunk's layers from the last, the
    embedding. The schedule's units in flight are (micro-batch, chunk) pairs: the walk runs the last
    chunk's layers; the other chunks' layers only carry their parameters into the gradient buckets. A
    layer's units from its last: its kept activations end with its first, each sees its backward's (the
    layer's peak: conservative for all but the unit where it falls)."""
    m, L, tied = p.m, p.L, p.m.tie_embeddings and first and last
    units: list[Unit] = []
    if last:
        head = [(2 if m.norm_bias else 1) * m.hidden_size] + ([] if tied else [p.vocab * m.hidden_size])
        units.append(Unit("head", head, p.head.saved, 0.0, p.head.backward))
    carry = p.wb * p.vocab * m.hidden_size if tied else 0.0  # the head's dW waits for the embedding's
    leaf_grads = p.leaf_grads
    for c in reversed(range(L.vpp)):
        walked = c == L.vpp - 1
        for i in reversed(range(chunks[c])):
            g = starts[c] + i if starts is not None else None  # its global index (its kind)
            layer, layer_units, experts = p.layer(i, g), p.units_of(g), p.experts_of(g)
            back = layer.backward + leaf_grads * chunks[c]  # token slices: the earlier slices' key/value gradients
            for j in reversed(range(len(layer_units))):
                units.append(Unit("layer", layer_units[j], layer.saved if walked and j == 0 else 0.0,
                                  back if walked else 0.0, carry, layer=(c, i),
                                  expert=_among(layer_units[j], experts)))
    if first:
        units.append(Unit("embedding", [p.embed], 0.0, 0.0, p.wb * p.embed))
    return units


def _among(params: tuple[int, ...], experts: tuple[int, ...]) -> tuple[int, ...]:
    """Of ``experts``' sizes, those a unit's ``params`` hold (a ZeRO-3 layer's parts split them)."""
    left, out = list(params), []
    for n in experts:
        if n in left:
            left.remove(n)
            out.append(n)
    return tuple(out)


@dataclass(frozen=True)
class Gather:
    """What a ZeRO-3 unit's region gathers (elements)."""

    size: float  # its parameters, and the embedding's for a tied head (it reads that weight)
    biggest: float  # its largest parameter (a submodule's)
    reads: bool  # whether its backward reads weights (the embedding's does not)


def gathers(p: PlanInputs, units: list[Unit], tied: bool) -> list[Gather]:
    out = []
    for u in units:
        e = p.embed if u.name == "head" and tied else 0
        out.append(Gather(float(sum(u.params) + e), float(max(*u.params, e)), u.name != "embedding"))
    return out


def with_gathered(p: PlanInputs, units: list[Unit], gathered: list[Gather]) -> list[Unit]:
    """The units with what the ZeRO-3 runtime holds gathered during each one's backward added to their
    ``extra`` (runtimes.py; for a runtime whose buffers step_memory does not walk, those too)."""
    sizes, reads = [g.size for g in gathered], [g.reads for g in gathered]
    if p.runtime.units == "parts":
        nbytes = [gathered_bytes(u.params, p.fp8_projs, p.runtime.fp8, p.wb) if u.name == "layer" else p.wb * g.size
                  for u, g in zip(units, gathered, strict=True)] if p.fp8_projs else None
        held = parts_gathered(sizes, reads, [u.layer for u in units], [p.reruns(u.layer) for u in units],
                              p.runtime.prefetch_numel, nbytes)
        extras = held if nbytes is not None else [p.wb * g for g in held]
    else:
        extras = zero3_extras(p.runtime, sizes, [g.biggest for g in gathered], reads, p.wb, p.n_d)
    return [replace(u, extra=u.extra + e) for u, e in zip(units, extras)]
