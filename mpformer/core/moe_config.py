"""The mixture-of-experts part of ModelConfig: which layers are sparse, and its checks.

A sparse layer's MLP is the ``model.mlp_kind`` (the registered "moe" kind, core/layer_spec.py): a
router choosing ``num_experts_per_tok`` of ``num_experts`` experts per token, optionally shared
experts every token goes through. The other layers are dense. Which layers are sparse follows the HF
configs, all three rules at once (each family sets the ones it has):

    layer i is sparse  <=>  num_experts > 0  and  (i + 1) % decoder_sparse_step == 0   (Qwen-MoE)
                            and  i not in mlp_only_layers                            (Qwen-MoE)
                            and  i >= first_k_dense                                  (DeepSeek first_k_dense_replace)

Routers (HF's, one per family):

    softmax   p = softmax(logits); top-k of p; renormalised when norm_topk_prob   (Mixtral, Qwen, OLMoE)
    sigmoid   p = sigmoid(logits); top-k of p + bias (bias picks, never weighs), within the best
              router_topk_groups of router_groups groups (a group's score: the sum of its two best p + bias);
              renormalised when norm_topk_prob; x routed_scaling_factor   (DeepSeek-V3, dots.llm1, GLM-4-MoE)
"""

from __future__ import annotations

from typing import Any

from mpformer.core.errors import ConfigError, format_choices

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "dots1", "glm4_moe")
# The q/k norm each family must have (GLM-4-MoE: per head or none, its use_qk_norm; checked in model_config).
QK_NORM_ARCHS = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "projection", "dots1": "head"}
QK_NORMS = ("head", "projection")
ROUTER_SCORES = ("softmax", "sigmoid")


def is_moe_layer(cfg: Any, layer: int) -> bool:
    return (cfg.num_experts > 0 and (layer + 1) % cfg.decoder_sparse_step == 0
            and layer not in cfg.mlp_only_layers and layer >= cfg.first_k_dense)


def validate_moe(cfg: Any) -> None:
    """The MoE fields on their own, each failure one line naming the key, the rule and what is valid."""
    if cfg.qk_norm is not None and cfg.qk_norm not in QK_NORMS:
        raise ConfigError(f"model.qk_norm={cfg.qk_norm!r} is unknown; valid: null, {format_choices(QK_NORMS)}")
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if e < 0:
        raise ConfigError(f"model.num_experts={e} must be >= 0 (0: a dense model)")
    if cfg.arch in MOE_ARCHS and e == 0:
        raise ConfigError(f"arch={cfg.arch} is a mixture of experts: set model.num_experts >= 1")
    moe_kind = cfg.mlp_kind != "dense"
    if e > 0 and not moe_kind:
        raise ConfigError(f"model.num_experts={e} needs an expert MLP kind: set model.mlp_kind=moe")
    if e == 0:
        if moe_kind and cfg.mlp_kind == "moe":
            raise ConfigError("model.mlp_kind=moe needs model.num_experts >= 1")
        return
    if not 1 <= k <= e:
        raise ConfigError(f"model.num_experts_per_tok={k} must be in [1, num_experts={e}]")
    if cfg.router_score not in ROUTER_SCORES:
        raise ConfigError(f"model.router_score={cfg.router_score!r} is unknown; valid: {format_choices(ROUTER_SCORES)}")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        raise ConfigError(f"model.capacity_factor={cfg.capacity_factor} must be > 0 (null: dropless)")
    if cfg.decoder_sparse_step < 1:
        raise ConfigError(f"model.decoder_sparse_step={cfg.decoder_sparse_step} must be >= 1")
    bad = [i for i in cfg.mlp_only_layers if not 0 <= i < cfg.num_layers]
    if bad:
        raise ConfigError(f"model.mlp_only_layers has {bad} outside [0, num_layers={cfg.num_layers})")
    g, tg = cfg.router_groups, cfg.router_topk_groups
    if g < 1 or e % g or not 1 <= tg <= g or k > tg * (e // g):
        raise ConfigError(f"model.router_groups={g}, router_topk_groups={tg}: groups must divide num_experts={e}, "
                          f"1 <= router_topk_groups <= router_groups, and the eligible experts "
                          f"({tg} x {e // max(g, 1)}) at least num_experts_per_tok={k}")
    if cfg.router_bias_update_rate and not cfg.router_bias:
        raise ConfigError("model.router_bias_update_rate > 0 moves the selection bias: set model.router_bias=true")
    for key in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"model.{key}={getattr(cfg, key)} must be >= 0")
    if cfg.shared_expert_gate and cfg.shared_expert_ffn_size == 0:
        raise ConfigError("model.shared_expert_gate=true needs a shared expert: set model.shared_expert_ffn_size > 0")
    if not any(is_moe_layer(cfg, i) for i in range(cfg.num_layers)):
        raise ConfigError(f"model.num_experts={e} but no layer is sparse (decoder_sparse_step, mlp_only_layers, "
                          "first_k_dense exclude every layer)")
