"""LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM <-> mpformer (arch=llama|mistral|qwen2).

One adapter serves all three because HF gives them the same module tree and parameter names
(``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``model.norm``, ``lm_head``); they differ only in which biases exist
(Llama: optional on attention and MLP; Qwen2: q/k/v always; Mistral: none) and in sliding-window
attention, both of which live in the config. The bias rows below apply exactly when the model
built from the converted config has those biases, so a checkpoint whose biases disagree with its
config.json fails as an unknown or missing key.

No q/k permutation is needed: mpformer's RoPE uses HF's rotate-half convention, and HF stores q, k,
v and gate, up as separate tensors, matching the canonical names one to one.
"""

from __future__ import annotations

from typing import Any

from mpformer.convert.base import StateDictAdapter, one, require
from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.model_config import ModelConfig

L = "model.layers.{i}."
RULES = (
    one("embedding.word.weight", "model.embed_tokens.weight"),
    one("layers.{i}.attn_norm.weight", L + "input_layernorm.weight"),
    *(one(f"layers.{{i}}.attn.{p}.{kind}", f"{L}self_attn.{p}_proj.{kind}")
      for p in ("q", "k", "v", "o") for kind in ("weight", "bias")),
    one("layers.{i}.mlp_norm.weight", L + "post_attention_layernorm.weight"),
    *(one(f"layers.{{i}}.mlp.{p}.{kind}", f"{L}mlp.{p}_proj.{kind}")
      for p in ("gate", "up", "down") for kind in ("weight", "bias")),
    one("final_norm.weight", "model.norm.weight"),
    one("lm_head.weight", "lm_head.weight"),  # only when untied
)

HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = ("default", "llama3")
HF_DEFAULT_WINDOW = 4096  # MistralConfig / Qwen2Config default when config.json omits sliding_window
NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


class LlamaFamilyAdapter(StateDictAdapter):
    def __init__(self, arch: str) -> None:
        super().__init__(
            arch=arch, hf_architecture=HF_CLASSES[arch], model_type=arch, rules=RULES, base_prefix="model.",
            # Rotary tables are recomputed from the config; old Llama files saved them per layer.
            ignored_hf=("model.rotary_emb.inv_freq", L + "self_attn.rotary_emb.inv_freq"),
            tied_hf={"lm_head.weight": "model.embed_tokens.weight"},
        )
        self.name = NAMES[arch]

    # ---- HF -> ModelConfig ------------------------------------------------------------------
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        name = self.name
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{name} hidden_act={act!r} is not supported; valid: silu")
        h, heads = require(hf, "hidden_size", name), require(hf, "num_attention_heads", name)
        head_dim = hf.get("head_dim")
        if self.arch == "llama":
            attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        else:  # fixed by the HF class, not configurable there
            attention_bias, mlp_bias = self.arch == "qwen2", False
        return ModelConfig(
            arch=self.arch,
            num_layers=require(hf, "num_hidden_layers", name),
            hidden_size=h,
            num_attention_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            ffn_hidden_size=require(hf, "intermediate_size", name),
            vocab_size=require(hf, "vocab_size", name),
            max_position_embeddings=require(hf, "max_position_embeddings", name),
            head_dim=None if head_dim is None or head_dim == h // heads else int(head_dim),
            activation="swiglu",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=mlp_bias,
            sliding_window=self._sliding_window(hf),
            hidden_dropout=0.0,  # the HF classes have no hidden dropout
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            init_std=hf.get("initializer_range", 0.02),
            **_rope_from_hf(hf, name),
        ).validate()

    def _sliding_window(self, hf: dict[str, Any]) -> int | None:
        if self.arch == "mistral":
            # MistralForCausalLM applies sliding_window to every layer (it ignores layer_types); a
            # config.json without the key gets MistralConfig's default of 4096, an explicit null none.
            return hf.get("sliding_window", HF_DEFAULT_WINDOW)
        window = hf.get("sliding_window", HF_DEFAULT_WINDOW)
        if self.arch != "qwen2" or not hf.get("use_sliding_window", False) or window is None:
            return None
        n = require(hf, "num_hidden_layers", self.name)
        first = hf.get("max_window_layers", 28)
        types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        if all(t == "full_attention" for t in types):
            return None
        if not all(t == "sliding_attention" for t in types):
            raise ConfigError(f"Qwen2 config.json uses sliding-window attention on some layers only "
                              f"(layer_types={types}); mpformer applies sliding_window to every layer or none")
        return int(window)

    # ---- ModelConfig -> HF ------------------------------------------------------------------
    def config_to_hf(self, cfg: ModelConfig) -> tuple[dict[str, Any], list[str]]:
        out: dict[str, Any] = {
            "architectures": [self.hf_architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size,
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
        if self.arch == "llama":
            out.update(attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
        elif self.arch == "mistral":
            out["sliding_window"] = cfg.sliding_window
        else:  # qwen2: every layer slides (max_window_layers=0) or none does
            sliding = cfg.sliding_window is not None
            out.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window, max_window_layers=0,
                       layer_types=[("sliding_attention" if sliding else "full_attention")] * cfg.num_layers)
        notes = []
        if cfg.hidden_dropout:
            notes.append(f"model.hidden_dropout={cfg.hidden_dropout} has no {self.name} config field and is not "
                         "exported (inference is unaffected)")
        return out, notes


def _rope_from_hf(hf: dict[str, Any], name: str) -> dict[str, Any]:
    """RoPE fields of ModelConfig from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (transformers 4)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(f"{name} config.json has per-layer-type rope_parameters; mpformer supports one RoPE "
                          "for all layers")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"{name} partial_rotary_factor={partial} is not supported; valid: 1.0")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{name} rope type {kind!r} is not supported; valid: {format_choices(ROPE_TYPES)}")
    out: dict[str, Any] = {"rope_theta": float(theta)}
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
    if cfg.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position}
