"""GPT2LMHeadModel <-> mpformer (arch=gpt2).

HF GPT-2 differs from our layout in two explicit ways, both handled by the key map:
  * its linear layers are ``Conv1D`` with weights stored ``[in, out]`` (we use nn.Linear ``[out, in]``):
    every projection weight is transposed;
  * ``attn.c_attn`` fuses q|k|v along its output dim: weight ``[h, 3h]``, bias ``[3h]``, split into
    three canonical tensors.
The head is tied to ``wte`` (``tie_word_embeddings`` defaults to true for GPT-2); HF files may or may
not store ``lm_head.weight`` then. Old files also carry the causal-mask buffers ``attn.bias`` and
``attn.masked_bias``, which are not parameters and are the only keys we ignore.
"""

from __future__ import annotations

from typing import Any

from mpformer.convert.base import TRANSPOSE, Rule, StateDictAdapter, fused, one, require
from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.model_config import ModelConfig

L = "transformer.h.{i}."
RULES = (
    one("embedding.word.weight", "transformer.wte.weight"),
    one("embedding.position.weight", "transformer.wpe.weight"),
    one("layers.{i}.attn_norm.weight", L + "ln_1.weight"),
    one("layers.{i}.attn_norm.bias", L + "ln_1.bias"),
    Rule(("layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"),
         (L + "attn.c_attn.weight",), fused(3, transpose=True)),
    Rule(("layers.{i}.attn.q.bias", "layers.{i}.attn.k.bias", "layers.{i}.attn.v.bias"),
         (L + "attn.c_attn.bias",), fused(3, transpose=False)),
    one("layers.{i}.attn.o.weight", L + "attn.c_proj.weight", TRANSPOSE),
    one("layers.{i}.attn.o.bias", L + "attn.c_proj.bias"),
    one("layers.{i}.mlp_norm.weight", L + "ln_2.weight"),
    one("layers.{i}.mlp_norm.bias", L + "ln_2.bias"),
    one("layers.{i}.mlp.up.weight", L + "mlp.c_fc.weight", TRANSPOSE),
    one("layers.{i}.mlp.up.bias", L + "mlp.c_fc.bias"),
    one("layers.{i}.mlp.down.weight", L + "mlp.c_proj.weight", TRANSPOSE),
    one("layers.{i}.mlp.down.bias", L + "mlp.c_proj.bias"),
    one("final_norm.weight", "transformer.ln_f.weight"),
    one("final_norm.bias", "transformer.ln_f.bias"),
    one("lm_head.weight", "lm_head.weight"),  # only when untied (the row applies if the model has a head)
)

# HF activation names -> ours. "gelu_new" and "gelu_pytorch_tanh" are both the tanh approximation.
ACTIVATIONS_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
ACTIVATIONS_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}

# Flags whose non-default value changes the computation in ways our decoder does not implement.
UNSUPPORTED_FLAGS = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


class GPT2Adapter(StateDictAdapter):
    def __init__(self) -> None:
        super().__init__(
            arch="gpt2", hf_architecture="GPT2LMHeadModel", model_type="gpt2", rules=RULES,
            base_prefix="transformer.",
            ignored_hf=(L + "attn.bias", L + "attn.masked_bias"),
            tied_hf={"lm_head.weight": "transformer.wte.weight"},
        )

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        for key, default in UNSUPPORTED_FLAGS.items():
            if hf.get(key, default) != default:
                raise ConfigError(f"GPT-2 config.json sets {key}={hf[key]}; mpformer supports only {key}={default}")
        act = hf.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS_FROM_HF:
            raise ConfigError(f"GPT-2 activation_function={act!r} is not supported; valid: "
                              f"{format_choices(ACTIVATIONS_FROM_HF)}")
        # One dropout after the embeddings and on each residual branch: HF has two knobs for it.
        resid, embd = hf.get("resid_pdrop", 0.1), hf.get("embd_pdrop", 0.1)
        if resid != embd:
            raise ConfigError(f"GPT-2 resid_pdrop={resid} and embd_pdrop={embd} differ; mpformer has one "
                              "hidden_dropout for both (set them equal in config.json)")
        h = require(hf, "n_embd", "GPT-2")
        n_inner = hf.get("n_inner")
        return ModelConfig(
            arch="gpt2",
            num_layers=require(hf, "n_layer", "GPT-2"),
            hidden_size=h,
            num_attention_heads=require(hf, "n_head", "GPT-2"),
            num_kv_heads=None,
            ffn_hidden_size=None if n_inner is None else int(n_inner),
            vocab_size=require(hf, "vocab_size", "GPT-2"),
            max_position_embeddings=require(hf, "n_positions", "GPT-2"),
            activation=ACTIVATIONS_FROM_HF[act],
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=hf.get("tie_word_embeddings", True),
            attention_bias=True,
            mlp_bias=True,
            hidden_dropout=float(resid),
            attention_dropout=float(hf.get("attn_pdrop", 0.1)),
            init_std=hf.get("initializer_range", 0.02),
        ).validate()

    def config_to_hf(self, cfg: ModelConfig) -> tuple[dict[str, Any], list[str]]:
        return {
            "architectures": [self.hf_architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_position_embeddings,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            # n_inner=None means 4h in HF, as ffn_hidden_size=None does here.
            "n_inner": cfg.ffn_hidden_size,
            "activation_function": ACTIVATIONS_TO_HF[cfg.activation],
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "layer_norm_epsilon": cfg.norm_eps,
            "initializer_range": cfg.init_std,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": cfg.tie_embeddings,
        }, []
