"""Layer specs: what a transformer block is made of, as data (Megatron-Core's ModuleSpec).

A block is an attention and an MLP, each of a registered *kind*; the linear layers inside them are
of a registered *linear kind*. A kind names the module that builds it and describes its shape to the
models that never build it: the memory model (parameters per rank, activations kept for backward)
and the cost model and partitioner (the GEMMs per token). The module and the description live in one
entry, so a new MLP (experts), a new attention or a new linear (FP8) is one ``register_*`` call and
the models price it without a change.

Torch-free on purpose: the auto-configurator reads the descriptions without importing torch. The
module is a class or a ``"package.module:Name"`` reference imported when a model is built.

    model.mlp_kind / model.attention_kind (ModelConfig)  -> MLPKind / AttentionKind   (registries here)
    ModelOptions.linear_kind                              -> LinearKind
    models/transformer.py Block(spec)                     -> the modules
    autoconfig/memory.py, layer_memory.py, core/partition.py -> the descriptions
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class AttentionShape(Protocol):
    """The model fields an attention kind reads."""

    hidden_size: int
    num_attention_heads: int
    attention_bias: bool

    @property
    def head_size(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def out_proj_bias(self) -> bool: ...


class MLPShape(Protocol):
    """The model fields an MLP kind reads (ModelConfig has them; typed apart so this module stays below it)."""

    hidden_size: int
    mlp_bias: bool

    @property
    def ffn_size(self) -> int: ...

    @property
    def gated_mlp(self) -> bool: ...


@dataclass(frozen=True)
class Projection:
    """One projection's forward GEMM for one token on one tensor-parallel rank: ``k`` inputs to ``n`` outputs."""

    name: str
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.k * self.n


def resolve(module: type | str) -> Any:
    """The class a spec names: itself, or ``"package.module:Name"`` imported now."""
    if not isinstance(module, str):
        return module
    path, _, name = module.partition(":")
    return getattr(importlib.import_module(path), name)


@dataclass(frozen=True)
class SublayerKind:
    """One of a block's two sublayers, described: ``module`` builds one layer's (it has ``forward``,
    ``canonical_shards(prefix)`` and ``parts()``, models/transformer.py); ``part_sizes(cfg, tp)`` its
    parameters' sizes on one tp rank by part, as ``parts()`` groups them, in model order (how the
    engine buckets them and ZeRO-3 makes units); ``projections(cfg, tp)`` its forward GEMMs per
    token; ``saved(cfg, tp)`` the elements per token its backward keeps (at the activation dtype);
    ``tp_plan`` each tensor-parallel submodule's split (models/parallelize.py); ``out_projections``
    the weights that get the depth-scaled initialisation (models/init.py); ``needs`` the further
    contexts (by keyword) the module is built with beyond tp (e.g. "ep": parallel/expert_parallel.py)."""

    name: str
    module: type | str
    part_sizes: Callable[[Any, int], list[list[int]]]
    projections: Callable[[Any, int], list[Projection]]
    saved: Callable[[Any, int], int]
    tp_plan: tuple[tuple[str, str], ...] = ()
    out_projections: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # further contexts its module takes by keyword (experts: "ep")

    def param_sizes(self, cfg: Any, tp: int = 1) -> list[int]:
        return [n for part in self.part_sizes(cfg, tp) for n in part]

    def params(self, cfg: Any, tp: int = 1) -> int:
        return sum(self.param_sizes(cfg, tp))


@dataclass(frozen=True)
class MLPKind(SublayerKind):
    """An MLP: ``module(cfg, tp=, store=, linear=, device=, dtype=)``."""


@dataclass(frozen=True)
class AttentionKind(SublayerKind):
    """An attention: ``module(cfg, tp=, cp=, store=, linear=, device=, dtype=)``. Its description covers
    its projections; the core between them (SDPA on this rank's heads, the same for every kind that
    feeds it q, k and v) the models price themselves."""


@dataclass(frozen=True)
class LinearKind:
    """The linear layers a block's modules build: one device (``plain``), column- and row-parallel."""

    name: str
    plain: type | str
    column: type | str
    row: type | str


# ---- self-attention (layers/attention.py): one fused [q | k | v] projection, then o ---------------
def _heads(m: AttentionShape, tp: int) -> tuple[int, int]:
    """(q, kv) widths on one tp rank: kv heads replicate when tp exceeds them."""
    return m.num_attention_heads * m.head_size // tp, max(m.kv_heads // tp, 1) * m.head_size


def _self_part_sizes(m: AttentionShape, tp: int) -> list[list[int]]:
    (q, kv), h = _heads(m, tp), m.hidden_size
    qkv = [h * (q + 2 * kv)] + ([q + 2 * kv] if m.attention_bias else [])
    qk_norm = getattr(m, "qk_norm", None)
    if qk_norm is not None:  # the per-head gains are whole on every tp rank; the projection's split
        qkv += [m.head_size] * 2 if qk_norm == "head" else [q, kv]
    return [qkv, [q * h] + ([h] if m.out_proj_bias else [])]  # o's bias is whole on every tp rank


def _self_projections(m: AttentionShape, tp: int) -> list[Projection]:
    (q, kv), h = _heads(m, tp), m.hidden_size
    return [Projection("qkv", h, q + 2 * kv), Projection("o", q, h)]


def _self_saved(m: AttentionShape, tp: int) -> int:
    q, kv = _heads(m, tp)
    return 2 * q + 2 * kv  # q, k, v for the core and its output for o (the core's own: the models')


# ---- the dense MLP (layers/mlp.py): gate|up fused (SwiGLU) or up alone (GELU), then down ----------
def _dense_part_sizes(m: MLPShape, tp: int) -> list[list[int]]:
    f, h = m.ffn_size // tp, m.hidden_size
    width = (2 if m.gated_mlp else 1) * f
    up = [h * width] + ([width] if m.mlp_bias else [])
    return [up, [f * h] + ([h] if m.mlp_bias else [])]  # the down bias is whole on every tp rank


def _dense_projections(m: MLPShape, tp: int) -> list[Projection]:
    f, h = m.ffn_size // tp, m.hidden_size
    return [Projection("up", h, (2 if m.gated_mlp else 1) * f), Projection("down", f, h)]


def _dense_saved(m: MLPShape, tp: int) -> int:
    # up's output (gate and up), the activation's output and down's input: 3 f gated, 2 f otherwise
    return (3 if m.gated_mlp else 2) * (m.ffn_size // tp)


# ---- the MoE MLP (layers/moe.py): a router, E experts (gate|up, down), optional shared experts ----------
def _moe_part_sizes(m: Any, tp: int, ep: int = 1, etp: int = 1) -> list[list[int]]:
    """On one rank: the router and shared experts as the dense MLP's (tp-split), the experts E / ep of
    them each split over etp (parallel/expert_parallel.py; ``moe_expert_params`` the experts' part)."""
    h, fs = m.hidden_size, m.shared_expert_ffn_size
    e, f = m.num_experts // ep, m.expert_ffn_size // etp
    first = [m.num_experts * h] + ([h * 2 * fs // tp] if fs else []) + [e * 2 * f * h, e * h * f]
    last = ([fs // tp * h] if fs else []) + ([h] if m.shared_expert_gate else [])
    return [first] + ([last] if last else [])


def moe_expert_params(m: Any, ep: int = 1, etp: int = 1) -> int:
    """The routed experts' parameters on one rank (the ones that reduce over the expert-data group)."""
    return 3 * (m.num_experts // ep) * (m.expert_ffn_size // etp) * m.hidden_size


def _moe_projections(m: Any, tp: int) -> list[Projection]:
    h, f, k, fs = m.hidden_size, m.expert_ffn_size, m.num_experts_per_tok, m.shared_expert_ffn_size
    out = [Projection("router", h, m.num_experts), Projection("experts_up", h, k * 2 * f),
           Projection("experts_down", k * f, h)]
    if fs:
        out += [Projection("shared_up", h, 2 * fs // tp), Projection("shared_down", fs // tp, h)]
    return out


def _moe_saved(m: Any, tp: int) -> int:
    # per token: its k dispatched rows (h each) and 3 f per expert as the dense MLP, the router's fp32
    # probabilities (2 elements each at 16 bits: counted as such) and the combine's k slots
    k, f, h = m.num_experts_per_tok, m.expert_ffn_size, m.hidden_size
    shared = 3 * (m.shared_expert_ffn_size // tp)
    return k * (2 * h + 3 * f) + 2 * m.num_experts + shared


MOE_MLP = MLPKind("moe", "mpformer.layers.moe:MoE", _moe_part_sizes, _moe_projections, _moe_saved,
                  out_projections=("experts.*.down", "shared.down"), needs=("ep",))
DENSE_MLP = MLPKind("dense", "mpformer.layers.mlp:MLP", _dense_part_sizes, _dense_projections, _dense_saved,
                    tp_plan=(("up", "column"), ("down", "row")), out_projections=("down",))
SELF_ATTENTION = AttentionKind("self", "mpformer.layers.attention:Attention", _self_part_sizes, _self_projections,
                               _self_saved, tp_plan=(("", "heads"), ("qkv", "column"), ("o", "row")),
                               out_projections=("o",))
DEFAULT_LINEAR = LinearKind("default", "mpformer.layers.linear:Linear", "mpformer.layers.parallel:ColumnParallelLinear",
                            "mpformer.layers.parallel:RowParallelLinear")

MLP_KINDS: dict[str, MLPKind] = {}
ATTENTION_KINDS: dict[str, AttentionKind] = {}
LINEAR_KINDS: dict[str, LinearKind] = {}


def _register(table: dict, kind: Any, what: str) -> Any:
    if kind.name in table and table[kind.name] is not kind:
        raise ValueError(f"{what} kind {kind.name!r} is registered already")
    table[kind.name] = kind
    return kind


def register_mlp(kind: MLPKind) -> MLPKind:
    return _register(MLP_KINDS, kind, "MLP")


def register_attention(kind: AttentionKind) -> AttentionKind:
    return _register(ATTENTION_KINDS, kind, "attention")


def register_linear(kind: LinearKind) -> LinearKind:
    return _register(LINEAR_KINDS, kind, "linear")


def _lookup(table: dict, name: str, key: str) -> Any:
    if name not in table:
        raise KeyError(f"{key}={name!r} is not a registered kind; valid: {', '.join(sorted(table))}")
    return table[name]


def mlp_kind(name: str) -> MLPKind:
    return _lookup(MLP_KINDS, name, "model.mlp_kind")


def attention_kind(name: str) -> AttentionKind:
    return _lookup(ATTENTION_KINDS, name, "model.attention_kind")


def linear_kind(name: str) -> LinearKind:
    return _lookup(LINEAR_KINDS, name, "linear_kind")


register_mlp(DENSE_MLP)
register_mlp(MOE_MLP)
register_attention(SELF_ATTENTION)
register_linear(DEFAULT_LINEAR)
