"""Hugging Face <-> mpformer checkpoint conversion: one adapter per HF architecture.

    adapter_for_hf_config(config_json) / adapter_for_arch(arch) -> StateDictAdapter
    adapter.config_from_hf(config_json) -> ModelConfig        adapter.config_to_hf(cfg) -> (dict, notes)
    adapter.to_canonical(hf_state, cfg) -> canonical tensors   adapter.to_hf(canonical, cfg) -> hf_state

Whole-folder conversions (the CLI's two commands) are in :mod:`mpformer.convert.io`.
"""

from __future__ import annotations

from typing import Any

from mpformer.convert.base import Rule, StateDictAdapter, Transform
from mpformer.convert.gpt2 import GPT2Adapter
from mpformer.convert.llama import LlamaFamilyAdapter
from mpformer.convert.moe import MoEAdapter
from mpformer.convert.sigmoid_moe import SigmoidMoEAdapter
from mpformer.core.errors import ConfigError, format_choices

# HF class name -> (model_type, mpformer arch). The adapters are cheap; built on request.
SUPPORTED = {
    "GPT2LMHeadModel": ("gpt2", "gpt2"),
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "mistral"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "MixtralForCausalLM": ("mixtral", "mixtral"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "qwen2_moe"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe"),
    "OlmoeForCausalLM": ("olmoe", "olmoe"),
    "Dots1ForCausalLM": ("dots1", "dots1"),
    "Glm4MoeForCausalLM": ("glm4_moe", "glm4_moe"),
}


def adapter_for_arch(arch: str) -> StateDictAdapter:
    """The adapter for an mpformer ``ModelConfig.arch``."""
    if arch == "gpt2":
        return GPT2Adapter()
    if arch in ("llama", "mistral", "qwen2", "qwen3"):
        return LlamaFamilyAdapter(arch)
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return MoEAdapter(arch)
    if arch in ("dots1", "glm4_moe"):
        return SigmoidMoEAdapter(arch)
    raise ConfigError(f"model arch {arch!r} has no HF adapter; valid: "
                      f"{format_choices(a for _, a in SUPPORTED.values())}")


def adapter_for_hf_config(hf: dict[str, Any]) -> StateDictAdapter:
    """Pick the adapter from config.json's ``architectures`` (or ``model_type`` when that is absent)."""
    archs = hf.get("architectures") or []
    if archs:
        if len(archs) != 1 or archs[0] not in SUPPORTED:
            raise ConfigError(f"HF architecture {', '.join(map(str, archs))} is not supported; valid: "
                              f"{format_choices(SUPPORTED)}")
        model_type, arch = SUPPORTED[archs[0]]
        if hf.get("model_type", model_type) != model_type:
            raise ConfigError(f"config.json has architectures={archs} but model_type={hf['model_type']!r}; "
                              f"expected {model_type!r}")
        return adapter_for_arch(arch)
    by_type = {t: a for t, a in SUPPORTED.values()}
    model_type = hf.get("model_type")
    if model_type not in by_type:
        raise ConfigError(f"HF model_type {model_type!r} (no architectures in config.json) is not supported; "
                          f"valid: {format_choices(by_type)}")
    return adapter_for_arch(by_type[model_type])


__all__ = ["SUPPORTED", "GPT2Adapter", "LlamaFamilyAdapter", "MoEAdapter", "Rule", "SigmoidMoEAdapter",
           "StateDictAdapter", "Transform",
           "adapter_for_arch", "adapter_for_hf_config"]
