"""MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM <-> mpformer
(arch=mixtral|qwen2_moe|qwen3_moe|olmoe).

The attention, norms, embeddings and dense layers map as for Llama (convert/llama.py); a sparse
layer i maps its router and experts (E experts of width f, canonical names of layers/moe.py):

    canonical                              per-expert HF layout (hub files; what export writes)
    layers.{i}.mlp.router.weight   [E, h]  mlp.gate.weight                (Mixtral: block_sparse_moe.gate)
    layers.{i}.mlp.experts.{e}.gate.weight mlp.experts.{e}.gate_proj.weight (Mixtral: block_sparse_moe.experts.{e}.w1)
    layers.{i}.mlp.experts.{e}.up.weight   mlp.experts.{e}.up_proj.weight   (Mixtral: w3)
    layers.{i}.mlp.experts.{e}.down.weight mlp.experts.{e}.down_proj.weight (Mixtral: w2)
    layers.{i}.mlp.shared.{gate,up,down}   mlp.shared_expert.{gate,up,down}_proj (Qwen2-MoE)
    layers.{i}.mlp.shared_gate.weight      mlp.shared_expert_gate.weight        (Qwen2-MoE)

    fused HF layout (transformers 5's module state: ``model.state_dict()``, every family)
    layers.{i}.mlp.router.weight           mlp.gate.weight
    experts.{e}.gate + experts.{e}.up      mlp.experts.gate_up_proj [E, 2f, h]  (expert e: gate rows, then up)
    experts.{e}.down                       mlp.experts.down_proj    [E, h, f]

Import reads either layout (``detect_layout``: fused when the file has ``experts.gate_up_proj`` or
``experts.down_proj`` keys). Export writes the per-expert layout, because it is what every reader
takes: ``save_pretrained`` of transformers 5.25 writes it (its conversion_mapping reverts the fused
parameters on save), ``from_pretrained`` of 5.25 fuses it on load (checked by the parity tests),
transformers 4.x reads only it, and the hub's checkpoints are stored in it. Both layouts are pure
reshuffles, so the round trip is bit-exact.

Config fields (HF's names): num_local_experts (Mixtral; Qwen3-MoE's config.json also spells it so) or
num_experts, num_experts_per_tok, moe_intermediate_size (Qwen; Mixtral and OLMoE: intermediate_size
is the expert width and every layer is sparse), shared_expert_intermediate_size (Qwen2-MoE: always
gated), norm_topk_prob (Mixtral: always true), decoder_sparse_step and mlp_only_layers (Qwen),
router_aux_loss_coef (the same number; HF applies it once to a balancing loss over every layer's tokens
pooled, mpformer to each sparse layer's own, as Megatron does). output_router_logits is ignored;
router_jitter_noise must be 0 and OLMoE's clip_qkv null. Qwen3-MoE has per-head q/k norms, OLMoE norms
over the whole q and k projections; Qwen3-MoE, Mixtral and OLMoE have no biases, Qwen2-MoE q/k/v ones.
Training-only settings with no HF field (capacity_factor, router_z_loss_coef) export with a note.
"""

from __future__ import annotations

from typing import Any

from mpformer.convert.base import Rule, StateDictAdapter, one, require, stacked_experts
from mpformer.convert.llama import (
    ATTENTION_RULES,
    DENSE_MLP_RULES,
    IGNORED_HF,
    TIED_HF,
    L,
    common_from_hf,
    common_to_hf,
    dropout_notes,
    layered_sliding_window,
    layered_window_to_hf,
)
from mpformer.core.errors import ConfigError
from mpformer.core.model_config import ModelConfig

HF_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
NAMES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE"}
# Families whose config has a dense width and sparse-layer pattern (else every layer is sparse).
QWEN = ("qwen2_moe", "qwen3_moe")
E = "layers.{i}.mlp."  # canonical prefix of a layer's MLP


def _per_expert_rules(block: str, names: tuple[str, str, str]) -> tuple[Rule, ...]:
    """Router and experts one tensor per expert: ``{block}.gate.weight``, ``{block}.experts.{e}.<name>``."""
    return (one(E + "router.weight", f"{L}{block}.gate.weight"),
            *(one(f"{E}experts.{{e}}.{p}.weight", f"{L}{block}.experts.{{e}}.{n}.weight")
              for p, n in zip(("gate", "up", "down"), names, strict=True)))


FUSED_RULES = (
    one(E + "router.weight", L + "mlp.gate.weight"),
    Rule((E + "experts.{e}.gate.weight", E + "experts.{e}.up.weight"), (L + "mlp.experts.gate_up_proj",),
         stacked_experts(2)),
    Rule((E + "experts.{e}.down.weight",), (L + "mlp.experts.down_proj",), stacked_experts(1)),
)
SHARED_RULES = (
    *(one(f"{E}shared.{p}.weight", f"{L}mlp.shared_expert.{p}_proj.weight") for p in ("gate", "up", "down")),
    one(E + "shared_gate.weight", L + "mlp.shared_expert_gate.weight"),
)
PER_EXPERT = {"mixtral": _per_expert_rules("block_sparse_moe", ("w1", "w3", "w2"))}
QWEN_NAMES = ("gate_proj", "up_proj", "down_proj")


def detect_fused_experts(hf_state: dict[str, Any]) -> str | None:
    """"fused" when the file holds transformers 5's stacked experts, else None (one tensor per expert)."""
    fused = any(k.endswith((".experts.gate_up_proj", ".experts.down_proj")) for k in hf_state)
    return "fused" if fused else None


class MoEAdapter(StateDictAdapter):
    def __init__(self, arch: str) -> None:
        experts = PER_EXPERT.get(arch) or _per_expert_rules("mlp", QWEN_NAMES)
        common = ATTENTION_RULES + DENSE_MLP_RULES + SHARED_RULES
        super().__init__(arch=arch, hf_architecture=HF_CLASSES[arch], model_type=arch, rules=common + experts,
                         base_prefix="model.", ignored_hf=IGNORED_HF, tied_hf=dict(TIED_HF),
                         layouts={"fused": common + FUSED_RULES}, mlp_kinds=("moe",))
        self.name = NAMES[arch]

    def detect_layout(self, hf_state: dict[str, Any]) -> str | None:
        return detect_fused_experts(hf_state)

    # ---- HF -> ModelConfig ------------------------------------------------------------------
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        name, arch = self.name, self.arch
        jitter = hf.get("router_jitter_noise") or 0.0
        if jitter:
            raise ConfigError(f"{name} router_jitter_noise={jitter} is not supported; valid: 0.0")
        if hf.get("clip_qkv") is not None:
            raise ConfigError(f"{name} clip_qkv={hf['clip_qkv']} is not supported; valid: null")
        if arch == "qwen2_moe" and not hf.get("qkv_bias", True):
            raise ConfigError(f"{name} qkv_bias=false is not supported; valid: true")
        if arch != "qwen2_moe" and hf.get("attention_bias"):
            raise ConfigError(f"{name} attention_bias=true is not supported; valid: false")
        common = common_from_hf(hf, name, arch)
        h, heads = common["hidden_size"], common["num_attention_heads"]
        if arch == "olmoe" and common["head_dim"] is not None:
            raise ConfigError(f"OLMoE head_dim={hf['head_dim']} is not supported; valid: hidden_size / "
                              f"num_attention_heads = {h // heads} (its q/k norms span hidden_size)")
        experts = _num_experts(hf, name)
        width = require(hf, "intermediate_size", name)
        kw: dict[str, Any] = dict(ffn_hidden_size=width, moe_ffn_hidden_size=width)
        if arch in QWEN:
            kw.update(moe_ffn_hidden_size=require(hf, "moe_intermediate_size", name),
                      decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
                      mlp_only_layers=sorted(int(i) for i in hf.get("mlp_only_layers") or []))
        if arch == "qwen2_moe":
            shared = require(hf, "shared_expert_intermediate_size", name)
            if shared < 1:
                raise ConfigError(f"{name} shared_expert_intermediate_size={shared} is not supported; valid: >= 1 "
                                  "(the HF class always builds the shared expert)")
            kw.update(shared_expert_ffn_size=int(shared), shared_expert_gate=True)
        return ModelConfig(
            **common,
            **kw,
            attention_bias=arch == "qwen2_moe",
            sliding_window=self._sliding_window(hf),
            qk_norm={"qwen3_moe": "head", "olmoe": "projection"}.get(arch),
            mlp_kind="moe",
            num_experts=experts,
            num_experts_per_tok=require(hf, "num_experts_per_tok", name),
            norm_topk_prob=True if arch == "mixtral" else bool(hf.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
        ).validate()

    def _sliding_window(self, hf: dict[str, Any]) -> int | None:
        if self.arch == "mixtral":  # every layer (like Mistral); MixtralConfig's default is none
            return hf.get("sliding_window")
        if self.arch == "qwen3_moe":  # every layer when use_sliding_window
            return hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
        if self.arch == "qwen2_moe":  # per layer_types; the class's default slides on even layers only
            return layered_sliding_window(hf, self.name, lambda i, first: (i + 1) % 2 == 1 and i < first)
        return None

    # ---- ModelConfig -> HF ------------------------------------------------------------------
    def check_config(self, cfg: ModelConfig) -> None:
        super().check_config(cfg)
        name, arch = self.name, self.arch
        fixed = {"router_score": "softmax", "router_bias": False, "router_groups": 1, "router_topk_groups": 1,
                 "routed_scaling_factor": 1.0}
        for key, valid in fixed.items():
            if getattr(cfg, key) != valid:
                raise ConfigError(f"model.{key}={getattr(cfg, key)!r} has no {name} equivalent; valid: {valid}")
        if arch == "mixtral" and not cfg.norm_topk_prob:
            raise ConfigError("model.norm_topk_prob=false has no Mixtral equivalent (it always renormalises); "
                              "valid: true")
        shared = (cfg.shared_expert_ffn_size > 0, cfg.shared_expert_gate)
        if shared != ((True, True) if arch == "qwen2_moe" else (False, False)):
            valid = ("shared_expert_ffn_size >= 1 and shared_expert_gate=true" if arch == "qwen2_moe"
                     else "shared_expert_ffn_size=0 and shared_expert_gate=false")
            raise ConfigError(f"model.shared_expert_ffn_size={cfg.shared_expert_ffn_size}, shared_expert_gate="
                              f"{cfg.shared_expert_gate}: {name} needs {valid}")
        if arch not in QWEN and "dense" in cfg.layer_kinds():
            raise ConfigError(f"model.decoder_sparse_step={cfg.decoder_sparse_step}, mlp_only_layers="
                              f"{cfg.mlp_only_layers}, first_k_dense={cfg.first_k_dense} make dense layers, "
                              f"which {name} has not; valid: 1, [], 0")

    def config_to_hf(self, cfg: ModelConfig) -> tuple[dict[str, Any], list[str]]:
        self.check_config(cfg)
        arch = self.arch
        out = common_to_hf(self, cfg)
        experts_key = "num_local_experts" if arch == "mixtral" else "num_experts"
        out.update({experts_key: cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                    "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False})
        if arch == "qwen3_moe":  # transformers 5 spells it num_local_experts, 4.x num_experts
            out["num_local_experts"] = cfg.num_experts
        if arch in QWEN:
            dense = sorted(set(cfg.mlp_only_layers) | set(range(cfg.first_k_dense)))
            out.update(intermediate_size=cfg.ffn_size, moe_intermediate_size=cfg.expert_ffn_size,
                       decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=dense,
                       norm_topk_prob=cfg.norm_topk_prob)
        else:
            out["intermediate_size"] = cfg.expert_ffn_size
        if arch == "mixtral":
            out.update(sliding_window=cfg.sliding_window, router_jitter_noise=0.0)
        elif arch == "qwen2_moe":
            out.update(layered_window_to_hf(cfg), shared_expert_intermediate_size=cfg.shared_expert_ffn_size,
                       qkv_bias=True)
        elif arch == "qwen3_moe":
            out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                       max_window_layers=0, attention_bias=False)
        else:
            out.update(norm_topk_prob=cfg.norm_topk_prob, clip_qkv=None, attention_bias=False)
        notes = dropout_notes(cfg, self.name)
        if cfg.capacity_factor is not None:
            notes.append(f"model.capacity_factor={cfg.capacity_factor} has no {self.name} config field and is not "
                         "exported (HF routes every token: dropless)")
        if cfg.router_z_loss_coef:
            notes.append(f"model.router_z_loss_coef={cfg.router_z_loss_coef} has no {self.name} config field and "
                         "is not exported (a training loss; inference is unaffected)")
        return out, notes


def _num_experts(hf: dict[str, Any], name: str) -> int:
    """``num_experts`` or ``num_local_experts`` (transformers spells it either way per family and version)."""
    values = {hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
    if len(values) > 1:
        raise ConfigError(f"{name} config.json has num_experts={hf['num_experts']} but num_local_experts="
                          f"{hf['num_local_experts']}; they must agree")
    if not values or min(values) < 1:
        raise ConfigError(f"{name} config.json needs num_experts (or num_local_experts) >= 1; got "
                          f"{next(iter(values), None)}")
    return int(values.pop())
