"""Layers to pipeline stages: uniform, from an explicit split, or balanced by cost.

A split is a list with one entry per global stage (``pp * vpp`` of them, see actions.py for the
stage layout): the number of *transformer layers* on that stage, each >= 1. The embedding (and
anything before the first layer) always lives on stage 0, the final norm and the LM head (and the
loss) on the last stage, in addition to their layers; a split never counts them. Stage s holds
layers ``sum(split[:s]) .. sum(split[:s+1]) - 1``; rank r's chunk c is stage ``c * pp + r``.

``balanced`` minimises the slowest stage for given per-layer costs (the linear-chain partition
problem) by dynamic programming; the embedding's and the head's costs can be charged to the first
and last stage so that those stages get fewer layers. ``parallel.pp_partition=balanced`` uses it
with the model's FLOPs (``model_costs``): with a large vocabulary the last stage gets fewer layers,
as Megatron's ``--decoder-last-pipeline-num-layers`` would be set by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.layer_spec import attention_kind, mlp_kind
from mpformer.core.model_config import ModelConfig


def _check_stages(num_layers: int, stages: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"pipeline stages (pp*vpp) = {stages} must be an integer >= 1")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"num_layers={num_layers} must be an integer >= 1")
    if stages > num_layers:
        raise ConfigError(f"pipeline stages (pp*vpp) = {stages} exceeds num_layers={num_layers}: every stage needs "
                          f"a layer; valid stage counts: 1..{num_layers}")


def uniform(num_layers: int, stages: int) -> list[int]:
    """``num_layers / stages`` layers on every stage; the layers must divide evenly."""
    _check_stages(num_layers, stages)
    if num_layers % stages:
        valid = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ConfigError(f"num_layers={num_layers} cannot be split into {stages} equal stages (pp*vpp); valid "
                          f"stage counts: {format_choices(valid)} (or give parallel.pp_split)")
    return [num_layers // stages] * stages


def from_split(split: Sequence[int], num_layers: int, stages: int) -> list[int]:
    """Validate an explicit split (``parallel.pp_split``): ``stages`` positive counts summing to the layers."""
    _check_stages(num_layers, stages)
    values = list(split)
    ok = len(values) == stages and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in values)
    if not ok or sum(values) != num_layers:
        example = uniform(num_layers, stages) if num_layers % stages == 0 else balanced([1.0] * num_layers, stages)
        raise ConfigError(f"parallel.pp_split={values} is malformed: it needs pp*vpp={stages} positive transformer-"
                          f"layer counts summing to num_layers={num_layers} (embedding and LM head are not "
                          f"counted), e.g. {example}")
    return values


def balanced(costs: Sequence[float], stages: int, *, first_extra: float = 0.0,
             last_extra: float = 0.0) -> list[int]:
    """Layers per stage minimising the maximum stage cost (ties: the earliest optimal split point).

    ``costs[i]`` is layer i's time; ``first_extra``/``last_extra`` are added to the first/last stage
    (embedding, LM head + loss). O(stages * L^2) dynamic program over prefix sums:
    best[k][j] = min over i of max(best[k-1][i], cost(i..j-1)) for the first j layers on k stages.
    """
    n = len(costs)
    _check_stages(n, stages)
    if any(c < 0 for c in costs):
        raise ConfigError(f"layer costs must be >= 0, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(i: int, j: int, k: int) -> float:  # layers i..j-1 as stage k (0-based)
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        # Stage k-1 ends at layer j; the k-1 earlier stages need at least one layer each.
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                val = max(best[k - 1][i], stage_cost(i, j, k - 1))
                if val < best[k][j]:
                    best[k][j], cut[k][j] = val, i
    split, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        split.append(j - i)
        j = i
    return split[::-1]


def model_costs(model: ModelConfig, seq_length: int) -> tuple[list[float], float, float]:
    """Forward FLOPs per token of each transformer layer, and the extras of the first stage (the
    embedding: a lookup, 0) and of the last (the LM head's GEMM, 2 h V); backward scales all alike.

    A layer counts its GEMMs (2 per weight) and attention's two s x s products (4 s d_head n_heads,
    without the causal halving, as Megatron counts them); norms and activations are left out.
    """
    h, d, heads = model.hidden_size, model.head_size, model.num_attention_heads
    kinds = (attention_kind(model.attention_kind), mlp_kind(model.mlp_kind))  # core/layer_spec.py
    gemms = sum(g.flops for kind in kinds for g in kind.projections(model, 1))  # qkv, o; gate+up, down
    layer = float(gemms) + 4.0 * seq_length * d * heads
    return [layer] * model.num_layers, 0.0, 2.0 * h * model.vocab_size


def balanced_for(model: ModelConfig, stages: int, seq_length: int) -> list[int]:
    """``parallel.pp_partition=balanced``: the split minimising the slowest stage under ``model_costs``."""
    costs, first, last = model_costs(model, seq_length)
    return list(_balanced_cached(tuple(costs), stages, first, last))


@lru_cache(maxsize=1024)
def _balanced_cached(costs: tuple[float, ...], stages: int, first: float, last: float) -> tuple[int, ...]:
    return tuple(balanced(costs, stages, first_extra=first, last_extra=last))  # the auto-configurator asks often


def max_stage_cost(split: Sequence[int], costs: Sequence[float], *, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> float:
    """The slowest stage's cost under ``split`` (what ``balanced`` minimises)."""
    out, i = [], 0
    for k, n in enumerate(split):
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == len(split) - 1 else 0.0)
        out.append(sum(costs[i:i + n]) + extra)
        i += n
    return max(out)


def stage_layers(split: Sequence[int], stage: int) -> range:
    """The transformer-layer indices that global stage ``stage`` holds."""
    start = sum(split[:stage])
    return range(start, start + split[stage])


def rank_layers(split: Sequence[int], pp: int, rank: int) -> list[range]:
    """Per chunk c = 0..vpp-1, the layers that ``rank`` holds (global stage c * pp + rank)."""
    if len(split) % pp:
        raise ConfigError(f"a split of {len(split)} stages does not fit pp={pp}; it needs pp*vpp entries")
    return [stage_layers(split, c * pp + rank) for c in range(len(split) // pp)]
