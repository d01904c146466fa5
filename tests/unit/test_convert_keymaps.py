"""HF key maps and config mappings, checked against transformers' own classes on tiny configs.

No files and no forward passes: HF models are built on the meta device for their state_dict names
and shapes; ours via ``Transformer(cfg, device="meta")``.
"""

from __future__ import annotations

import dataclasses
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
MOE_KW = dict(vocab_size=123, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2, eos_token_id=2)
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
    "qwen3": lambda: T.Qwen3Config(**LLAMA_KW, head_dim=32, tie_word_embeddings=True),
    "qwen3-swa": lambda: T.Qwen3Config(**LLAMA_KW, head_dim=16, use_sliding_window=True, sliding_window=8,
                                       max_window_layers=0),
    "mixtral": lambda: T.MixtralConfig(**MOE_KW, intermediate_size=32, num_local_experts=8),
    "mixtral-swa": lambda: T.MixtralConfig(**MOE_KW, intermediate_size=32, num_local_experts=4,
                                           sliding_window=8, head_dim=32),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(**MOE_KW, intermediate_size=96, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, num_experts=8, mlp_only_layers=[1]),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(**{**MOE_KW, "num_hidden_layers": 4}, intermediate_size=96,
                                          moe_intermediate_size=32, num_experts=8, decoder_sparse_step=2,
                                          norm_topk_prob=True, head_dim=32),
    "olmoe": lambda: T.OlmoeConfig(**MOE_KW, intermediate_size=32, num_experts=8, tie_word_embeddings=True),
    "dots1": lambda: T.Dots1Config(**MOE_KW, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                   n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1),
    "glm4_moe": lambda: T.Glm4MoeConfig(**MOE_KW, intermediate_size=96, moe_intermediate_size=32,
                                        n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=1),
}
MOE = ("mixtral", "mixtral-swa", "qwen2_moe", "qwen3_moe", "olmoe", "dots1", "glm4_moe")


def _hf_state_shapes(hf_cfg) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(hf_cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


def _random_hf_state(adapter, cfg, seed: int = 0, layout: str | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in adapter.hf_shapes(cfg, layout).items()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_key_map_is_a_bijection_onto_hf_names(variant):
    """Against the module tree of transformers 5, whose MoE experts are fused (the per-expert layout
    that save_pretrained writes is checked against real files in tests/integration/test_hf_moe_parity.py)."""
    hf_cfg = VARIANTS[variant]()
    adapter = adapter_for_hf_config(hf_cfg.to_dict())
    cfg = adapter.config_from_hf(hf_cfg.to_dict())
    hf_shapes = _hf_state_shapes(hf_cfg)
    layout = adapter.detect_layout(hf_shapes)
    assert layout == ("fused" if variant in MOE else None)
    ours = adapter.hf_shapes(cfg, layout)
    # HF's state_dict also lists the tied head (a second name for wte); nothing else may differ.
    tied = set(adapter.tied_hf) if cfg.tie_embeddings else set()
    assert set(hf_shapes) == set(ours) | tied
    assert {k: hf_shapes[k] for k in ours} == ours
    # Every canonical tensor sits in exactly one row and every HF name in exactly one row.
    for lay in (None, *adapter.layouts):
        rows = adapter.active_rules(cfg, lay)
        canon = [c for r in rows for c in r.canonical]
        hf_names = [h for r in rows for h in r.hf]
        assert sorted(canon) == sorted(expected_canonical(cfg)) and len(set(canon)) == len(canon)
        assert sorted(hf_names) == sorted(adapter.hf_shapes(cfg, lay)) and len(set(hf_names)) == len(hf_names)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tensor_round_trip_is_bit_exact(variant):
    hf_cfg = VARIANTS[variant]()
    adapter = adapter_for_hf_config(hf_cfg.to_dict())
    cfg = adapter.config_from_hf(hf_cfg.to_dict())
    for layout in (None, *adapter.layouts):
        state = _random_hf_state(adapter, cfg, layout=layout)
        assert adapter.detect_layout(state) == layout
        canonical = adapter.to_canonical(state, cfg)
        assert {k: v.shape for k, v in canonical.items()} == \
            {k: v.shape for k, v in expected_canonical(cfg).items()}
        back = adapter.to_hf(canonical, cfg, layout)
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
                                             r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                             r"Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
                                             r"Qwen3MoeForCausalLM, OlmoeForCausalLM"),
    ({"model_type": "deepseek_v3"}, r"'deepseek_v3'.*valid: gpt2, llama, mistral, qwen2, qwen3, mixtral, "
                                    r"qwen2_moe, qwen3_moe, olmoe"),
    ({**LLAMA_KW, "model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     r"rope type 'yarn' is not supported; valid: default, llama3"),
    ({**LLAMA_KW, "model_type": "llama", "hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({**LLAMA_KW, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "max_window_layers": 1}, r"sliding-window attention on some layers only"),
    ({**GPT2_KW, "model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True},
     r"scale_attn_by_inverse_layer_idx=True"),
    ({**GPT2_KW, "model_type": "gpt2", "activation_function": "relu"}, r"activation_function='relu'"),
    ({**GPT2_KW, "model_type": "gpt2", "embd_pdrop": 0.0}, r"embd_pdrop=0.0 differ"),
    ({**LLAMA_KW, "model_type": "qwen3", "attention_bias": True}, r"Qwen3 attention_bias=true .*valid: false"),
    *(({**VARIANTS[v]().to_dict(), **extra}, match) for v, extra, match in (
        ("mixtral", {"router_jitter_noise": 0.1}, r"Mixtral router_jitter_noise=0.1 is not supported; valid: 0.0"),
        ("olmoe", {"clip_qkv": 8.0}, r"OLMoE clip_qkv=8.0 is not supported; valid: null"),
        ("olmoe", {"head_dim": 32}, r"OLMoE head_dim=32 is not supported"),
        ("qwen2_moe", {"qkv_bias": False}, r"Qwen2-MoE qkv_bias=false is not supported; valid: true"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size=0 .*valid: >= 1"),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "layer_types": None},
         r"Qwen2-MoE config.json uses sliding-window attention on some layers only"),
        ("qwen3_moe", {"attention_bias": True}, r"Qwen3-MoE attention_bias=true .*valid: false"),
        ("qwen3_moe", {"num_experts": 8, "num_local_experts": 4}, r"num_experts=8 but num_local_experts=4"),
        ("mixtral", {"num_local_experts": 0}, r"needs num_experts \(or num_local_experts\) >= 1"),
        ("mixtral", {"hidden_act": "gelu"}, r"Mixtral hidden_act='gelu' is not supported; valid: silu"),
        ("qwen3_moe", {"mlp_only_layers": [0, 1, 2, 3]}, r"no layer is sparse"),
    )),
])
def test_unrepresentable_hf_configs_are_one_line_errors(hf, match):
    with pytest.raises(ConfigError, match=match) as e:
        adapter_for_hf_config(hf).config_from_hf(hf)
    assert "\n" not in str(e.value)


# ---- mixture of experts ---------------------------------------------------------------------
def _moe_case(variant: str, layout: str | None = None):
    hf_cfg = VARIANTS[variant]()
    adapter = adapter_for_hf_config(hf_cfg.to_dict())
    cfg = adapter.config_from_hf(hf_cfg.to_dict())
    return adapter, cfg, _random_hf_state(adapter, cfg, layout=layout)


def test_moe_config_fields_map_as_documented():
    m = adapter_for_arch("mixtral").config_from_hf(VARIANTS["mixtral"]().to_dict())
    assert (m.mlp_kind, m.num_experts, m.num_experts_per_tok, m.expert_ffn_size, m.norm_topk_prob,
            m.router_aux_loss_coef, m.qk_norm, m.layer_kinds()) == ("moe", 8, 2, 32, True, 0.001, None, ["moe"] * 3)
    assert adapter_for_arch("mixtral").config_from_hf(VARIANTS["mixtral-swa"]().to_dict()).sliding_window == 8
    q2 = adapter_for_arch("qwen2_moe").config_from_hf(VARIANTS["qwen2_moe"]().to_dict())
    assert (q2.ffn_size, q2.expert_ffn_size, q2.shared_expert_ffn_size, q2.shared_expert_gate, q2.norm_topk_prob,
            q2.attention_bias, q2.layer_kinds()) == (96, 32, 48, True, False, True, ["moe", "dense", "moe"])
    q3 = adapter_for_arch("qwen3_moe").config_from_hf(VARIANTS["qwen3_moe"]().to_dict())
    assert (q3.qk_norm, q3.head_size, q3.norm_topk_prob, q3.layer_kinds()) == \
        ("head", 32, True, ["dense", "moe", "dense", "moe"])
    o = adapter_for_arch("olmoe").config_from_hf(VARIANTS["olmoe"]().to_dict())
    assert (o.qk_norm, o.tie_embeddings, o.router_aux_loss_coef, o.norm_topk_prob) == ("projection", True, 0.01, False)
    # The per-expert layout writes what each HF class names its routed experts.
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in adapter_for_arch("mixtral").hf_shapes(m)
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in adapter_for_arch("qwen2_moe").hf_shapes(q2)
    assert "model.layers.1.mlp.gate_proj.weight" in adapter_for_arch("qwen2_moe").hf_shapes(q2)  # dense layer 1


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe"])
def test_fused_experts_land_per_expert(variant):
    """gate_up_proj [E, 2f, h] is each expert's gate rows then its up rows; down_proj [E, h, f]; the
    per-expert layout holds the same tensors one by one."""
    adapter, cfg, fused = _moe_case(variant, "fused")
    c = adapter.to_canonical(fused, cfg)
    gu, down = fused["model.layers.2.mlp.experts.gate_up_proj"], fused["model.layers.2.mlp.experts.down_proj"]
    f = cfg.expert_ffn_size
    assert torch.equal(c["layers.2.mlp.experts.5.gate.weight"], gu[5, :f])
    assert torch.equal(c["layers.2.mlp.experts.5.up.weight"], gu[5, f:])
    assert torch.equal(c["layers.2.mlp.experts.5.down.weight"], down[5])
    assert torch.equal(c["layers.2.mlp.router.weight"], fused["model.layers.2.mlp.gate.weight"])
    per_expert = adapter.to_hf(c, cfg)
    up = "block_sparse_moe.experts.5.w3" if variant == "mixtral" else "mlp.experts.5.up_proj"
    assert torch.equal(per_expert[f"model.layers.2.{up}.weight"], gu[5, f:])
    back = adapter.to_canonical(per_expert, cfg)
    assert back.keys() == c.keys() and all(torch.equal(back[k], c[k]) for k in c)


@pytest.mark.parametrize("layout", [None, "fused"])
def test_missing_expert_tensor_is_named(layout):
    adapter, cfg, state = _moe_case("mixtral", layout)
    key = ("model.layers.1.block_sparse_moe.experts.6.w2.weight" if layout is None
           else "model.layers.1.mlp.experts.down_proj")
    del state[key]
    with pytest.raises(ConfigError, match=rf"lacks tensor {key.replace('.', '[.]')} \(1 missing in all\)") as e:
        adapter.to_canonical(state, cfg)
    assert "\n" not in str(e.value)


def test_mixed_layouts_and_wrong_expert_count_are_refused():
    adapter, cfg, state = _moe_case("qwen3_moe")
    fused = _random_hf_state(adapter, cfg, layout="fused")
    state["model.layers.1.mlp.experts.gate_up_proj"] = fused["model.layers.1.mlp.experts.gate_up_proj"]
    with pytest.raises(ConfigError, match=r"HF tensor model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight is "
                                          r"not in the Qwen3MoeForCausalLM key map"):
        adapter.to_canonical(state, cfg)
    adapter, cfg, state = _moe_case("qwen3_moe")
    state["model.layers.3.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)  # a ninth expert
    with pytest.raises(ConfigError, match=r"experts\.8\.up_proj\.weight is not in the"):
        adapter.to_canonical(state, cfg)
    adapter, cfg, state = _moe_case("olmoe", "fused")
    state["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 64, 64)
    with pytest.raises(ConfigError, match=r"gate_up_proj has shape \[4, 64, 64\]; config.json implies \[8, 64, 64\]"):
        adapter.to_canonical(state, cfg)


@pytest.mark.parametrize("arch, change, match", [
    ("mixtral", {"norm_topk_prob": False}, r"model.norm_topk_prob=false has no Mixtral equivalent"),
    ("mixtral", {"router_score": "sigmoid"}, r"model.router_score='sigmoid' has no Mixtral equivalent; valid: softmax"),
    ("olmoe", {"mlp_only_layers": [0]}, r"make dense layers, which OLMoE has not"),
    ("qwen3_moe", {"shared_expert_ffn_size": 16}, r"Qwen3-MoE needs shared_expert_ffn_size=0"),
    ("qwen2_moe", {"shared_expert_gate": False}, r"Qwen2-MoE needs shared_expert_ffn_size >= 1 and shared_expert_gate"),
    ("qwen3_moe", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 has no Qwen3MoeForCausalLM equivalent"),
    ("dots1", {"router_score": "softmax", "router_bias": False}, r"router_score='softmax' has no dots.llm1 equivalent"),
    ("glm4_moe", {"shared_expert_ffn_size": 48}, r"GLM-4-MoE has n_shared_experts experts of width .*=32; valid: a "
                                                  r"positive multiple of 32"),
])
def test_unexportable_moe_configs_are_one_line_errors(arch, change, match):
    adapter, cfg, state = _moe_case(arch)
    canonical = adapter.to_canonical(state, cfg)
    bad = dataclasses.replace(cfg, **change)
    for call in (lambda: adapter.config_to_hf(bad), lambda: adapter.to_hf(canonical, bad)):
        with pytest.raises(ConfigError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


def test_first_k_dense_exports_as_mlp_only_layers():
    adapter = adapter_for_arch("qwen3_moe")
    cfg = adapter.config_from_hf(VARIANTS["qwen3_moe"]().to_dict())
    cfg = dataclasses.replace(cfg, decoder_sparse_step=1, first_k_dense=2, mlp_only_layers=[3])
    exported, _ = adapter.config_to_hf(cfg)
    assert exported["mlp_only_layers"] == [0, 1, 3]
    back = adapter.config_from_hf(exported)
    assert back.layer_kinds() == cfg.layer_kinds() == ["dense", "dense", "moe", "dense"]


@pytest.mark.parametrize("preset, hf_class", [("mixtral-tiny", T.MixtralConfig), ("qwen2-moe-tiny", T.Qwen2MoeConfig),
                                              ("qwen3-moe-tiny", T.Qwen3MoeConfig), ("olmoe-tiny", T.OlmoeConfig)])
def test_moe_presets_compose_train_and_export(preset, hf_class):
    """configs/model/<preset>.yaml composes through Hydra's schema, builds a model whose experts and router
    get gradients, and maps to its HF class (which transformers accepts and maps back to the same config)."""
    from mpformer.cli.compose import compose_config
    from mpformer.models.transformer import Transformer

    cfg = compose_config([f"model={preset}"]).cfg.model
    assert cfg.num_experts == 8 and "moe" in cfg.layer_kinds()
    model = Transformer(cfg, seed=0).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any("router" in n and g.abs().sum() > 0 for n, g in grads.items())
    adapter = adapter_for_arch(cfg.arch)
    exported, notes = adapter.config_to_hf(cfg)
    assert len(notes) == (1 if cfg.router_z_loss_coef else 0)
    hf = T.AutoConfig.for_model(**exported)
    assert type(hf) is hf_class
    assert adapter.config_from_hf(hf.to_dict()) == dataclasses.replace(cfg, router_z_loss_coef=0.0)  # not in HF


def test_sigmoid_moe_config_fields_and_unsupported_options():
    dots = adapter_for_arch("dots1").config_from_hf(VARIANTS["dots1"]().to_dict())
    assert (dots.router_score, dots.router_bias, dots.router_groups, dots.router_topk_groups, dots.norm_topk_prob,
            dots.shared_expert_ffn_size, dots.qk_norm, dots.layer_kinds()) == (
        "sigmoid", True, 4, 2, False, 64, "head", ["dense", "moe", "moe"])
    glm = adapter_for_arch("glm4_moe").config_from_hf(VARIANTS["glm4_moe"]().to_dict())
    assert (glm.partial_rotary_factor, glm.rotary_dim, glm.qk_norm, glm.norm_topk_prob) == (0.5, 8, None, True)
    no_partial = {k: v for k, v in VARIANTS["glm4_moe"]().to_dict().items() if k != "rope_parameters"}
    assert adapter_for_arch("glm4_moe").config_from_hf(no_partial).partial_rotary_factor == 0.5  # the class default
    exported, _ = adapter_for_arch("glm4_moe").config_to_hf(glm)
    assert exported["rope_parameters"]["partial_rotary_factor"] == 0.5
    for variant, change, match in [
        ("dots1", {"n_shared_experts": 0}, r"dots.llm1 n_shared_experts=0 is not supported; valid: an integer >= 1"),
        ("dots1", {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
         r"sliding-window attention on some layers only"),
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         r"Llama partial_rotary_factor=0.5 is not supported; valid: 1.0"),
    ]:
        hf = {**VARIANTS[variant]().to_dict(), **change}
        with pytest.raises(ConfigError, match=match) as e:
            adapter_for_hf_config(hf).config_from_hf(hf)
        assert "\n" not in str(e.value)
