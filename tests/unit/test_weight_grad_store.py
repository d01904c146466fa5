"""The split backward of zero-bubble schedules: BI leaves weight gradients queued, BW adds them.

Oracle: torch's own autograd through nn.functional.linear on the same inputs (fp32 to 1e-6
relative; bf16 autocast to bf16 rounding, 1e-2, since both sides compute in bf16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpformer.core.model_config import ModelConfig
from mpformer.layers.linear import Linear, WeightGradStore
from mpformer.models.transformer import Transformer


def _pair(bias: bool, store: WeightGradStore | None = None) -> tuple[Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 24, bias=bias)
    mine = Linear(16, 24, bias=bias, store=store)
    mine.load_state_dict(ref.state_dict())
    return mine, ref


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
def test_capture_defers_weight_grads_then_run_matches_autograd(bias, bf16):
    store = WeightGradStore()
    mine, ref = _pair(bias, store)
    x = torch.randn(5, 3, 16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(5, 3, 24)
    tol = {"rtol": 1e-2, "atol": 1e-2} if bf16 else {"rtol": 1e-6, "atol": 1e-6}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ya, yb = mine(xa), ref(xb)
    for mb in range(2):  # two micro-batches: the second accumulates
        with store.capture(("mb", mb)):
            ya.backward(dy, retain_graph=True)
        assert mine.weight.grad is None, "BI must not produce weight gradients"
        yb.backward(dy, retain_graph=True)
        torch.testing.assert_close(xa.grad, xb.grad, **tol)  # BI gives the input gradient
    store.run(("mb", 0))
    store.run(("mb", 1))
    assert not store.pending
    torch.testing.assert_close(mine.weight.grad, ref.weight.grad, **tol)
    assert mine.weight.grad.dtype == torch.float32 and not mine.weight.grad.requires_grad
    if bias:
        torch.testing.assert_close(mine.bias.grad, ref.bias.grad, **tol)


def test_outside_a_capture_the_store_is_a_plain_backward():
    mine, ref = _pair(True, WeightGradStore())
    x = torch.randn(4, 16)
    F.linear(x, ref.weight, ref.bias).sum().backward()
    mine(x).sum().backward()
    torch.testing.assert_close(mine.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)


def test_whole_model_split_backward_equals_combined():
    """Every linear (attention, fused gate|up MLP, untied head) defers; norms and the embedding do
    not; BI + BW gives the combined backward's gradients."""
    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=64, vocab_size=50, max_position_embeddings=16)
    store = WeightGradStore()
    a, b = Transformer(cfg, seed=1, store=store), Transformer(cfg, seed=1)
    tokens = torch.randint(0, 50, (2, 8))
    with store.capture(0):
        a(tokens, tokens).backward()
    deferred = {n for n, p in a.named_parameters() if p.grad is None}
    assert deferred == {n for n, _ in a.named_parameters() if n.endswith(("qkv.weight", "o.weight", "up.weight",
                                                                          "down.weight", "lm_head.weight"))}
    store.run(0)
    b(tokens, tokens).backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-7, msg=name)
