"""The CPU kernel probe and both input-gradient layouts it can choose (same values, either way)."""

from __future__ import annotations

import math

import pytest
import torch

from mpformer.layers import kernels
from mpformer.layers.linear import Linear


@pytest.fixture
def dgrad(monkeypatch):
    def force(choice: str | None) -> kernels.CpuKernels:
        if choice is None:
            monkeypatch.delenv("MPFORMER_CPU_DGRAD", raising=False)
        else:
            monkeypatch.setenv("MPFORMER_CPU_DGRAD", choice)
        kernels.cpu_kernels.cache_clear()
        return kernels.cpu_kernels()
    yield force
    kernels.cpu_kernels.cache_clear()


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
