"""Tensor parallelism as data: a plan per architecture, applied by module replacement, then checked.

The model is built on the meta device, each planned module is replaced by its parallel version
(which allocates only this rank's shard), and then the model is materialised and initialised
shard by shard (``build_model``). After the plan is applied, every planned pattern must have
matched and no single-device Linear/Embedding may remain where the plan wanted a parallel one.

    plan row                 replaced by                      shard rule
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
from collections.abc import Callable

import torch
from torch import nn

from mpformer.core.model_config import ModelConfig
from mpformer.core.pipeline_plan import StagePlan
from mpformer.layers.attention import Attention
from mpformer.layers.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from mpformer.parallel.tensor_parallel import GradSpec, Part, TPContext

Style = Callable[[nn.Module, ModelConfig, TPContext], nn.Module | None]


def _vocab_embedding(m: nn.Module, cfg: ModelConfig, tp: TPContext) -> nn.Module:
    return VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, device=m.weight.device, dtype=m.weight.dtype)


def _heads(m: nn.Module, cfg: ModelConfig, tp: TPContext) -> None:
    assert isinstance(m, Attention)
    m.n_heads = cfg.num_attention_heads // tp.size
    m.n_kv = max(1, cfg.kv_heads // tp.size)
    m.q_size, m.kv_size = m.n_heads * m.d, m.n_kv * m.d


def _column_qkv(m: nn.Module, cfg: ModelConfig, tp: TPContext) -> nn.Module:
    d = cfg.head_size
    parts = [Part("q", cfg.num_attention_heads * d, d), Part("k", cfg.kv_heads * d, d), Part("v", cfg.kv_heads * d, d)]
    return ColumnParallelLinear(cfg.hidden_size, parts, tp, bias=m.bias is not None, device=m.weight.device,
                                dtype=m.weight.dtype)


def _column_mlp(m: nn.Module, cfg: ModelConfig, tp: TPContext) -> nn.Module:
    f = cfg.ffn_size
    parts = [Part("gate", f), Part("up", f)] if cfg.gated_mlp else [Part("up", f)]
    return ColumnParallelLinear(cfg.hidden_size, parts, tp, bias=m.bias is not None, device=m.weight.device,
                                dtype=m.weight.dtype)


def _row(m: nn.Module, cfg: ModelConfig, tp: TPContext) -> nn.Module:
    return RowParallelLinear(m.in_features, m.out_features, tp, bias=m.bias is not None, device=m.weight.device,
                             dtype=m.weight.dtype)


def _vocab_head(m: nn.Module, cfg: ModelConfig, tp: TPContext) -> nn.Module:
    return VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp, device=m.weight.device, dtype=m.weight.dtype)


STYLES: dict[str, Style] = {"vocab_embedding": _vocab_embedding, "heads": _heads, "column_qkv": _column_qkv,
                            "column_mlp": _column_mlp, "row": _row, "vocab_head": _vocab_head}
EXPECTED = {"vocab_embedding": VocabParallelEmbedding, "column_qkv": ColumnParallelLinear,
            "column_mlp": ColumnParallelLinear, "row": RowParallelLinear, "vocab_head": VocabParallelHead}

_DECODER_PLAN = [("embed", "vocab_embedding"), ("layers.*.attn", "heads"), ("layers.*.attn.qkv", "column_qkv"),
                 ("layers.*.attn.o", "row"), ("layers.*.mlp.up", "column_mlp"), ("layers.*.mlp.down", "row"),
                 ("lm_head", "vocab_head")]
# One decoder, so one plan; kept per architecture so that a future one can differ.
TP_PLANS: dict[str, list[tuple[str, str]]] = {a: _DECODER_PLAN for a in ("gpt2", "llama", "mistral", "qwen2")}


def apply_tp_plan(model: nn.Module, tp: TPContext) -> None:
    """Replace the planned modules in place; raise if a planned pattern matched nothing (for the
    untied head, only when the model has one) or a planned module kept its single-device type."""
    cfg: ModelConfig = model.cfg
    names = dict(model.named_modules())
    for pattern, style in TP_PLANS[cfg.arch]:
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern) and names[n] is not None]
        # A pipeline stage may hold no embedding / no head, and a tied model has no separate head.
        absent = {"embed": model.embed is None, "lm_head": model.lm_head is None}.get(pattern, False)
        if not matched and not absent:
            raise AssertionError(f"TP plan row {pattern!r} ({style}) matched no module")
        for name in matched:
            new = STYLES[style](names[name], cfg, tp)
            if new is not None:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, new)
    _check_applied(model, tp)
    model.tp = tp
    for layer in model.layers:  # dropout streams (parallel.random) and the SP region need the context
        layer.tp = layer.attn.tp = tp


def _check_applied(model: nn.Module, tp: TPContext) -> None:
    cfg: ModelConfig = model.cfg
    modules = dict(model.named_modules())
    for pattern, style in TP_PLANS[cfg.arch]:
        for name, mod in modules.items():
            if not fnmatch.fnmatchcase(name, pattern):
                continue
            if style == "heads":
                assert mod.n_heads * tp.size == cfg.num_attention_heads, f"{name}: heads not localised"
            elif not isinstance(mod, EXPECTED[style]):
                raise AssertionError(f"TP plan: {name} is still a {type(mod).__name__}, wanted {style}")


def grad_specs(model: nn.Module) -> list[GradSpec]:
    """One spec per parameter block; replicated parameters (norms, position embeddings, row biases)
    are held by every tp rank, and under SP their gradients are partial sums to be all-reduced."""
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


def build_model(cfg: ModelConfig, *, tp: TPContext | None, device: torch.device, seed: int,
                recompute: str = "none", use_apex: bool = False, stage: StagePlan | None = None) -> nn.Module:
    """The model for this rank (its pipeline stage's layers, embedding and head if ``stage``): built
    on meta, parallelised, materialised on ``device``, initialised shard by shard from the same
    per-name generators as the single-device model."""
    from mpformer.models.transformer import Transformer

    part = {} if stage is None else {"layer_ids": stage.layer_ids, "embedding": stage.has_embedding,
                                     "head": stage.has_head}
    if tp is None or tp.size == 1:
        return Transformer(cfg, recompute=recompute, use_apex=use_apex, device=device, seed=seed, **part)
    model = Transformer(cfg, recompute=recompute, use_apex=use_apex, device="meta", seed=None, **part)
    apply_tp_plan(model, tp)
    model.to_empty(device=device)
    model.reset_buffers()
    model.init_weights(seed)
    return model
