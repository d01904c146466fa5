"""Dots1ForCausalLM (dots.llm1) and Glm4MoeForCausalLM (GLM-4.5) <-> mpformer (arch=dots1|glm4_moe).

Both take DeepSeek-V3's MoE block with standard grouped-query attention (no latent attention): a
sigmoid router whose selection bias (``e_score_correction_bias``, fp32) picks but never weighs,
group-limited routing (``n_group`` groups, the best ``topk_group`` by the sum of their two best
biased scores), optional renormalisation (``norm_topk_prob``), ``routed_scaling_factor``, ungated
shared experts of width ``n_shared_experts * moe_intermediate_size``, and dense layers before
``first_k_dense_replace``. mpformer's router (layers/moe.py, router_score=sigmoid, router_bias=true)
does that math; the parity tests hold it to the HF classes. Attention: dots.llm1 has per-head q/k
norms (as Qwen3) and ``attention_bias`` on q, k, v and o; GLM-4-MoE per-head q/k norms when
``use_qk_norm``, ``attention_bias`` on q, k, v only, and RoPE on the first ``partial_rotary_factor``
of each head (model.partial_rotary_factor).

    canonical                                   HF (per-expert: save_pretrained and the hub)
    layers.{i}.mlp.router.weight   [E, h]       mlp.gate.weight
    layers.{i}.mlp.router.bias     [E] buffer   mlp.gate.e_score_correction_bias
    layers.{i}.mlp.experts.{e}.{gate,up,down}   mlp.experts.{e}.{gate,up,down}_proj.weight  (or fused, moe.py)
    layers.{i}.mlp.shared.{gate,up,down}        mlp.shared_experts.{gate,up,down}_proj.weight

The selection bias is a buffer, not a parameter: the converted checkpoint stores it as
``buffers.layers.{i}.mlp.router.bias``, where a training run keeps it (and moves it, with
model.router_bias_update_rate). GLM's multi-token-prediction layers (``num_nextn_predict_layers``:
``model.layers.{num_hidden_layers}.*`` in the hub's files) are not modelled; such a file fails as an
unknown tensor rather than lose them silently.
"""

from __future__ import annotations

from typing import Any

from mpformer.convert.base import StateDictAdapter, one, require
from mpformer.convert.llama import (
    ATTENTION_RULES,
    DENSE_MLP_RULES,
    IGNORED_HF,
    TIED_HF,
    L,
    common_from_hf,
    common_to_hf,
    dropout_notes,
)
from mpformer.convert.moe import FUSED_RULES, QWEN_NAMES, E, _per_expert_rules, detect_fused_experts
from mpformer.core.errors import ConfigError
from mpformer.core.model_config import ModelConfig

HF_CLASSES = {"dots1": "Dots1ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
NAMES = {"dots1": "dots.llm1", "glm4_moe": "GLM-4-MoE"}

BIAS_RULE = one(E + "router.bias", L + "mlp.gate.e_score_correction_bias")
SHARED_RULES = tuple(one(f"{E}shared.{p}.weight", f"{L}mlp.shared_experts.{p}_proj.weight")
                     for p in ("gate", "up", "down"))


class SigmoidMoEAdapter(StateDictAdapter):
    def __init__(self, arch: str) -> None:
        common = ATTENTION_RULES + DENSE_MLP_RULES + SHARED_RULES + (BIAS_RULE,)
        experts = _per_expert_rules("mlp", QWEN_NAMES)
        super().__init__(arch=arch, hf_architecture=HF_CLASSES[arch], model_type=arch, rules=common + experts,
                         base_prefix="model.", ignored_hf=IGNORED_HF, tied_hf=dict(TIED_HF),
                         layouts={"fused": common + FUSED_RULES}, mlp_kinds=("moe",),
                         partial_rotary=arch == "glm4_moe")
        self.name = NAMES[arch]

    def detect_layout(self, hf_state: dict[str, Any]) -> str | None:
        return detect_fused_experts(hf_state)

    # ---- HF -> ModelConfig ------------------------------------------------------------------
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        name, arch = self.name, self.arch
        # GLM-4-MoE's config class defaults partial_rotary_factor to 0.5 when config.json omits it
        common = common_from_hf(hf, name, arch, partial_rotary=0.5 if arch == "glm4_moe" else None)
        experts = require(hf, "n_routed_experts", name)
        width = require(hf, "moe_intermediate_size", name)
        shared = hf.get("n_shared_experts")
        if not isinstance(shared, int) or shared < 1:
            raise ConfigError(f"{name} n_shared_experts={shared} is not supported; valid: an integer >= 1 "
                              "(the HF class always builds the shared experts)")
        return ModelConfig(
            **common,
            ffn_hidden_size=require(hf, "intermediate_size", name),
            moe_ffn_hidden_size=width,
            shared_expert_ffn_size=shared * width,
            first_k_dense=int(hf.get("first_k_dense_replace") or 0),
            attention_bias=bool(hf.get("attention_bias", False)),
            sliding_window=self._sliding_window(hf),
            qk_norm="head" if arch == "dots1" or hf.get("use_qk_norm") else None,
            mlp_kind="moe",
            num_experts=experts,
            num_experts_per_tok=require(hf, "num_experts_per_tok", name),
            norm_topk_prob=bool(hf.get("norm_topk_prob", arch == "glm4_moe")),
            router_score="sigmoid",
            router_bias=True,
            router_groups=int(hf.get("n_group") or 1),
            router_topk_groups=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
        ).validate()

    def _sliding_window(self, hf: dict[str, Any]) -> int | None:
        """dots.llm1 slides on the layers ``layer_types`` names (by default those from max_window_layers on,
        when sliding_window is set); mpformer slides on every layer or none. GLM-4-MoE never slides."""
        if self.arch != "dots1" or not hf.get("sliding_window"):
            return None
        n, first = require(hf, "num_hidden_layers", self.name), hf.get("max_window_layers", 62)
        types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        if all(t == "full_attention" for t in types):
            return None
        if not all(t == "sliding_attention" for t in types):
            raise ConfigError(f"{self.name} config.json uses sliding-window attention on some layers only "
                              f"(layer_types={types}); mpformer applies sliding_window to every layer or none")
        return int(hf["sliding_window"])

    # ---- ModelConfig -> HF ------------------------------------------------------------------
    def check_config(self, cfg: ModelConfig) -> None:
        super().check_config(cfg)
        name = self.name
        fixed = {"router_score": "sigmoid", "router_bias": True, "shared_expert_gate": False,
                 "decoder_sparse_step": 1, "mlp_only_layers": []}
        for key, valid in fixed.items():
            if getattr(cfg, key) != valid:
                raise ConfigError(f"model.{key}={getattr(cfg, key)!r} has no {name} equivalent; valid: {valid!r}")
        shared, width = cfg.shared_expert_ffn_size, cfg.expert_ffn_size
        if shared < width or shared % width:
            raise ConfigError(f"model.shared_expert_ffn_size={shared}: {name} has n_shared_experts experts of "
                              f"width moe_ffn_hidden_size={width}; valid: a positive multiple of {width}")

    def config_to_hf(self, cfg: ModelConfig) -> tuple[dict[str, Any], list[str]]:
        self.check_config(cfg)
        out = common_to_hf(self, cfg)
        out.update(intermediate_size=cfg.ffn_size, moe_intermediate_size=cfg.expert_ffn_size,
                   n_routed_experts=cfg.num_experts, n_shared_experts=cfg.shared_expert_ffn_size // cfg.expert_ffn_size,
                   num_experts_per_tok=cfg.num_experts_per_tok, n_group=cfg.router_groups,
                   topk_group=cfg.router_topk_groups, routed_scaling_factor=cfg.routed_scaling_factor,
                   norm_topk_prob=cfg.norm_topk_prob, first_k_dense_replace=cfg.first_k_dense,
                   attention_bias=cfg.attention_bias, output_router_logits=False)
        if self.arch == "dots1":
            sliding = cfg.sliding_window is not None
            out.update(sliding_window=cfg.sliding_window, max_window_layers=0 if sliding else cfg.num_layers,
                       layer_types=[("sliding_attention" if sliding else "full_attention")] * cfg.num_layers)
        else:
            out.update(use_qk_norm=cfg.qk_norm == "head", num_nextn_predict_layers=0)
            # always written: absent, the class would take 0.5
            out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
        notes = dropout_notes(cfg, self.name)
        for key, what in (("capacity_factor", "HF routes every token: dropless"),
                          ("router_aux_loss_coef", "HF's class has no balancing loss: the selection bias balances"),
                          ("router_z_loss_coef", "a training loss; inference is unaffected")):
            if getattr(cfg, key):
                notes.append(f"model.{key}={getattr(cfg, key)} has no {self.name} config field and is not "
                             f"exported ({what})")
        return out, notes
