"""LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM <-> mpformer
(arch=llama|mistral|qwen2|qwen3).

One adapter serves all four because HF gives them the same module tree and parameter names
(``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``model.norm``, ``lm_head``); they differ only in which biases exist
(Llama: optional on attention and MLP; Qwen2: q/k/v always; Mistral, Qwen3: none), in Qwen3's
per-head q/k RMSNorms (``self_attn.{q,k}_norm``, [d]) and in sliding-window attention, all of which
live in the config. The bias and norm rows below apply exactly when the model built from the
converted config has those tensors, so a checkpoint whose biases disagree with its config.json
fails as an unknown or missing key. The attention, norm and embedding rows (``ATTENTION_RULES``) and
the config helpers here also serve the MoE families (convert/moe.py).

No q/k permutation is needed: mpformer's RoPE uses HF's rotate-half convention, and HF stores q, k,
v and gate, up as separate tensors, matching the canonical names one to one.
"""

from __future__ import annotations

from typing import Any

from mpformer.convert.base import StateDictAdapter, one, require
from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.model_config import ModelConfig

L = "model.layers.{i}."
# Everything but the MLP: embeddings, attention (q/k norms only where the model has them), norms, head.
ATTENTION_RULES = (
    one("embedding.word.weight", "model.embed_tokens.weight"),
    one("layers.{i}.attn_norm.weight", L + "input_layernorm.weight"),
    *(one(f"layers.{{i}}.attn.{p}.{kind}", f"{L}self_attn.{p}_proj.{kind}")
      for p in ("q", "k", "v", "o") for kind in ("weight", "bias")),
    one("layers.{i}.attn.q_norm.weight", L + "self_attn.q_norm.weight"),
    one("layers.{i}.attn.k_norm.weight", L + "self_attn.k_norm.weight"),
    one("layers.{i}.mlp_norm.weight", L + "post_attention_layernorm.weight"),
    one("final_norm.weight", "model.norm.weight"),
    one("lm_head.weight", "lm_head.weight"),  # only when untied
)
DENSE_MLP_RULES = tuple(one(f"layers.{{i}}.mlp.{p}.{kind}", f"{L}mlp.{p}_proj.{kind}")
                        for p in ("gate", "up", "down") for kind in ("weight", "bias"))
RULES = ATTENTION_RULES + DENSE_MLP_RULES
IGNORED_HF = ("model.rotary_emb.inv_freq", L + "self_attn.rotary_emb.inv_freq")
TIED_HF = {"lm_head.weight": "model.embed_tokens.weight"}

HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "llama3")
HF_DEFAULT_WINDOW = 4096  # MistralConfig / Qwen2Config default when config.json omits sliding_window
NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


class LlamaFamilyAdapter(StateDictAdapter):
    def __init__(self, arch: str) -> None:
        super().__init__(
            arch=arch, hf_architecture=HF_CLASSES[arch], model_type=arch, rules=RULES, base_prefix="model.",
            # Rotary tables are recomputed from the config; old Llama files saved them per layer.
            ignored_hf=IGNORED_HF, tied_hf=dict(TIED_HF),
        )
        self.name = NAMES[arch]

    # ---- HF -> ModelConfig ------------------------------------------------------------------
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        name = self.name
        if self.arch == "llama":
            attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        else:  # fixed by the HF class, not configurable there (Qwen3: configurable, refused when set)
            attention_bias, mlp_bias = self.arch == "qwen2", False
        if self.arch == "qwen3" and hf.get("attention_bias"):
            raise ConfigError("Qwen3 attention_bias=true is not supported; valid: false")
        if self.arch == "mistral":
            # MistralForCausalLM applies sliding_window to every layer (it ignores layer_types); a
            # config.json without the key gets MistralConfig's default of 4096, an explicit null none.
            window = hf.get("sliding_window", HF_DEFAULT_WINDOW)
        elif self.arch in ("qwen2", "qwen3"):
            window = layered_sliding_window(hf, name, lambda i, first: i >= first)
        else:
            window = None
        return ModelConfig(
            **common_from_hf(hf, name, self.arch),
            ffn_hidden_size=require(hf, "intermediate_size", name),
            attention_bias=attention_bias,
            mlp_bias=mlp_bias,
            sliding_window=window,
            qk_norm="head" if self.arch == "qwen3" else None,
        ).validate()

    # ---- ModelConfig -> HF ------------------------------------------------------------------
    def config_to_hf(self, cfg: ModelConfig) -> tuple[dict[str, Any], list[str]]:
        out = common_to_hf(self, cfg)
        out["intermediate_size"] = cfg.ffn_size
        if self.arch == "llama":
            out.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
        elif self.arch == "mistral":
            out["sliding_window"] = cfg.sliding_window
        else:  # qwen2, qwen3: every layer slides (max_window_layers=0) or none does
            out.update(layered_window_to_hf(cfg))
            if self.arch == "qwen3":
                out["attention_bias"] = False
        return out, dropout_notes(cfg, self.name)


def common_from_hf(hf: dict[str, Any], name: str, arch: str, partial_rotary: float | None = None) -> dict[str, Any]:
    """The ModelConfig fields every Llama-like HF config spells alike: sizes, heads, eps, tying, RoPE.
    ``partial_rotary``: the class's default partial_rotary_factor where it rotates part of each head
    (GLM-4-MoE: 0.5); None where the class rotates all of it (the field must then be absent or 1)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{name} hidden_act={act!r} is not supported; valid: silu")
    h, heads = require(hf, "hidden_size", name), require(hf, "num_attention_heads", name)
    head_dim = hf.get("head_dim")
    return dict(
        arch=arch,
        num_layers=require(hf, "num_hidden_layers", name),
        hidden_size=h,
        num_attention_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        vocab_size=require(hf, "vocab_size", name),
        max_position_embeddings=require(hf, "max_position_embeddings", name),
        head_dim=None if head_dim is None or head_dim == h // heads else int(head_dim),
        activation="swiglu",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hidden_dropout=0.0,  # the HF classes have no hidden dropout
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_std=hf.get("initializer_range", 0.02),
        **_rope_from_hf(hf, name, partial_rotary),
    )


def common_to_hf(adapter: StateDictAdapter, cfg: ModelConfig) -> dict[str, Any]:
    """config.json fields of ``common_from_hf``, in transformers 5's and 4's spellings."""
    return {
        "architectures": [adapter.hf_architecture],
        "model_type": adapter.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.attention_dropout,
        "rope_parameters": _rope_to_hf(cfg),
        # transformers 4.x reads these two instead of rope_parameters; 5.x accepts them alongside.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": ({k: v for k, v in _rope_to_hf(cfg).items() if k != "rope_theta"}
                         if cfg.rope_scaling_factor is not None else None),
    }


def dropout_notes(cfg: ModelConfig, name: str) -> list[str]:
    if not cfg.hidden_dropout:
        return []
    return [f"model.hidden_dropout={cfg.hidden_dropout} has no {name} config field and is not exported "
            "(inference is unaffected)"]


def layered_sliding_window(hf: dict[str, Any], name: str, default_slides) -> int | None:
    """Qwen-style windows: ``use_sliding_window`` and per-layer ``layer_types`` (else the class's default
    rule ``default_slides(i, max_window_layers)``); mpformer slides on every layer or none."""
    window = hf.get("sliding_window", HF_DEFAULT_WINDOW)
    if not hf.get("use_sliding_window", False) or not window:
        return None
    n = require(hf, "num_hidden_layers", name)
    first = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" if default_slides(i, first) else "full_attention"
                                      for i in range(n)]
    if all(t == "full_attention" for t in types):
        return None
    if not all(t == "sliding_attention" for t in types):
        raise ConfigError(f"{name} config.json uses sliding-window attention on some layers only "
                          f"(layer_types={types}); mpformer applies sliding_window to every layer or none")
    return int(window)


def layered_window_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    sliding = cfg.sliding_window is not None
    return dict(use_sliding_window=sliding, sliding_window=cfg.sliding_window, max_window_layers=0,
                layer_types=[("sliding_attention" if sliding else "full_attention")] * cfg.num_layers)


def _rope_from_hf(hf: dict[str, Any], name: str, partial_default: float | None = None) -> dict[str, Any]:
    """RoPE fields of ModelConfig from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (transformers 4)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(f"{name} config.json has per-layer-type rope_parameters; mpformer supports one RoPE "
                          "for all layers")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", partial_default or 1.0))
    if partial != 1.0 and partial_default is None:
        raise ConfigError(f"{name} partial_rotary_factor={partial} is not supported; valid: 1.0")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{name} rope type {kind!r} is not supported; valid: {format_choices(ROPE_TYPES)}")
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if partial != 1.0:
        out["partial_rotary_factor"] = float(partial)
    if kind == "llama3":
        try:
            out.update(rope_scaling_factor=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_position=int(rope.get("original_max_position_embeddings",
                                                               hf["max_position_embeddings"])))
        except KeyError as e:
            raise ConfigError(f"{name} llama3 rope scaling lacks {e.args[0]!r}; needs factor, low_freq_factor, "
                              "high_freq_factor, original_max_position_embeddings") from None
    return out


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    partial = {"partial_rotary_factor": cfg.partial_rotary_factor} if cfg.partial_rotary_factor != 1.0 else {}
    if cfg.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta, **partial}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position, **partial}
