"""train.precision=fp8 on a built model: which linear layers go float8, their checkpointed state, and the
data-parallel agreement on delayed scaling's amaxes (issue 35).

Which layers: every linear layer (``layers.fp8_layer.Float8Layer``: the one-device ``Linear`` and the
tensor-parallel column and row layers; the blocks' projections qkv, o, up, down, a MoE's shared
experts) whose canonical module name matches no ``keep_bf16`` pattern. Names are the layout-free ones
of checkpoints: ``layers.<global index>.attn.qkv``, ``layers.3.mlp.down``, ``embedding.word``,
``lm_head``, ``layers.1.mlp.router`` (a fused projection is one GEMM with one scale, so it is kept or
cast whole; the names of its parts, ``layers.0.attn.q``, also match it). The embedding, the LM head,
the routers are not such layers and stay bf16. The routed experts (``layers.<i>.mlp.experts``: grouped
GEMMs) go float8 in ``apply_expert_fp8`` (layers/fp8_expert_gemm.py) unless a pattern keeps them.

Why the amax all-reduce: under delayed scaling each rank records the amaxes of the tensors it saw, and
data-parallel ranks see different data. Left per rank, their scales drift apart, so the "same" model casts
its weights differently on each replica and a checkpoint (saved from rank 0) resumes other ranks with
scales they never had. Transformer Engine reduces the amaxes over the data-parallel group; here the
histories are all-reduced (max) once per step, which makes every rank's history the elementwise max of
all of them (every rank records the same number of amaxes per step, so positions line up), and the scales
are recomputed from it. (Within a step, the amaxes of tensors split over tensor, sequence or context
parallelism are already reduced over those groups at each cast, layers/fp8_linear.py: those ranks
record the same amaxes.)
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

import torch
from torch import nn

from mpformer.core.errors import ConfigError
from mpformer.core.fp8_config import DEFAULT_KEEP_BF16, Fp8Options
from mpformer.core.shards import Shard
from mpformer.layers.fp8 import ROLES, Float8Recipe, check_fp8_dims, scale_from_amax
from mpformer.layers.fp8_expert_gemm import rescale
from mpformer.layers.fp8_layer import Float8Layer
from mpformer.layers.moe import Experts
from mpformer.parallel.comm import Comm

BUFFERS = ("fp8_amax_history", "fp8_scale")
_FUSED = {"qkv": ("q", "k", "v"), "up": ("gate", "up")}  # a fused projection's canonical parts (one GEMM)


def recipe_of(o: Fp8Options) -> Float8Recipe:
    return Float8Recipe(o.recipe, o.grad_dtype, o.amax_history_len, o.margin)


def canonical_module_names(model: nn.Module, layer_ids: list[int]) -> dict[str, nn.Module]:
    """Canonical module name -> module: module paths with each block's local index replaced by its global
    one (a pipeline stage holds layers 4..7 as ``layers.0..3``), ``embed`` as ``embedding.word`` and
    ``pos_embed`` as ``embedding.position`` (the parameters' canonical prefixes)."""
    out: dict[str, nn.Module] = {}
    for path, m in model.named_modules():
        if not path:
            continue
        name = re.sub(r"^layers\.(\d+)", lambda g: f"layers.{layer_ids[int(g.group(1))]}", path)
        name = re.sub(r"^embed\b", "embedding.word", name)
        out[re.sub(r"^pos_embed\b", "embedding.position", name)] = m
    return out


def apply_fp8(model: nn.Module, options: Fp8Options, layer_ids: list[int],
              canonical: Callable[[], dict[str, Shard]], tokens: tuple[Comm, ...] = ()) -> list[str]:
    """Turn the float8 path on in every linear layer (``Float8Layer``: one-device, column- or
    row-parallel) of ``model`` not kept in bf16; returns their names. ``canonical``: the model's canonical
    parameter names (a fused projection's parts); ``tokens``: the groups that split every sequence
    (context parallelism: the amaxes of activations span them). Raises a
    ConfigError for a ``keep_bf16`` pattern (other than the defaults) that matches nothing and for a
    float8 layer whose dimensions are not multiples of 16."""
    modules = canonical_module_names(model, layer_ids)
    parts = {k.rsplit(".", 1)[0] for k in canonical()}  # layers.0.attn.q, embedding.word, ...
    names = set(modules) | parts
    for pattern in options.keep_bf16:
        if pattern not in DEFAULT_KEEP_BF16 and not fnmatch.filter(names, pattern):
            raise ConfigError(f"train.fp8.keep_bf16 pattern {pattern!r} matches no layer of this model; valid: "
                              "fnmatch patterns on canonical names such as layers.*.attn.qkv, layers.0.mlp.down, "
                              "lm_head, embedding.word")
    recipe, done = recipe_of(options), []
    for name, m in modules.items():
        if not isinstance(m, Float8Layer):
            continue
        parent, _, leaf = name.rpartition(".")
        own = {name} | {f"{parent}.{p}" for p in _FUSED.get(leaf, ())}
        if any(fnmatch.fnmatch(n, pat) for n in own for pat in options.keep_bf16):
            continue
        try:
            check_fp8_dims(name, m.weight.shape[1], m.weight.shape[0])  # this rank's GEMM: its own block
        except ValueError as e:
            raise ConfigError(f"{e}; e.g. train.fp8.keep_bf16=[{','.join(options.keep_bf16)},{name}]") from None
        m.enable_fp8(recipe, tokens)
        done.append(name)
    return done


def fp8_buffers(model: nn.Module, layer_ids: list[int]) -> dict[str, Shard]:
    """Delayed scaling's state by canonical name (``<layer>.fp8_amax_history``, ``<layer>.fp8_scale``),
    whole on every rank, for Transformer.canonical_buffers (checkpoints)."""
    out: dict[str, Shard] = {}
    for name, m in canonical_module_names(model, layer_ids).items():
        if isinstance(m, Float8Layer) and m.fp8 is not None and m.fp8.name == "delayed":
            for b in BUFFERS:
                out[f"{name}.{b}"] = Shard.full(getattr(m, b))
    return out


def delayed_layers(model: nn.Module) -> list[Float8Layer]:
    return [m for m in model.modules() if isinstance(m, Float8Layer) and m.fp8 is not None and m.fp8.name == "delayed"]


def sync_amax_histories(layers: list[Float8Layer], all_reduce_max: Callable[[torch.Tensor], None]) -> None:
    """Every data-parallel rank's amax histories made the elementwise max over the group (one collective
    for all layers), each scale recomputed from its history (see the module docstring)."""
    def rescale_one(m: Float8Layer, hist: torch.Tensor) -> None:
        for i, role in enumerate(ROLES):
            m.fp8_scale[i] = scale_from_amax(hist[i].amax(), m.fp8.dtype(role), m.fp8.margin)

    _histories_max(layers, all_reduce_max, rescale_one)


def _histories_max(modules: list, all_reduce_max: Callable[[torch.Tensor], None],
                   rescale_one: Callable[[nn.Module, torch.Tensor], object]) -> None:
    """Every module's ``fp8_amax_history`` made the elementwise max over the group (one collective for all),
    non-finite entries recorded as 0 (as DelayedScalingState.record), then ``rescale_one(module, history)``."""
    if not modules:
        return
    flat = torch.cat([m.fp8_amax_history.reshape(-1) for m in modules])
    all_reduce_max(flat)
    flat = torch.where(torch.isfinite(flat), flat, torch.zeros_like(flat))
    at = 0
    with torch.no_grad():
        for m in modules:
            hist = m.fp8_amax_history
            hist.copy_(flat[at:at + hist.numel()].view_as(hist))
            at += hist.numel()
            rescale_one(m, hist)

# --- the routed experts (kept apart from apply_fp8: they are no Linear) ------------------------------------

def apply_expert_fp8(model: nn.Module, options: Fp8Options, layer_ids: list[int]) -> list[str]:
    """Turn the float8 path on in every MoE layer's routed experts (``layers.<i>.mlp.experts``) that no
    ``keep_bf16`` pattern matches; returns their names. Their GEMMs' K and N (h, f and 2f) must be
    multiples of 16 (the tokens are padded per expert: layers/fp8_expert_gemm.py)."""
    recipe, done = recipe_of(options), []
    for name, m in canonical_module_names(model, layer_ids).items():
        if not isinstance(m, Experts) or any(fnmatch.fnmatch(name, p) for p in options.keep_bf16):
            continue
        try:
            check_fp8_dims(name, m.h, m.f)
        except ValueError as e:
            raise ConfigError(f"{e}; e.g. train.fp8.keep_bf16=[{','.join(options.keep_bf16)},layers.*.mlp.experts]"
                              ) from None
        m.enable_fp8(recipe)
        done.append(name)
    return done


def delayed_experts(model: nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts) and m.fp8 is not None and m.fp8.name == "delayed"]


def sync_expert_amax_histories(experts: list[Experts], all_reduce_max: Callable[[torch.Tensor], None]) -> None:
    """As ``sync_amax_histories`` for the routed experts' per-expert histories, over the group whose ranks
    hold the same experts (expert-data-parallel: the caller's ``all_reduce_max``)."""
    _histories_max(experts, all_reduce_max, lambda m, hist: rescale(m.fp8, hist, m.fp8_scale))
