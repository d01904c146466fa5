"""train.precision=fp8 on the device (issue 35; gpu_check.sh runs these, its fp8 part trains the 1B).

    GEMMs          each recipe's float8 linear (forward, dX, dW through cuBLASLt's _scaled_mm, which takes
                   row-major a and column-major b, K and N multiples of 16) against the same call on the
                   CPU's kernel: the same float8 operands and scales, so only the GEMMs' accumulation
                   order differs (bf16 outputs: within 1e-2 of the largest element)
    experts        the routed experts' float8 grouped GEMMs (torch._scaled_grouped_mm, e4m3 gradients) against
                   the CPU's _scaled_mm per expert on the same operands
    saved bytes    one fp8 block keeps on the device what the memory model counts (autoconfig/fp8_terms.py:
                   1-byte x8 and W8 and two fp32 scales per projection): within 1% (the flash kernel's own
                   extras), to the byte on the CPU

``MPFORMER_GPU_DRY_RUN=1`` (gpu_check.sh --dry-run) runs them on the CPU instead (the CPU against itself:
a typo cannot cost GPU minutes). Without either they are skipped; a GPU below compute capability 8.9 (no
float8 tensor cores: an A100) skips them with its reason.
"""

from __future__ import annotations

import os

import pytest
import torch

DRY = os.environ.get("MPFORMER_GPU_DRY_RUN") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_GPU = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE != "cuda" and not DRY, reason="needs a CUDA device (gpu_check.sh)"),
              pytest.mark.skipif(DEVICE == "cuda" and not FP8_GPU, reason="float8 GEMMs need compute capability 8.9")]

from mpformer.core.fp8_config import Fp8Options  # noqa: E402
from mpformer.layers.fp8 import DelayedScalingState  # noqa: E402
from mpformer.layers.fp8_linear import fp8_linear  # noqa: E402
from mpformer.models.fp8 import recipe_of  # noqa: E402


def _run(device: str, recipe: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    r = recipe_of(Fp8Options(recipe=recipe))
    state = DelayedScalingState(r, device=device) if recipe == "delayed" else None
    x = x.detach().clone().to(device).requires_grad_()  # a leaf of its own (a second run accumulates no grad)
    w = w.detach().clone().to(device).requires_grad_()
    y = fp8_linear(x, w, r, state)
    y.backward(dy.to(device))
    return y.detach().cpu().float(), x.grad.cpu().float(), w.grad.cpu().float()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_float8_gemms_match_the_cpu_kernel(recipe):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g).to(torch.bfloat16)
    w = (torch.randn(192, 128, generator=g) / 11).to(torch.bfloat16)
    dy = torch.randn(256, 192, generator=g).to(torch.bfloat16)
    for got, want in zip(_run(DEVICE, recipe, x, w, dy), _run("cpu", recipe, x, w, dy), strict=True):
        assert (got - want).abs().max() <= 1e-2 * want.abs().max(), recipe


def test_a_block_saves_what_the_memory_model_counts():
    from mpformer.autoconfig.layer_memory import layer_bytes
    from mpformer.core.layout import ParallelLayout
    from mpformer.core.model_config import ModelConfig
    from mpformer.core.model_options import ModelOptions
    from mpformer.layers.linear import Linear
    from mpformer.models.transformer import Transformer
    from mpformer.testing.memory import saved_layer_bytes

    s, b = 128, 2
    cfg = ModelConfig(arch="llama", num_layers=1, hidden_size=128, num_attention_heads=8, num_kv_heads=2,
                      ffn_hidden_size=352, vocab_size=512, max_position_embeddings=s)
    model = Transformer(cfg, ModelOptions(), seed=1).to(device=DEVICE, dtype=torch.bfloat16)
    for m in model.modules():
        if isinstance(m, Linear):
            m.enable_fp8(recipe_of(Fp8Options()))
    tokens = torch.randint(0, cfg.vocab_size, (b, s), device=DEVICE)
    seq = model.sequence(tokens)
    x = model.embed_tokens(tokens, seq).detach().requires_grad_()
    got = saved_layer_bytes(model, seq, x, torch.bfloat16)
    want = layer_bytes(cfg, ParallelLayout(), s, b, "fp8", fp8=Fp8Options()).saved
    if DEVICE == "cuda":  # the flash kernel's own extras (its rng state, a padded log-sum-exp) are not counted
        assert abs(got / want - 1) <= 0.01, (got, want)
    else:
        assert got == want


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_experts_grouped_kernel_matches_the_cpu_loop(recipe):
    """The routed experts' float8 GEMMs (layers/fp8_expert_gemm.py) with e4m3 gradients: on the device
    torch._scaled_grouped_mm (one launch for every expert; an expert with no rows among them), against the
    CPU's _scaled_mm per expert on the same float8 operands (bf16 out: within 1e-2 of the largest element)."""
    from mpformer.layers.fp8 import Float8Recipe
    from mpformer.layers.fp8_expert_gemm import Groups, choose_fp8_method, fp8_grouped_linear

    r = Float8Recipe(recipe, "e4m3")
    counts, h, n = [32, 0, 48, 16], 128, 64
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), h, generator=g).to(torch.bfloat16)
    w = (torch.randn(len(counts), n, h, generator=g) / 11).to(torch.bfloat16)
    dy = torch.randn(sum(counts), n, generator=g).to(torch.bfloat16)
    method = choose_fp8_method(DEVICE, r, h, n)
    assert method == ("grouped" if DEVICE == "cuda" else "loop")

    def run(device: str, how: str) -> list[torch.Tensor]:
        xx = x.clone().to(device).requires_grad_()
        ww = w.clone().to(device).requires_grad_()
        y = fp8_grouped_linear(xx, ww, Groups.of(counts, torch.device(device)), r, method=how)
        y.backward(dy.to(device))
        return [t.detach().cpu().float() for t in (y, xx.grad, ww.grad)]

    for got, want in zip(run(DEVICE, method), run("cpu", "loop"), strict=True):
        assert (got - want).abs().max() <= 1e-2 * want.abs().max(), recipe
