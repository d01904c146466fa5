"""Adapter machinery: a declarative key map between canonical mpformer names and HF names.

An adapter is a table of :class:`Rule` rows. Each row ties one or more canonical tensors to one or
more HF tensors through a :class:`Transform` that knows both directions, for example::

    Rule(("layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"),
         ("transformer.h.{i}.attn.c_attn.weight",), SPLIT3_T)

``{i}`` stands for the layer index and ``{e}`` for an expert's. A row whose ``{e}`` patterns sit on both
sides is repeated per expert; one with ``{e}`` on the canonical side only *stacks* the experts: its
canonical tensors are listed expert-major (``experts.0.gate, experts.0.up, experts.1.gate, ...``) and
its transform fuses them into the HF tensors (transformers 5's ``experts.gate_up_proj`` [E, 2f, h]).
An adapter may accept several HF key layouts on import (``layouts``: per-expert and fused experts);
``detect_layout`` picks one by the keys present, and export writes ``rules``.

Which rows apply is decided by the model itself: a row is used when its canonical tensors exist in
``Transformer(cfg).canonical_tensors()`` (built on the meta device, so no memory), which is how
optional biases, untied heads, q/k norms and dense or sparse layers are handled without conditions
in the tables. Conversion in either direction then demands an exact match: an HF key
that no row, tied alias or listed buffer explains, or a tensor a row needs that is absent, is a
ConfigError naming the key. Transforms are pure reshuffles (transpose, split, concatenate, stack), so a
round trip reproduces every byte.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.model_config import ModelConfig

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Transform:
    """A pair of inverse functions between a row's canonical tensors and its HF tensors."""

    name: str
    to_hf: Callable[[Tensors], Tensors]
    to_canonical: Callable[[Tensors], Tensors]


IDENTITY = Transform("identity", lambda ts: list(ts), lambda ts: list(ts))
# HF GPT-2 uses Conv1D, whose weight is [in, out]; ours are nn.Linear [out, in].
TRANSPOSE = Transform("transpose", lambda ts: [ts[0].t().contiguous()], lambda ts: [ts[0].t().contiguous()])


def _chunk(t: torch.Tensor, parts: int, dim: int) -> Tensors:
    if t.shape[dim] % parts:
        raise ConfigError(f"cannot split a tensor of shape {list(t.shape)} into {parts} equal parts on dim {dim}")
    return [c.contiguous() for c in t.chunk(parts, dim=dim)]


def fused(parts: int, *, transpose: bool) -> Transform:
    """Canonical [q, k, v]-style tensors <-> one HF tensor that concatenates them on the output dim.

    Weights (``transpose=True``, GPT-2 Conv1D): HF ``[h_in, parts*out]`` <-> ``parts x [out, h_in]``.
    Biases (``transpose=False``): HF ``[parts*out]`` <-> ``parts x [out]``. Equal parts only: the
    one fused HF layout we read (GPT-2 c_attn) has no grouped-query heads.
    """
    if transpose:
        return Transform(f"fused{parts}_t", lambda ts: [torch.cat(ts, dim=0).t().contiguous()],
                         lambda ts: _chunk(ts[0].t(), parts, 0))
    return Transform(f"fused{parts}", lambda ts: [torch.cat(ts, dim=0)], lambda ts: _chunk(ts[0], parts, 0))


def stacked_experts(parts: int) -> Transform:
    """Canonical per-expert tensors (expert-major, ``parts`` per expert, each ``[r, c]``) <-> one HF tensor
    ``[E, parts*r, c]``: expert e's parts concatenated on the rows (gate then up, as transformers 5's
    ``gate_up_proj``), experts stacked on dim 0. E and r are read from the tensors."""

    def to_hf(ts: Tensors) -> Tensors:
        return [torch.stack([torch.cat(ts[e:e + parts], dim=0) for e in range(0, len(ts), parts)])]

    def to_canonical(ts: Tensors) -> Tensors:
        return [c for expert in ts[0].unbind(0) for c in _chunk(expert, parts, 0)]

    return Transform(f"stacked{parts}", to_hf, to_canonical)


@dataclass(frozen=True)
class Rule:
    """One row of a key map: canonical name patterns <-> HF name patterns, and the transform."""

    canonical: tuple[str, ...]
    hf: tuple[str, ...]
    transform: Transform = IDENTITY

    def expand(self, num_layers: int, num_experts: int = 0) -> Iterator[Rule]:
        """Concrete rows: one per layer when the patterns contain ``{i}``; one per expert when both sides
        contain ``{e}``; one listing every expert's canonical tensors when only the canonical side does."""
        layers = range(num_layers) if any("{i}" in p for p in self.canonical + self.hf) else [None]
        canon_e, hf_e = any("{e}" in p for p in self.canonical), any("{e}" in p for p in self.hf)
        assert not hf_e or canon_e, f"key map row {self} names an expert on the HF side only"
        for i in layers:
            if not canon_e:
                yield Rule(tuple(p.format(i=i) for p in self.canonical), tuple(p.format(i=i) for p in self.hf),
                           self.transform)
            elif hf_e:
                for e in range(num_experts):
                    yield Rule(tuple(p.format(i=i, e=e) for p in self.canonical),
                               tuple(p.format(i=i, e=e) for p in self.hf), self.transform)
            elif num_experts:
                yield Rule(tuple(p.format(i=i, e=e) for e in range(num_experts) for p in self.canonical),
                           tuple(p.format(i=i) for p in self.hf), self.transform)


def one(canonical: str, hf: str, transform: Transform = IDENTITY) -> Rule:
    return Rule((canonical,), (hf,), transform)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    escaped = re.escape(pattern)
    for key in ("{i}", "{e}"):
        escaped = escaped.replace(re.escape(key), r"\d+")
    return re.compile(escaped + r"\Z")


def _meta_model(cfg: ModelConfig):
    from mpformer.models.transformer import Transformer  # late: keeps key-map imports light

    return Transformer(cfg, device="meta", seed=None)


def expected_canonical(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical name -> meta tensor (shape and no storage) of the model this config builds: its
    parameters and the buffers a checkpoint keeps (a router's selection bias, HF's
    ``e_score_correction_bias``, which HF files store beside the weights)."""
    model = _meta_model(cfg)
    return {**model.canonical_tensors(), **{k: sh.local for k, sh in model.canonical_buffers().items()}}


def canonical_buffer_names(cfg: ModelConfig) -> set[str]:
    """The canonical names of ``expected_canonical`` that are buffers (stored as ``buffers.*``)."""
    return set(_meta_model(cfg).canonical_buffers())


@dataclass
class StateDictAdapter:
    """Key map plus config mapping for one HF architecture (subclasses fill the tables)."""

    arch: str  # mpformer ModelConfig.arch
    hf_architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # config.json "model_type"
    rules: tuple[Rule, ...]
    base_prefix: str  # "transformer." / "model.": files saved from the headless base model lack it
    # HF tensors that are not parameters (old causal-mask buffers, rotary tables): ignored, by pattern.
    ignored_hf: tuple[str, ...] = ()
    # With tied embeddings HF may or may not store the head; when present it must equal its source.
    tied_hf: dict[str, str] = field(default_factory=dict)
    # Other key layouts import accepts (name -> rows; detect_layout picks one); export writes ``rules``.
    layouts: dict[str, tuple[Rule, ...]] = field(default_factory=dict)
    mlp_kinds: tuple[str, ...] = ("dense",)  # the model.mlp_kind values the key map covers
    partial_rotary: bool = False  # the HF class can rotate part of each head (config partial_rotary_factor)

    # ---- config mapping (per architecture) --------------------------------------------------
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        raise NotImplementedError

    def config_to_hf(self, cfg: ModelConfig) -> tuple[dict[str, Any], list[str]]:
        """HF config.json fields for ``cfg`` and notes about settings HF has no place for."""
        raise NotImplementedError

    def check_config(self, cfg: ModelConfig) -> None:
        """Refuse, in one line, a config this HF class cannot express (before any key map is built)."""
        if cfg.mlp_kind not in self.mlp_kinds or cfg.attention_kind != "self":
            raise ConfigError(f"model.mlp_kind={cfg.mlp_kind!r}, attention_kind={cfg.attention_kind!r}: the "
                              f"{self.hf_architecture} key map covers mlp_kind "
                              f"{format_choices(self.mlp_kinds)} with self-attention only; valid: mlp_kind="
                              f"{format_choices(self.mlp_kinds)}, attention_kind=self")
        if cfg.partial_rotary_factor != 1.0 and not self.partial_rotary:
            raise ConfigError(f"model.partial_rotary_factor={cfg.partial_rotary_factor} has no "
                              f"{self.hf_architecture} equivalent (it rotates whole heads); valid: 1.0")

    # ---- key map ---------------------------------------------------------------------------------
    def detect_layout(self, hf_state: dict[str, torch.Tensor]) -> str | None:
        """The name of the ``layouts`` entry these HF keys are in, or None for the default ``rules``."""
        return None

    def rules_for(self, layout: str | None) -> tuple[Rule, ...]:
        if layout is None:
            return self.rules
        if layout not in self.layouts:
            raise ConfigError(f"{self.hf_architecture} has no key layout {layout!r}; valid: "
                              f"{format_choices(self.layouts)}")
        return self.layouts[layout]

    def active_rules(self, cfg: ModelConfig, layout: str | None = None) -> list[Rule]:
        """The concrete rows for this config; asserts that they cover every canonical tensor once."""
        self.check_config(cfg)
        expected = expected_canonical(cfg)
        active, covered = [], []
        rows = self.rules_for(layout)
        for rule in (r for row in rows for r in row.expand(cfg.num_layers, cfg.num_experts)):
            present = [n in expected for n in rule.canonical]
            if all(present):
                active.append(rule)
                covered.extend(rule.canonical)
            else:
                assert not any(present), f"{self.arch} key map row {rule} is partly present"
        assert len(covered) == len(set(covered)), f"{self.arch} key map maps a canonical tensor twice"
        uncovered = sorted(set(expected) - set(covered))
        assert not uncovered, f"{self.arch} key map has no row for {uncovered[0]}"
        return active

    def hf_shapes(self, cfg: ModelConfig, layout: str | None = None) -> dict[str, torch.Size]:
        """HF name -> shape of every HF tensor this config needs (tied head excluded)."""
        meta = expected_canonical(cfg)
        out: dict[str, torch.Size] = {}
        for rule in self.active_rules(cfg, layout):
            hf_ts = rule.transform.to_hf([meta[n] for n in rule.canonical])
            out.update({n: t.shape for n, t in zip(rule.hf, hf_ts, strict=True)})
        return out

    def canonical_to_hf_names(self, cfg: ModelConfig, layout: str | None = None) -> dict[str, tuple[str, ...]]:
        """For tests and messages: each canonical name -> the HF names of its row."""
        return {c: rule.hf for rule in self.active_rules(cfg, layout) for c in rule.canonical}

    def _with_base_prefix(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Files written by the headless base class (e.g. the original openai-community/gpt2) name
        # tensors "h.0..." rather than "transformer.h.0...": add the prefix, as HF's loader does.
        if any(k.startswith(self.base_prefix) for k in state):
            return state
        heads = set(self.tied_hf) | {"lm_head.weight"}
        return {(k if k in heads else self.base_prefix + k): v for k, v in state.items()}

    # ---- the two directions --------------------------------------------------------------------
    def to_canonical(self, hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """HF state dict -> canonical tensors, stored dtypes kept. Unknown or missing keys raise. The key
        layout (e.g. per-expert or fused experts) is the one ``detect_layout`` finds."""
        state = self._with_base_prefix(hf_state)
        layout = self.detect_layout(state)
        shapes = self.hf_shapes(cfg, layout)
        extra = set(state) - set(shapes)
        if cfg.tie_embeddings:
            for alias, source in self.tied_hf.items():
                if alias in extra:
                    extra.discard(alias)
                    if source in state and not torch.equal(state[alias], state[source]):
                        raise ConfigError(f"tie_word_embeddings is true but HF tensor {alias} differs from "
                                          f"{source}; the checkpoint is not tied")
        ignored = [_pattern_regex(p) for p in self.ignored_hf]
        unknown = sorted(k for k in extra if not any(r.match(k) for r in ignored))
        if unknown:
            raise ConfigError(f"HF tensor {unknown[0]} is not in the {self.hf_architecture} key map for this "
                              f"config.json ({len(unknown)} unknown in all); refusing to drop weights")
        missing = sorted(set(shapes) - set(state))
        if missing:
            raise ConfigError(f"HF checkpoint lacks tensor {missing[0]} ({len(missing)} missing in all), "
                              f"which {self.hf_architecture} with this config.json needs")
        for name, shape in shapes.items():
            if state[name].shape != shape:
                raise ConfigError(f"HF tensor {name} has shape {list(state[name].shape)}; config.json implies "
                                  f"{list(shape)}")
        out: dict[str, torch.Tensor] = {}
        for rule in self.active_rules(cfg, layout):
            ts = rule.transform.to_canonical([state[n] for n in rule.hf])
            out.update(zip(rule.canonical, ts, strict=True))
        _check_canonical(out, cfg, "converted HF checkpoint")
        return out

    def to_hf(self, canonical: dict[str, torch.Tensor], cfg: ModelConfig,
              layout: str | None = None) -> dict[str, torch.Tensor]:
        """Canonical tensors -> HF state dict (tied head omitted, as save_pretrained does), in the default
        key layout unless ``layout`` names another."""
        self.check_config(cfg)
        _check_canonical(canonical, cfg, "mpformer checkpoint")
        out: dict[str, torch.Tensor] = {}
        for rule in self.active_rules(cfg, layout):
            ts = rule.transform.to_hf([canonical[n] for n in rule.canonical])
            out.update({n: t.contiguous() for n, t in zip(rule.hf, ts, strict=True)})
        return out


def _check_canonical(tensors: dict[str, torch.Tensor], cfg: ModelConfig, what: str) -> None:
    """Exactly the canonical tensors ``cfg`` builds, with their shapes; else name the first offender."""
    expected = expected_canonical(cfg)
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ConfigError(f"{what} has tensor {unknown[0]} that a {cfg.arch} model with this config lacks "
                          f"({len(unknown)} unknown in all)")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ConfigError(f"{what} lacks tensor {missing[0]} ({len(missing)} missing in all)")
    for name, meta in expected.items():
        if tensors[name].shape != meta.shape:
            raise ConfigError(f"{what}: tensor {name} has shape {list(tensors[name].shape)}, the model config "
                              f"needs {list(meta.shape)}")


def hf_dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    """The dtype most floating tensors have, as config.json writes it ("float32", "bfloat16")."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    if not counts:
        return "float32"
    return str(max(counts, key=lambda d: counts[d])).removeprefix("torch.")


def require(hf: dict[str, Any], key: str, arch: str) -> Any:
    """A config.json field the mapping cannot default."""
    if hf.get(key) is None:
        raise ConfigError(f"{arch} config.json lacks {key!r}, which the conversion needs")
    return hf[key]
