"""The MoE layer on one process: routers against their definitions, the router losses' gradients,
the balancing bias, parameter counts, and bad input (HF parity: tests/integration/test_hf_parity.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mpformer.core.errors import ConfigError
from mpformer.core.model_config import ModelConfig
from mpformer.layers import moe as moe_mod
from mpformer.layers.moe import MoE, Router, balance_loss, moe_layers, set_loss_scale
from mpformer.models.transformer import Transformer

BASE = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=48,
            moe_ffn_hidden_size=16, num_experts=8, num_experts_per_tok=2, mlp_kind="moe", vocab_size=64)
FAMILIES = {
    "mixtral": dict(arch="mixtral"),
    "qwen2_moe": dict(arch="qwen2_moe", attention_bias=True, shared_expert_ffn_size=24, shared_expert_gate=True,
                      norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": dict(arch="qwen3_moe", qk_norm="head", decoder_sparse_step=2),
    "olmoe": dict(arch="olmoe", qk_norm="projection", norm_topk_prob=False),
    "deepseek_router": dict(arch="mixtral", router_score="sigmoid", router_bias=True, router_groups=4,
                            router_topk_groups=2, routed_scaling_factor=2.5, first_k_dense=1,
                            shared_expert_ffn_size=16),
}


def cfg_of(name: str, **kw) -> ModelConfig:
    return ModelConfig(**{**BASE, **FAMILIES[name], **kw}).validate()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_counts_and_every_parameter_gets_a_gradient(name):
    cfg = cfg_of(name, router_aux_loss_coef=0.01, router_z_loss_coef=1e-3)
    m = Transformer(cfg, seed=3)
    assert sum(p.numel() for p in m.parameters()) == cfg.num_params()
    per_expert = 3 * cfg.hidden_size * cfg.expert_ffn_size
    sparse = sum(k == "moe" for k in cfg.layer_kinds())
    assert cfg.num_params() - cfg.active_params() == sparse * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    m(tokens, tokens).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_sparse_layers_follow_hf_rules():
    assert cfg_of("qwen2_moe").layer_kinds() == ["moe", "dense", "moe"]
    assert cfg_of("qwen3_moe", num_layers=4).layer_kinds() == ["dense", "moe", "dense", "moe"]
    assert cfg_of("deepseek_router").layer_kinds() == ["dense", "moe", "moe"]


def _router(name: str, **kw) -> tuple[Router, ModelConfig]:
    cfg = cfg_of(name, **kw)
    r = Router(cfg)
    torch.nn.init.normal_(r.weight, std=1.0)
    return r, cfg


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_is_its_definition(norm):
    r, cfg = _router("mixtral", norm_topk_prob=norm)
    x = torch.randn(20, cfg.hidden_size)
    w, e, probs, _ = r(x)
    p = torch.softmax(x @ r.weight.t(), -1)
    top = p.topk(2, -1)
    assert torch.equal(e, top.indices)
    want = top.values / top.values.sum(-1, keepdim=True) if norm else top.values
    torch.testing.assert_close(w, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(probs, p, rtol=1e-6, atol=0)


def test_sigmoid_router_bias_picks_and_never_weighs():
    r, cfg = _router("deepseek_router", router_groups=1, router_topk_groups=1)
    x = torch.randn(30, cfg.hidden_size)
    r.bias = torch.zeros(cfg.num_experts)
    r.bias[5] = 100.0  # expert 5 is chosen by every token, weighted by its own score only
    w, e, _, _ = r(x)
    assert (e == 5).any(-1).all()
    s = torch.sigmoid(x @ r.weight.t())
    chosen = s.gather(1, e)
    torch.testing.assert_close(w, 2.5 * chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_group_limited_routing_stays_in_the_best_groups():
    r, cfg = _router("deepseek_router", router_groups=4, router_topk_groups=1)
    x = torch.randn(50, cfg.hidden_size)
    _, e, _, _ = r(x)
    assert (e // 2 == e[:, :1] // 2).all()  # both choices in one group of 2 experts


def test_group_mask_outranks_negative_biased_scores():
    """HF masks the other groups' experts to -inf: a selection bias below -1 (sigmoid + bias < 0 everywhere)
    must still pick inside the best group, never a masked expert."""
    r, cfg = _router("deepseek_router", router_groups=4, router_topk_groups=1)
    r.bias = torch.full((cfg.num_experts,), -2.0)
    _, e, _, _ = r(torch.randn(50, cfg.hidden_size))
    assert (e // 2 == e[:, :1] // 2).all()


def test_balance_loss_definition_and_uniform_value():
    s, b, e, k = 16, 2, 4, 2
    probs = torch.full((s * b, e), 1 / e)
    experts = torch.stack([torch.arange(s * b) % e, (torch.arange(s * b) + 1) % e], -1)
    assert balance_loss(experts, probs, s, b, e).item() == pytest.approx(1.0)  # balanced: exactly 1
    experts = torch.zeros(s * b, k, dtype=torch.long)
    experts[:, 1] = 1
    probs = torch.softmax(torch.randn(s * b, e), -1)
    want = torch.stack([e * (torch.tensor([0.5, 0.5, 0, 0]) * probs.view(s, b, e)[:, j].mean(0)).sum()
                        for j in range(b)]).mean()
    torch.testing.assert_close(balance_loss(experts, probs, s, b, e), want)


def test_router_losses_reach_backward_with_the_step_factor(monkeypatch):
    """AddAuxGrad's gradient equals adding scale * (coefficient-weighted losses) to the loss."""
    cfg = cfg_of("qwen2_moe", router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    m = Transformer(cfg, seed=5)
    set_loss_scale(m, 0.25)
    (0.25 * m(tokens, tokens)).backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    auxes = []
    monkeypatch.setattr(moe_mod.AddAuxGrad, "apply", lambda y, aux, scale: auxes.append(aux) or y)
    (0.25 * (m(tokens, tokens) + sum(auxes))).backward()
    assert len(auxes) == 2
    for n, p in m.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-9, msg=n)
    assert any(got[n].abs().sum() > 0 for n in got if "router" in n)


def test_stats_and_bias_update():
    cfg = cfg_of("deepseek_router", router_bias_update_rate=1e-3)
    m = Transformer(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    m(tokens, tokens)
    layer = moe_layers(m)[0]
    st = layer.take_stats()
    assert st.load.sum().item() == 2 * 12 * 2 and st.micro_batches == 1
    assert layer.take_stats() is None
    load = torch.tensor([4.0, 0, 2, 2, 1, 3, 2, 2])
    layer.update_bias(load, 1e-3)
    assert torch.equal(torch.sign(layer.router.bias), torch.sign(load.mean() - load))


def test_expert_canonical_tensors_are_views_per_expert():
    cfg = cfg_of("mixtral")
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    sh = layer.canonical_shards("p")
    f, h = cfg.expert_ffn_size, cfg.hidden_size
    for e in range(cfg.num_experts):
        assert sh[f"p.experts.{e}.gate.weight"].local.shape == (f, h)
        assert sh[f"p.experts.{e}.down.weight"].local.data_ptr() == layer.experts.down[e * h].data_ptr()
    up = layer.experts.up.view(cfg.num_experts, 2 * f, h)
    x = torch.randn(1, 3, h)
    with torch.no_grad():
        w, e, _, _ = layer.router(x.view(3, h))
        y = layer(x).view(3, h)
        ref = torch.zeros(3, h)
        for t in range(3):
            for j in range(2):
                g, u = (x[0, t] @ up[e[t, j]].t()).chunk(2)
                down = layer.experts.down.view(cfg.num_experts, h, f)[e[t, j]]
                ref[t] += w[t, j] * (F.silu(g) * u) @ down.t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


BAD = {
    "top-k above the expert count": (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    "capacity factor <= 0": (dict(capacity_factor=0.0), "capacity_factor=0.0"),
    "moe kind without experts": (dict(num_experts=0, arch="llama"), "mlp_kind=moe"),
    "unknown router": (dict(router_score="relu"), "router_score"),
    "groups not dividing experts": (dict(router_groups=3), "router_groups=3"),
    "bias rate without bias": (dict(router_bias_update_rate=0.1), "router_bias=true"),
    "wrong qk norm for arch": (dict(arch="qwen3_moe"), "qk_norm=head"),
    "no sparse layer": (dict(first_k_dense=3), "no layer is sparse"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line(case):
    kw, needle = BAD[case]
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(cfg_of("mixtral"), **kw).validate()
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_capacity_drops_in_gshard_order():
    cfg = cfg_of("mixtral", capacity_factor=0.5)
    layer = MoE(cfg)
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # T=4, k=2, E=8: capacity ceil(0.5*8/8) = 1
    kept = layer._capacity(experts)
    # first choices by position first: token 0 takes expert 0, tokens 1, 2 lose it; token 3 takes 3;
    # then second choices: token 0 takes 1, token 1 takes 2, token 2 loses 1, token 3 loses 0
    assert kept.tolist() == [[0, 1], [8, 2], [8, 8], [3, 8]]
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.train()
    x = torch.randn(6, 2, cfg.hidden_size)
    y = layer(x)
    st = layer.take_stats()
    assert st.load.max() <= 3 and st.dropped == 24 - st.load.sum()  # capacity ceil(0.5 * 12 * 2 / 8) = 3
    y.sum().backward()


def test_a_recomputed_forward_is_not_counted_twice():
    from torch.utils.checkpoint import checkpoint

    cfg = cfg_of("mixtral")
    layer = MoE(cfg).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 2, cfg.hidden_size, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert layer.take_stats().load.sum().item() == 5 * 2 * cfg.num_experts_per_tok


def test_selective_recompute_of_the_experts_keeps_less_and_gives_the_same_gradients():
    cfg = cfg_of("mixtral")
    layer = MoE(cfg).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(16, 2, cfg.hidden_size, requires_grad=True)
    saved, grads = [], []
    for recompute in (False, True):
        n = [0]

        def pack(t, n=n):
            n[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x, recompute)
        layer.zero_grad()
        x.grad = None
        y.backward(torch.ones_like(y))
        saved.append(n[0])
        grads.append([x.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    assert saved[1] < saved[0]
    for a, b in zip(*grads):
        assert torch.equal(a, b)
