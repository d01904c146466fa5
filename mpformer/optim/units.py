"""ZeRO stage 3's units and the regions of forward that read them (gather.py runs them).

    embedding   token (and position) embeddings                  region: Transformer.embed_tokens
    layer i     its parts in forward order (Block.parts(): attention norm + qkv, output projection,
                MLP norm + up, down), consecutive parts merged while a unit stays at most
                ``unit_numel`` elements (core/buffers.py zero3_groups): a small layer is one unit,
                hooked on the layer itself; a large one a unit per part, hooked on the part's first
                and last modules
    head        final norm and LM head; a tied head's region reads the embedding's unit as well

The projections of a layer's units (the modules that compute through layers/linear.py's ``linear``)
get the engine as their gradient sink: their weight gradients are formed straight in the unit's
buffer. The embedding's and the head's parameters are not sunk: a tied weight is read twice (the
embedding and the head), and autograd sums its two gradients before handing them on.

Under train.precision=fp8 (tensorwise, delayed) the float8 layers' weights are gathered in float8
(fp8_gather.py): ``fp8`` names them with their layers, and the engine puts them in buckets of their own
(a unit of a norm and a projection is two buckets, gathered by the same region, each reduced on its
own), so that one buffer has one gather dtype. Rowwise layers' weights stay bf16 (fp8_gather.py: why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from mpformer.core.buffers import ZERO3_PREFETCH_NUMEL, ZERO3_REDUCE_NUMEL, ZERO3_UNIT_NUMEL, zero3_groups
from mpformer.optim.gather import Region


@dataclass(frozen=True)
class Zero3Settings:
    """train.zero3_* (elements; what each bounds and why the defaults: core/buffers.py)."""

    unit_numel: float = ZERO3_UNIT_NUMEL
    prefetch_numel: float = ZERO3_PREFETCH_NUMEL
    reduce_numel: float = ZERO3_REDUCE_NUMEL


ZERO3_DEFAULTS = Zero3Settings()


@dataclass(frozen=True)
class Units:
    params: list[list[nn.Parameter]]  # per unit, in model order
    modules: list[nn.Module | None]  # per unit: the layer it holds whole, else None
    regions: list[Region]
    sunk: list[nn.Parameter]  # parameters whose gradients go straight into their unit's buffer
    fp8: dict[int, nn.Module] = field(default_factory=dict)  # id of a weight gathered in float8 -> its layer


def _trainable(modules: Sequence[nn.Module], mine: set[int]) -> list[nn.Parameter]:
    return [p for m in modules for p in m.parameters() if id(p) in mine]


def _float8_gathered(m: nn.Module) -> bool:
    """A layer whose weight is cast with one scale for the whole tensor (fp8_gather.py)."""
    from mpformer.layers.fp8_layer import Float8Layer

    return isinstance(m, Float8Layer) and m.fp8 is not None and m.fp8.name in ("tensorwise", "delayed")


def build_units(model: nn.Module, params: Sequence[nn.Parameter], unit_numel: float) -> Units:
    """The units of ``model`` (a Transformer holding every layer, the embedding and the head)."""
    from mpformer.layers.linear import Linear
    from mpformer.layers.parallel import ColumnParallelLinear, RowParallelLinear

    projections = (Linear, ColumnParallelLinear, RowParallelLinear)
    mine = {id(p) for p in params}
    outside = {k: [p for p in ps if id(p) in mine] for k, ps in model.region_params().items()}
    out = Units([outside["embedding"]], [None], [Region("embedding", (0,), backward_reads=False)], [])
    for i, layer in enumerate(model.layers):
        parts = layer.parts()
        in_parts = sum(len(_trainable(mods, mine)) for _, mods in parts)
        assert in_parts == len(_trainable([layer], mine)), f"layer {i}'s parts miss some of its parameters"
        groups = zero3_groups([sum(p.numel() for p in _trainable(mods, mine)) for _, mods in parts], unit_numel)
        start = len(out.regions)
        for g in groups:
            mods = [m for j in g for m in parts[j][1]]
            whole = len(groups) == 1
            k = len(out.params)
            out.params.append(_trainable(mods, mine))
            out.modules.append(layer if whole else None)
            first, last = (layer, layer) if whole else (mods[0], mods[-1])
            name = f"layers.{i}" + ("" if whole else "." + "+".join(parts[j][0] for j in g))
            out.regions.append(Region(name, (k,), first, last, layer=i, start=start))
            out.sunk.extend(p for m in mods if isinstance(m, projections) for p in m.parameters() if id(p) in mine)
            out.fp8.update((id(m.weight), m) for m in mods if _float8_gathered(m) and id(m.weight) in mine)
    head = len(out.params)
    out.params.append(outside["head"])
    out.modules.append(None)
    tied = model.cfg.tie_embeddings  # the head reads the embedding's weight: its region gathers it
    out.regions.append(Region("head", (head, 0) if tied else (head,)))
    held = sum(len(ps) for ps in out.params)
    assert held == len(params), f"ZeRO-3 units hold {held} of the {len(params)} parameters"
    return out
