"""The CPU kernel probe and both input-gradient layouts it can choose (same values, either way)."""

from __future__ import annotations

import math

import pytest
import torch

from mpformer.layers.linear import Linear
from mpformer.parallel import kernels


def _forcing(monkeypatch, var: str, chosen):
    """A function that sets (or clears) ``var``, drops the cached choice and returns the new one."""
    def force(choice: str | None):
        if choice is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, choice)
        chosen.cache_clear()
        return chosen()
    return force


@pytest.fixture
def dgrad(monkeypatch):
    yield _forcing(monkeypatch, "MPFORMER_CPU_DGRAD", kernels.process_kernels)
    kernels.process_kernels.cache_clear()


def test_probe_measures_both_layouts_and_describes_its_choice():
    k = kernels.probe()
    assert k.source == "probe" and k.nn_gflops > 0 and k.transposed_gflops > 0
    assert k.dgrad_transposed == (k.transposed_gflops > kernels.WIN_FACTOR * k.nn_gflops)
    assert "GFLOP/s" in k.describe()


def test_environment_overrides_and_bad_value_is_named(dgrad):
    assert dgrad("nn").dgrad_transposed is False
    assert dgrad("transposed").dgrad_transposed is True and math.isnan(dgrad("transposed").nn_gflops)
    with pytest.raises(ValueError, match="MPFORMER_CPU_DGRAD='fast'; valid: nn, transposed"):
        dgrad("fast")


@pytest.mark.parametrize("choice", ["nn", "transposed"])
def test_both_layouts_give_the_fp32_gradients_within_bf16_rounding(dgrad, choice):
    dgrad(choice)
    torch.manual_seed(0)
    layer = Linear(96, 64)
    x = torch.randn(4, 16, 96, requires_grad=True)
    ref_layer = torch.nn.Linear(96, 64)
    ref_layer.load_state_dict(layer.state_dict())
    xr = x.detach().clone().requires_grad_()
    (ref_layer(xr) ** 2).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    (y.float() ** 2).sum().backward()
    # bf16 inputs and outputs (8 bits of mantissa) over sums of 96 / 64 products: 3e-2 relative holds on
    # AVX2 and AMX kernels alike.
    for got, want in ((x.grad, xr.grad), (layer.weight.grad, ref_layer.weight.grad),
                      (layer.bias.grad, ref_layer.bias.grad)):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_runs_on_sdpas_flash_kernel(arch, dtype):
    """The model's causal attention (GQA included) is a call torch's fused flash kernel accepts: with
    every other SDPA backend switched off, forward and backward still run (on CUDA: tests/gpu)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mpformer.core.model_config import ModelConfig
    from mpformer.models import Transformer

    extra = {"num_kv_heads": 2} if arch == "llama" else {"activation": "gelu_tanh", "tie_embeddings": True,
                                                             "attention_bias": True, "mlp_bias": True}
    cfg = ModelConfig(arch=arch, num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                      vocab_size=64, max_position_embeddings=32, **extra)
    model = Transformer(cfg, seed=1)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    assert torch.isfinite(loss)


@pytest.fixture
def attention_way(monkeypatch):
    bf16 = lambda: kernels.cpu_attention(torch.bfloat16)
    bf16.cache_clear = kernels.process_attention.cache_clear
    yield _forcing(monkeypatch, "MPFORMER_CPU_ATTENTION", bf16)
    kernels.process_attention.cache_clear()


def test_attention_probe_times_both_ways_and_overrides_are_checked(attention_way):
    k = kernels.probe_attention(torch.bfloat16)
    assert k.source == "probe" and k.native_ms > 0 and k.fp32_ms > 0
    with torch.no_grad():  # the first attention of a process may be an evaluation's
        assert kernels.probe_attention(torch.bfloat16).fp32_ms > 0
    with torch.inference_mode():
        assert kernels.probe_attention(torch.bfloat16).fp32_ms > 0
    assert k.upcast == (k.native_ms > kernels.WIN_FACTOR * k.fp32_ms)
    assert "ms" in k.describe(torch.bfloat16)
    assert attention_way("fp32").upcast is True and attention_way("native").upcast is False
    with pytest.raises(ValueError, match="MPFORMER_CPU_ATTENTION='fast'; valid: native, fp32"):
        attention_way("fast")


@pytest.mark.parametrize("choice", ["native", "fp32"])
def test_both_attention_ways_match_fp32_attention_within_bf16_rounding(attention_way, choice):
    """The model's attention core in bf16, computed natively or in fp32, against fp32 SDPA: outputs
    and input gradients (GQA, causal; under autocast too, which must not undo the fp32 cast)."""
    from mpformer.layers.attention import attention_core

    attention_way(choice)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 64, 32, generator=g) for n in (4, 2, 2))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    want.backward(torch.ones_like(want))
    for autocast in (False, True):
        low = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = attention_core(*low, dropout_p=0.0, sliding_window=None)
        assert got.dtype == torch.bfloat16
        got.float().backward(torch.ones_like(want))
        # bf16 inputs (8-bit mantissa) over 64-key softmax sums: 3e-2 of the largest element holds for both.
        for a, b in [(got, want)] + [(x.grad, r.grad) for x, r in zip(low, ref)]:
            torch.testing.assert_close(a.float(), b, rtol=3e-2, atol=3e-2 * float(b.abs().max()))
