"""Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, dots.llm1, GLM-4-MoE (and dense Qwen3) HF -> mpformer -> HF,
transformers as the oracle.

As tests/integration/test_hf_parity.py: each tiny HF model (hidden 64, 4 heads, 2 kv heads, 8 experts
top-2 of width 32, random weights and norm gains) is saved in fp32 with save_pretrained, which in
transformers 5.25 writes the per-expert layout of the hub's files (Mixtral ``block_sparse_moe.experts.{e}.w1``,
the others ``mlp.experts.{e}.gate_proj``), converted with ``mpformer-convert hf-to-mpformer`` (in-process)
and run by our Transformer on the same tokens:

    logits: max |diff| <= 1e-5 * max |HF logit|;  loss: |diff| <= 1e-5 * |HF loss|   (fp32)
    routers: every sparse layer picks the same k experts per token, in the same order (weights 1e-5)

HF's loss is taken with output_router_logits=False (the cross entropy alone). Observed on CPU: logits
rel diff ~3e-7. Then ``mpformer-to-hf`` must reproduce save_pretrained's safetensors bit for bit and
AutoModelForCausalLM.from_pretrained on the output (which fuses the experts on load) the same logits.
Qwen2-MoE has a gated shared expert and a dense layer (mlp_only_layers); Qwen3-MoE dense layers from
decoder_sparse_step=2 and head_dim 32 != hidden/heads; Qwen3 and OLMoE tied embeddings. dots.llm1 and
GLM-4-MoE route as DeepSeek-V3 (sigmoid, a random selection bias of std 0.5, groups, scaling) with shared
experts and a dense first layer; GLM rotates half of each head.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from mpformer.checkpoint.io import load_checkpoint, read_all_tensors
from mpformer.checkpoint.manifest import read_manifest
from mpformer.cli.convert import main
from mpformer.core.model_config import ModelConfig
from mpformer.layers.moe import Router
from mpformer.models.transformer import Transformer

VOCAB, SEQ, BATCH = 123, 32, 2
TOL = 1e-5
KW = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
          max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, output_router_logits=False)

CONFIGS = {
    "mixtral": lambda: T.MixtralConfig(**KW, **MOE, intermediate_size=32, num_local_experts=8),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(**KW, **MOE, intermediate_size=96, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, num_experts=8, mlp_only_layers=[1]),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(**{**KW, "num_hidden_layers": 4}, **MOE, intermediate_size=96,
                                          moe_intermediate_size=32, num_experts=8, decoder_sparse_step=2,
                                          norm_topk_prob=True, head_dim=32),
    "olmoe": lambda: T.OlmoeConfig(**KW, **MOE, intermediate_size=32, num_experts=8, tie_word_embeddings=True),
    "qwen3": lambda: T.Qwen3Config(**KW, intermediate_size=96, head_dim=32, tie_word_embeddings=True),
    # DeepSeek-V3's router: sigmoid, selection bias, 2 of 4 groups, renormalised, scaled; 2 shared experts
    "dots1": lambda: T.Dots1Config(**KW, num_experts_per_tok=2, intermediate_size=96, moe_intermediate_size=32,
                                   n_routed_experts=8, n_shared_experts=2, n_group=4, topk_group=2,
                                   first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                                   attention_bias=True),
    # ... 1 of 2 groups, not renormalised; per-head q/k norms, q/k/v biases, RoPE on half of each head
    "glm4_moe": lambda: T.Glm4MoeConfig(**{**KW, "num_hidden_layers": 4}, num_experts_per_tok=2,
                                        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                        norm_topk_prob=False, routed_scaling_factor=1.5, use_qk_norm=True,
                                        attention_bias=True),
}
# HF's sigmoid routers take their top k unsorted (topk sorted=False): their picks compare as sets.
UNSORTED = ("dots1", "glm4_moe")
# The per-expert key save_pretrained writes (the legacy layout import must read): one per family.
PER_EXPERT_KEY = {"mixtral": "model.layers.0.block_sparse_moe.experts.7.w1.weight",
                  "qwen2_moe": "model.layers.2.mlp.experts.7.gate_proj.weight",
                  "qwen3_moe": "model.layers.3.mlp.experts.7.down_proj.weight",
                  "olmoe": "model.layers.2.mlp.experts.0.up_proj.weight",
                  "dots1": "model.layers.2.mlp.experts.7.gate_proj.weight",
                  "glm4_moe": "model.layers.3.mlp.experts.7.up_proj.weight"}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
        for name, b in model.named_buffers():  # the selection bias: large enough to change picks, often < 0
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for i, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        model = T.AutoModelForCausalLM.from_config(make())
        _randomize(model, seed=100 + i)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mp")
    for name, src in hf_dirs.items():
        assert main(["hf-to-mpformer", "--hf", str(src), "--out", str(root / name)]) == 0
    return {name: root / name for name in hf_dirs}


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _safetensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _ours(ckpt: Path) -> Transformer:
    model = Transformer(ModelConfig.from_dict(read_manifest(ckpt)["model"])).eval()
    load_checkpoint(ckpt, model)
    return model


def _routers_of_hf(hf: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index -> the router module of each sparse layer (``mlp.gate``, the top-k router class)."""
    return {i: layer.mlp.gate for i, layer in enumerate(hf.model.layers)
            if isinstance(getattr(layer.mlp, "gate", None), torch.nn.Module) and hasattr(layer.mlp, "experts")}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_to_mpformer_matches_hf_logits_loss_and_routing(name, hf_dirs, converted, capsys):
    src, ckpt = hf_dirs[name], converted[name]
    if name in PER_EXPERT_KEY:
        assert PER_EXPERT_KEY[name] in _safetensors(src)  # the per-expert (hub) layout was read
    tokens = _tokens()
    hf = T.AutoModelForCausalLM.from_pretrained(src).eval()
    ours = _ours(ckpt)

    for i, router in _routers_of_hf(hf).items():  # the selection bias came across (a buffer, not a weight)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            ours_bias = ours.layers[i].mlp.router.bias
            assert bias.abs().max() > 0.1 and ours_bias is not None and torch.equal(ours_bias, bias)
    hf_picks, our_picks = {}, {}
    hooks = [r.register_forward_hook(lambda m, a, out, i=i: hf_picks.__setitem__(i, out[1:]))
             for i, r in _routers_of_hf(hf).items()]
    our_routers = {int(n.split(".")[1]): m for n, m in ours.named_modules() if isinstance(m, Router)}
    hooks += [r.register_forward_hook(lambda m, a, out, i=i: our_picks.__setitem__(i, out[:2]))
              for i, r in our_routers.items()]
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)  # ours does not shift
    with torch.no_grad():
        ref = hf(tokens, labels=tokens, output_router_logits=False)
        logits, loss = ours(tokens), ours(tokens, labels)
    for h in hooks:
        h.remove()

    scale = ref.logits.abs().max()
    with capsys.disabled():
        print(f"\n[{name}] max logit diff / max |logit| {((logits - ref.logits).abs().max() / scale).item():.2e}, "
              f"rel loss diff {(abs(loss - ref.loss) / abs(ref.loss)).item():.2e}")
    assert (logits - ref.logits).abs().max() <= TOL * scale
    assert abs(loss - ref.loss) <= TOL * abs(ref.loss)
    sparse = [i for i, kind in enumerate(ours.cfg.layer_kinds()) if kind != "dense"]
    assert sorted(hf_picks) == sorted(our_picks) == sparse
    for i in sparse:
        hf_weights, hf_experts = hf_picks[i]  # [b*s, k], batch-major tokens
        our_weights, our_experts = (t.view(SEQ, BATCH, -1).transpose(0, 1).reshape(BATCH * SEQ, -1)
                                    for t in our_picks[i])  # ours are sequence-major
        if name in UNSORTED:
            hf_experts, order = hf_experts.sort(dim=-1)
            hf_weights = hf_weights.gather(1, order)
            our_experts, order = our_experts.sort(dim=-1)
            our_weights = our_weights.gather(1, order)
        assert torch.equal(our_experts, hf_experts), f"layer {i} routes differently"
        torch.testing.assert_close(our_weights, hf_weights.float(), rtol=TOL, atol=TOL)
        assert len(hf_experts.unique()) > 2  # the tokens spread over the experts: the check has teeth


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_is_bit_exact_and_loads_in_transformers(name, hf_dirs, converted, tmp_path):
    src, back = hf_dirs[name], tmp_path / "hf"
    assert main(["mpformer-to-hf", "--ckpt", str(converted[name]), "--out", str(back)]) == 0
    orig, new = _safetensors(src), _safetensors(back)
    assert orig.keys() == new.keys()
    for k in orig:
        assert orig[k].dtype == new[k].dtype and orig[k].shape == new[k].shape, k
        assert torch.equal(orig[k].view(torch.uint8), new[k].view(torch.uint8)), k
    tokens = _tokens()
    reloaded = T.AutoModelForCausalLM.from_pretrained(back).eval()
    hf = T.AutoModelForCausalLM.from_pretrained(src).eval()
    assert type(reloaded) is type(hf)
    assert hf.config.to_dict().get("num_experts_per_tok") == reloaded.config.to_dict().get("num_experts_per_tok")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf(tokens).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "glm4_moe"])
def test_fused_layout_is_read(name, hf_dirs, converted, tmp_path):
    """A file holding transformers 5's module state (fused ``experts.gate_up_proj``/``down_proj``) converts
    to the same canonical tensors as the per-expert file save_pretrained wrote."""
    hf = T.AutoModelForCausalLM.from_pretrained(hf_dirs[name])
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith(".mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))
    (fused / "config.json").write_text((hf_dirs[name] / "config.json").read_text())
    assert main(["hf-to-mpformer", "--hf", str(fused), "--out", str(tmp_path / "mp")]) == 0
    got, want = read_all_tensors(tmp_path / "mp"), read_all_tensors(converted[name])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


def test_missing_expert_and_unsupported_option_exit_2_with_one_line(hf_dirs, tmp_path, capsys):
    bad = tmp_path / "missing"
    bad.mkdir()
    state = _safetensors(hf_dirs["mixtral"])
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((hf_dirs["mixtral"] / "config.json").read_text())
    line = _error_line(capsys, ["hf-to-mpformer", "--hf", str(bad), "--out", str(tmp_path / "o")])
    assert "lacks tensor model.layers.1.block_sparse_moe.experts.3.w2.weight" in line

    jitter = tmp_path / "jitter"
    jitter.mkdir()
    (jitter / "model.safetensors").symlink_to(hf_dirs["mixtral"] / "model.safetensors")
    cfg = json.loads((hf_dirs["mixtral"] / "config.json").read_text())
    (jitter / "config.json").write_text(json.dumps({**cfg, "router_jitter_noise": 0.01}))
    line = _error_line(capsys, ["hf-to-mpformer", "--hf", str(jitter), "--out", str(tmp_path / "o")])
    assert "Mixtral router_jitter_noise=0.01 is not supported; valid: 0.0" in line
    assert not (tmp_path / "o").exists()
