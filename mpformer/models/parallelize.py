"""Tensor parallelism as data: a plan per architecture, checked against the model that was built.

Handed a TPContext, the modules build their own parallel layers in their constructors (attention,
MLP, the transformer's embedding and head), each sized to this rank's shard. ``build_model`` builds
them on the meta device, checks that every planned pattern matched and that no single-device
Linear/Embedding stands where the plan wants a parallel one (the block's rows are its kinds'
``tp_plan``, core/layer_spec.py; below, the dense ones), then materialises only this rank's
blocks and fills them from the blocked initialiser (models/init.py), or, ``deferred``, leaves the
parameters on meta for the gradient engine to allocate in its flat buffers (a ZeRO-3 rank: its
shard alone).

    plan row                 built as                         shard rule
    embed                    VocabParallelEmbedding           vocabulary rows, padded to a multiple of tp
    layers.*.attn            (local head counts)              query heads split; kv heads split or replicated
    layers.*.attn.qkv        ColumnParallelLinear [q|k|v]     per part: heads (kv replicated when tp > kv)
    layers.*.attn.o          RowParallelLinear                input columns = query heads
    layers.*.mlp.up          ColumnParallelLinear [gate|up]   ffn rows
    layers.*.mlp.down        RowParallelLinear                input columns = ffn
    lm_head                  VocabParallelHead                vocabulary rows (untied models only)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace

import torch
from torch import nn

from mpformer.context_parallel.context import CPContext
from mpformer.core.layer_spec import attention_kind, linear_kind, mlp_kind, resolve
from mpformer.core.layout import SPLIT_BACKWARD, ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import DEFAULT_OPTIONS, ModelOptions
from mpformer.core.pipeline_plan import StagePlan, stage_plan
from mpformer.layers.linear import WeightGradStore
from mpformer.layers.parallel import VocabParallelEmbedding, VocabParallelHead
from mpformer.models.init import ModelInit, materialise, materialise_buffers
from mpformer.models.transformer import Transformer
from mpformer.parallel.expert_parallel import EPContext
from mpformer.parallel.groups import ProcessGroups
from mpformer.parallel.tensor_parallel import GradSpec, TPContext, kv_replicas


def tp_plan(cfg: ModelConfig, options: ModelOptions = DEFAULT_OPTIONS) -> list[tuple[str, type | str]]:
    """Module-name pattern -> the parallel layer it must be (the attention row: its heads localised).
    The block's rows come from its attention and MLP kinds (core/layer_spec.py), each split ("column",
    "row") built by the linear kind; the embedding and the head are the decoder's own."""
    linear = linear_kind(options.linear_kind)
    splits = {"column": resolve(linear.column), "row": resolve(linear.row), "heads": "heads"}
    rows: list[tuple[str, type | str]] = [("embed", VocabParallelEmbedding)]
    kinds = [("attn", attention_kind(cfg.attention_kind))]
    kinds += [("mlp", mlp_kind(k)) for k in sorted(set(cfg.layer_kinds()))]
    for prefix, kind in kinds:
        rows += [(f"layers.*.{prefix}" + (f".{sub}" if sub else ""), splits[split]) for sub, split in kind.tp_plan]
    return [*rows, ("lm_head", VocabParallelHead)]


def check_tp_plan(model: nn.Module, tp: TPContext) -> None:
    """Every planned module is the parallel layer the plan names (a pipeline stage may lack the
    embedding or the head, and a tied model has no separate head); raise naming the first that is not."""
    cfg: ModelConfig = model.cfg
    modules = dict(model.named_modules())
    for pattern, want in tp_plan(cfg, model.options):
        matched = [n for n in modules if fnmatch.fnmatchcase(n, pattern) and modules[n] is not None]
        absent = {"embed": model.embed is None, "lm_head": model.lm_head is None}.get(pattern, False)
        if not matched and not absent:
            raise AssertionError(f"TP plan row {pattern!r} matched no module")
        for name in matched:
            mod = modules[name]
            if want == "heads":
                assert mod.n_heads * tp.size == cfg.num_attention_heads, f"{name}: heads not localised"
            elif not isinstance(mod, want):
                raise AssertionError(f"TP plan: {name} is a {type(mod).__name__}, wanted {want.__name__}")


def grad_specs(model: nn.Module) -> list[GradSpec]:
    """One spec per parameter block; replicated parameters (norms, position embeddings, row biases)
    are held by every tp rank, and under SP their gradients are partial sums to be all-reduced. Each
    names the view its gradient reduces over: a module's ``grad_view`` attribute for all of its
    parameters (a layer kind whose weights are split over other ranks, as experts are), else "data"."""
    views = {id(p): m.grad_view for m in model.modules() if hasattr(m, "grad_view") for p in m.parameters()}
    return [replace(s, reduce_over=views.get(id(s.param), s.reduce_over)) for s in _tp_specs(model)]


def _tp_specs(model: nn.Module) -> list[GradSpec]:
    tp: TPContext | None = getattr(model, "tp", None)
    if tp is None:
        return [GradSpec(p) for p in model.parameters() if p.requires_grad]
    sp_sync = tp.comm if tp.sequence_parallel else None
    specs: list[GradSpec] = []
    seen: set[int] = set()
    for mod in model.modules():
        if hasattr(mod, "grad_specs") and mod is not model:
            for s in mod.grad_specs():
                specs.append(s)
                seen.add(id(s.param))
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            specs.append(GradSpec(p, None, tp.size, sp_sync))
    return specs


def build_model(cfg: ModelConfig, options: ModelOptions = DEFAULT_OPTIONS, *, tp: TPContext | None,
                device: torch.device, seed: int, stage: StagePlan | None = None, store: WeightGradStore | None = None,
                cp: CPContext | None = None, deferred: bool = False, ep: EPContext | None = None) -> nn.Module:
    """The model for this rank: its pipeline stage's layers, embedding and head (``stage``), its
    tensor-parallel blocks (``tp``), built on the meta device and then allocated and initialised
    block by block (only this rank's blocks are ever drawn) with the single-device model's values;
    ``store`` for a zero-bubble pipeline's split backward; ``options``: how it is built
    (core/model_options.py). ``deferred``: the parameters stay on the meta device (the buffers are
    real) for the gradient engine to place and fill with ``ModelInit(cfg, seed)``; such a model runs
    nothing before that. ``ep``: the expert layers' placement (parallel/expert_parallel.py)."""
    tp = tp if tp is not None and tp.size > 1 else None
    model = Transformer(cfg, options, tp=tp, cp=cp, store=store, stage=stage, device="meta", seed=None, ep=ep)
    if tp is not None:
        check_tp_plan(model, tp)
    if deferred:
        materialise_buffers(model, device)
    else:
        materialise(model, device, ModelInit(cfg, seed))
    return model


@dataclass(frozen=True)
class RankModel:
    """What one rank holds of the model: its module, its tensor- and context-parallel contexts, its
    pipeline stage (the whole model at pp=1) and, for a zero-bubble schedule, the store its linear
    layers defer into."""

    model: nn.Module
    tp: TPContext
    plan: StagePlan | None
    store: WeightGradStore | None
    cp: CPContext | None = None
    init: ModelInit | None = None  # deferred: the parameters are on meta, for the engine to fill from this


def cp_context(layout: ParallelLayout, groups: ProcessGroups) -> CPContext | None:
    """The context-parallel context of ``layout`` (None at cp=1). Collective for hybrid."""
    if layout.cp == 1:
        return None
    comm = groups.comm("cp")
    if layout.cp_kind == "hybrid":
        a2a, ring = groups.cp_subgroups(layout.cp_ulysses)
        return CPContext("hybrid", comm, ulysses=a2a, ring=ring)
    return CPContext(layout.cp_kind, comm, ulysses=comm if layout.cp_kind == "ulysses" else None,
                     ring=comm if layout.cp_kind == "ring" else None)


def build_rank(cfg: ModelConfig, layout: ParallelLayout, groups: ProcessGroups,
               options: ModelOptions = DEFAULT_OPTIONS, *, seq_length: int, seed: int = 0,
               deferred: bool = False) -> RankModel:
    """This rank's part of the model for ``layout``, built the one way the trainer, evaluation and the
    profile share: tp and cp contexts (collective), stage plan, store, then the model (``deferred``:
    its parameters on meta, for the gradient engine to allocate and fill from ``RankModel.init``).
    The layout's recompute mode is the model's: ``options`` carries the rest."""
    options = replace(options, recompute=layout.recompute, recompute_layers=layout.recompute_layers)
    tp = groups.tp_context(kv_replicas(layout.tp, cfg.kv_heads), seed=seed)
    cp = cp_context(layout, groups)
    plan = stage_plan(cfg, layout, groups.coords["pp"], seq_length)
    store = WeightGradStore() if layout.pp > 1 and layout.schedule in SPLIT_BACKWARD else None
    ep = EPContext(groups.view("ep") if layout.ep > 1 else None, layout.ep_dispatcher,
                   layout.etp if layout.etp is not None else layout.tp,
                   groups.view("expert_cp") if layout.cp > 1 else None)
    model = build_model(cfg, options, tp=tp, device=groups.device.torch_device, seed=seed, stage=plan, store=store,
                        cp=cp, deferred=deferred, ep=ep)
    return RankModel(model, tp, plan, store, cp, ModelInit(model.cfg, seed) if deferred else None)
