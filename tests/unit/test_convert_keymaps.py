"""HF key maps and config mappings, checked against transformers' own classes on tiny configs.

No files and no forward passes: HF models are built on the meta device for their state_dict names
and shapes; ours via ``Transformer(cfg, device="meta")``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers as T

from mpformer.convert import adapter_for_arch, adapter_for_hf_config
from mpformer.convert.base import expected_canonical
from mpformer.core.errors import ConfigError
from mpformer.layers.attention import rope_inv_freq

LLAMA_KW = dict(vocab_size=123, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
GPT2_KW = dict(vocab_size=123, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

VARIANTS = {
    "gpt2": lambda: T.GPT2Config(**GPT2_KW),
    "gpt2-untied": lambda: T.GPT2Config(**GPT2_KW, tie_word_embeddings=False, n_inner=80),
    "llama": lambda: T.LlamaConfig(**LLAMA_KW),
    "llama-tied-biased": lambda: T.LlamaConfig(**LLAMA_KW, tie_word_embeddings=True, attention_bias=True,
                                               mlp_bias=True, rope_parameters=dict(LLAMA3_ROPE)),
    "llama-headdim": lambda: T.LlamaConfig(**{**LLAMA_KW, "head_dim": 8}),
    "mistral": lambda: T.MistralConfig(**LLAMA_KW, sliding_window=8),
    "qwen2": lambda: T.Qwen2Config(**LLAMA_KW),
    "qwen2-swa": lambda: T.Qwen2Config(**LLAMA_KW, use_sliding_window=True, sliding_window=8,
                                       max_window_layers=0),
}


def _hf_state_shapes(hf_cfg) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(hf_cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


def _random_hf_state(adapter, cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in adapter.hf_shapes(cfg).items()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_key_map_is_a_bijection_onto_hf_names(variant):
    hf_cfg = VARIANTS[variant]()
    adapter = adapter_for_hf_config(hf_cfg.to_dict())
    cfg = adapter.config_from_hf(hf_cfg.to_dict())
    hf_shapes = _hf_state_shapes(hf_cfg)
    ours = adapter.hf_shapes(cfg)
    # HF's state_dict also lists the tied head (a second name for wte); nothing else may differ.
    tied = set(adapter.tied_hf) if cfg.tie_embeddings else set()
    assert set(hf_shapes) == set(ours) | tied
    assert {k: hf_shapes[k] for k in ours} == ours
    # Every canonical tensor sits in exactly one row and every HF name in exactly one row.
    rows = adapter.active_rules(cfg)
    canon = [c for r in rows for c in r.canonical]
    hf_names = [h for r in rows for h in r.hf]
    assert sorted(canon) == sorted(expected_canonical(cfg)) and len(set(canon)) == len(canon)
    assert sorted(hf_names) == sorted(ours) and len(set(hf_names)) == len(hf_names)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tensor_round_trip_is_bit_exact(variant):
    hf_cfg = VARIANTS[variant]()
    adapter = adapter_for_hf_config(hf_cfg.to_dict())
    cfg = adapter.config_from_hf(hf_cfg.to_dict())
    state = _random_hf_state(adapter, cfg)
    canonical = adapter.to_canonical(state, cfg)
    assert {k: v.shape for k, v in canonical.items()} == {k: v.shape for k, v in expected_canonical(cfg).items()}
    back = adapter.to_hf(canonical, cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in state)


def test_gpt2_fused_qkv_and_conv1d_transpose_land_where_expected():
    adapter = adapter_for_arch("gpt2")
    cfg = adapter.config_from_hf(T.GPT2Config(**GPT2_KW).to_dict())
    state = _random_hf_state(adapter, cfg)
    c = adapter.to_canonical(state, cfg)
    w, b = state["transformer.h.1.attn.c_attn.weight"], state["transformer.h.1.attn.c_attn.bias"]  # [h, 3h]
    h = cfg.hidden_size
    assert torch.equal(c["layers.1.attn.k.weight"], w[:, h:2 * h].t())
    assert torch.equal(c["layers.1.attn.v.bias"], b[2 * h:])
    assert torch.equal(c["layers.0.mlp.up.weight"], state["transformer.h.0.mlp.c_fc.weight"].t())


def _llama_case():
    adapter = adapter_for_arch("llama")
    cfg = adapter.config_from_hf(T.LlamaConfig(**LLAMA_KW).to_dict())
    return adapter, cfg, _random_hf_state(adapter, cfg)


@pytest.mark.parametrize("key", ["model.layers.0.self_attn.q_proj.lora_A.weight",
                                 "model.layers.0.self_attn.q_proj.bias",  # a bias config.json denies
                                 "model.layers.2.mlp.up_proj.weight"])  # a layer beyond num_hidden_layers
def test_unknown_hf_key_is_named(key):
    adapter, cfg, state = _llama_case()
    state[key] = torch.zeros(4)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        adapter.to_canonical(state, cfg)


def test_missing_hf_key_and_bad_shape_are_named():
    adapter, cfg, state = _llama_case()
    del state["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ConfigError, match=r"lacks tensor model\.layers\.1\.mlp\.down_proj\.weight"):
        adapter.to_canonical(state, cfg)
    adapter, cfg, state = _llama_case()
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)  # 4 kv heads instead of 2
    with pytest.raises(ConfigError, match=r"k_proj\.weight has shape \[64, 64\]; config.json implies \[32, 64\]"):
        adapter.to_canonical(state, cfg)


def test_missing_or_unknown_canonical_tensor_is_named():
    adapter, cfg, state = _llama_case()
    canonical = adapter.to_canonical(state, cfg)
    del canonical["layers.0.attn.v.weight"]
    with pytest.raises(ConfigError, match=r"lacks tensor layers\.0\.attn\.v\.weight"):
        adapter.to_hf(canonical, cfg)
    canonical = adapter.to_canonical(state, cfg)
    canonical["layers.0.attn.q.bias"] = torch.zeros(64)
    with pytest.raises(ConfigError, match=r"has tensor layers\.0\.attn\.q\.bias"):
        adapter.to_hf(canonical, cfg)


def test_tied_head_may_be_present_only_if_equal():
    adapter = adapter_for_arch("gpt2")
    cfg = adapter.config_from_hf(T.GPT2Config(**GPT2_KW).to_dict())
    state = _random_hf_state(adapter, cfg)
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    assert "lm_head.weight" not in adapter.to_canonical(state, cfg)
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ConfigError, match=r"lm_head\.weight differs"):
        adapter.to_canonical(state, cfg)


def test_old_gpt2_files_unprefixed_with_mask_buffers_are_accepted():
    adapter = adapter_for_arch("gpt2")
    cfg = adapter.config_from_hf(T.GPT2Config(**GPT2_KW).to_dict())
    state = _random_hf_state(adapter, cfg)
    old = {k.removeprefix("transformer."): v for k, v in state.items()}
    old.update({"h.0.attn.bias": torch.ones(1, 1, 64, 64), "h.1.attn.masked_bias": torch.tensor(-1e4)})
    new = adapter.to_canonical(state, cfg)
    got = adapter.to_canonical(old, cfg)
    assert got.keys() == new.keys() and all(torch.equal(got[k], new[k]) for k in new)


# ---- config mapping -------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_round_trip_and_hf_accepts_export(variant):
    hf_cfg = VARIANTS[variant]()
    adapter = adapter_for_hf_config(hf_cfg.to_dict())
    cfg = adapter.config_from_hf(hf_cfg.to_dict())
    exported, notes = adapter.config_to_hf(cfg)
    assert notes == []
    reloaded = T.AutoConfig.for_model(**exported)  # transformers itself must accept it
    assert type(reloaded) is type(hf_cfg)
    assert adapter.config_from_hf(reloaded.to_dict()) == cfg
    assert adapter.config_from_hf(exported) == cfg


def test_config_fields_map_as_documented():
    g = adapter_for_arch("gpt2").config_from_hf(T.GPT2Config(**GPT2_KW, resid_pdrop=0.2, embd_pdrop=0.2,
                                                             attn_pdrop=0.3, layer_norm_epsilon=1e-4).to_dict())
    assert (g.activation, g.ffn_size, g.tie_embeddings, g.hidden_dropout, g.attention_dropout, g.norm_eps) == \
        ("gelu_tanh", 256, True, 0.2, 0.3, 1e-4)
    llama = T.LlamaConfig(**LLAMA_KW, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE))
    c = adapter_for_arch("llama").config_from_hf(llama.to_dict())
    assert (c.kv_heads, c.ffn_size, c.rope_theta, c.rope_scaling_factor, c.rope_original_max_position,
            c.tie_embeddings, c.norm_eps) == (2, 96, 500000.0, 8.0, 16, True, 1e-6)
    # Our llama3 inverse frequencies equal HF's for the mapped config.
    hf_inv, _ = T.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](llama)
    torch.testing.assert_close(rope_inv_freq(c), hf_inv, rtol=0, atol=0)
    # transformers 4 layout: rope_theta at top level and rope_scaling.
    v4 = {**LLAMA_KW, "model_type": "llama", "rope_theta": 1234.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32}}
    c4 = adapter_for_hf_config(v4).config_from_hf(v4)
    assert (c4.rope_theta, c4.rope_scaling_factor, c4.rope_original_max_position) == (1234.0, 2.0, 32)
    assert adapter_for_arch("qwen2").config_from_hf(VARIANTS["qwen2-swa"]().to_dict()).sliding_window == 8
    assert adapter_for_arch("qwen2").config_from_hf(VARIANTS["qwen2"]().to_dict()).sliding_window is None
    assert adapter_for_arch("mistral").config_from_hf(VARIANTS["mistral"]().to_dict()).sliding_window == 8


@pytest.mark.parametrize("hf, match", [
    ({"architectures": ["BertForMaskedLM"]}, r"BertForMaskedLM is not supported; valid: GPT2LMHeadModel, "
                                             r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
    ({"model_type": "mixtral"}, r"'mixtral'.*valid: gpt2, llama, mistral, qwen2"),
    ({**LLAMA_KW, "model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     r"rope type 'yarn' is not supported; valid: default, llama3"),
    ({**LLAMA_KW, "model_type": "llama", "hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({**LLAMA_KW, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "max_window_layers": 1}, r"sliding-window attention on some layers only"),
    ({**GPT2_KW, "model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True},
     r"scale_attn_by_inverse_layer_idx=True"),
    ({**GPT2_KW, "model_type": "gpt2", "activation_function": "relu"}, r"activation_function='relu'"),
    ({**GPT2_KW, "model_type": "gpt2", "embd_pdrop": 0.0}, r"embd_pdrop=0.0 differ"),
])
def test_unrepresentable_hf_configs_are_one_line_errors(hf, match):
    with pytest.raises(ConfigError, match=match) as e:
        adapter_for_hf_config(hf).config_from_hf(hf)
    assert "\n" not in str(e.value)
