"""Model structure checks that need no oracle beyond torch itself (HF parity lives in integration/)."""

import pytest
import torch
import torch.nn.functional as F

from mpformer.core.errors import ConfigError
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions
from mpformer.layers.attention import attention_core
from mpformer.models import Transformer
from mpformer.testing.models import TINY

CFGS = {k: v for k, v in TINY.items() if k != "mistral"}


@pytest.mark.parametrize("name", sorted(CFGS))
def test_canonical_tensors_cover_every_parameter_once(name):
    cfg = CFGS[name]
    m = Transformer(cfg)
    canon = m.canonical_tensors()
    assert sum(t.numel() for t in canon.values()) == cfg.num_params() == sum(p.numel() for p in m.parameters())
    # Views, not copies: writing through the canonical name changes the module's parameter.
    name0 = "layers.0.attn.k.weight"
    with torch.no_grad():
        canon[name0].fill_(3.0)
    k_rows = m.layers[0].attn.qkv.weight[cfg.num_attention_heads * cfg.head_size:][: cfg.kv_heads * cfg.head_size]
    assert torch.all(k_rows == 3.0)


def test_init_is_a_function_of_seed_and_name_only():
    a, b, c = Transformer(CFGS["llama"], seed=7), Transformer(CFGS["llama"], seed=7), Transformer(CFGS["llama"], seed=8)
    for (n, x), y, z in zip(a.canonical_tensors().items(), b.canonical_tensors().values(),
                            c.canonical_tensors().values()):
        assert torch.equal(x, y), n
        if "norm" not in n and not n.endswith("bias"):
            assert not torch.equal(x, z), n
    # A deeper model shares the first layers' initial values (same names, same seed).
    deeper = Transformer(ModelConfig(**{**CFGS["llama"].to_dict(), "num_layers": 3}), seed=7)
    q = "layers.0.attn.q.weight"
    assert torch.equal(deeper.canonical_tensors()[q], a.canonical_tensors()[q])


def test_any_block_drawn_alone_equals_that_block_of_the_whole_draw(monkeypatch):
    """The blocked initialiser (models/init.py) with 16-element blocks, so that every rectangle below
    crosses block boundaries: a block drawn alone (tensor-parallel rows, row-parallel columns, a ZeRO-3
    shard's part rows) is bit for bit the same block of the whole tensor, and a meta-built model
    materialised on the CPU holds the single-device model's values."""
    import mpformer.models.init as init_mod
    from mpformer.models.parallelize import build_model

    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", 16)
    cfg = CFGS["llama"]
    init = init_mod.ModelInit(cfg, seed=7)
    for name, shape in [("layers.0.attn.q.weight", (64, 64)), ("embedding.word.weight", (101, 64)),
                        ("layers.1.mlp.down.weight", (64, 96)), ("layers.0.attn.o.weight", (64, 3)),
                        ("layers.0.mlp_norm.weight", (64,)), ("layers.0.attn.q.bias", (64,))]:
        whole = torch.empty(shape)
        init.fill(whole, name, shape, (0,) * len(shape))
        std = init.std(name)
        if std is not None:  # every block differs: no generator is shared
            rows = whole.reshape(-1, 16).tolist() if whole.dim() == 1 else whole.tolist()
            assert abs(float(whole.std()) - std) < 0.2 * std and len({tuple(r) for r in rows}) == len(rows)
        else:
            assert torch.all(whole == (0.0 if name.endswith(".bias") else 1.0))
        g = torch.Generator().manual_seed(0)
        for _ in range(20):
            lo = [int(torch.randint(0, n, (), generator=g)) for n in shape]
            size = [int(torch.randint(1, n - a + 1, (), generator=g)) for n, a in zip(shape, lo)]
            part = torch.full(size, float("nan"), dtype=torch.bfloat16 if len(size) == 1 else torch.float32)
            init.fill(part, name, shape, tuple(lo))
            want = whole[tuple(slice(a, a + n) for a, n in zip(lo, size))]
            assert torch.equal(part, want.to(part.dtype)), (name, lo, size)
    assert init.std("layers.0.attn.o.weight") == pytest.approx(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
    ref = Transformer(cfg, seed=7)
    built = build_model(cfg, tp=None, device=torch.device("cpu"), seed=7)
    for (n, x), y in zip(ref.canonical_tensors().items(), built.canonical_tensors().values()):
        assert torch.equal(x, y), n
    assert torch.equal(built.rotary.inv_freq, ref.rotary.inv_freq) and not built.rotary.inv_freq.is_meta


def test_loss_is_mean_cross_entropy_of_logits():
    m = Transformer(CFGS["gpt2"]).eval()
    t = torch.randint(0, 101, (3, 17))
    logits = m(t[:, :-1])
    assert logits.shape == (3, 16, 101)
    ref = F.cross_entropy(logits.reshape(-1, 101), t[:, 1:].reshape(-1))
    torch.testing.assert_close(m(t[:, :-1], t[:, 1:]), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_identical_loss_and_grads(recompute):
    t = torch.randint(0, 101, (2, 33))
    grads = []
    for mode in ("none", recompute):
        m = Transformer(CFGS["llama"], ModelOptions(recompute=mode), seed=3).train()
        loss = m(t[:, :-1], t[:, 1:])
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    for g0, g1 in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(g0, g1, rtol=1e-6, atol=1e-7)


def test_gqa_and_sliding_window_match_explicit_attention():
    torch.manual_seed(0)
    b, n, k, s, d, w = 2, 4, 2, 12, 8, 5
    q, kk, v = torch.randn(b, n, s, d), torch.randn(b, k, s, d), torch.randn(b, k, s, d)
    out = attention_core(q, kk, v, dropout_p=0.0, sliding_window=w)
    kr, vr = kk.repeat_interleave(n // k, dim=1), v.repeat_interleave(n // k, dim=1)
    scores = q @ kr.transpose(-1, -2) / d**0.5
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    scores = scores.masked_fill(~((j <= i) & (i - j < w)), float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ vr, rtol=1e-5, atol=1e-6)


def test_config_errors_are_one_line():
    bad = [
        dict(arch="bert"),
        dict(num_attention_heads=3, hidden_size=64),
        dict(num_kv_heads=3),
        dict(arch="gpt2", activation="swiglu"),
        dict(arch="qwen2", attention_bias=False),
        dict(arch="llama", sliding_window=4),
    ]
    for kw in bad:
        with pytest.raises(ConfigError) as e:
            ModelConfig(**{**CFGS["llama"].to_dict(), **kw}).validate()
        assert "\n" not in str(e.value)


def test_cpu_bf16_linear_matches_autocast_reference():
    """The CPU low-precision linear (fast-layout input gradient) equals autocast's F.linear: same
    forward bits, gradients within bf16 rounding (rtol 1e-2), fp32 master-weight grads stay fp32."""
    from mpformer.layers.linear import Linear

    torch.manual_seed(0)
    ours = Linear(48, 40)
    ref = torch.nn.Linear(48, 40)
    ref.load_state_dict(ours.state_dict())
    x1 = torch.randn(3, 5, 48, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    dy = torch.randn(3, 5, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = ours(x1), ref(x2)
    assert y1.dtype == torch.bfloat16 and torch.equal(y1, y2)
    (y1.float() * dy).sum().backward()
    (y2.float() * dy).sum().backward()
    assert ours.weight.grad.dtype == torch.float32 and x1.grad.dtype == torch.float32
    for a, b in [(x1.grad, x2.grad), (ours.weight.grad, ref.weight.grad), (ours.bias.grad, ref.bias.grad)]:
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    # fp32 takes torch's own path: bit-identical.
    x3 = torch.randn(4, 48)
    assert torch.equal(ours(x3), ref(x3))
