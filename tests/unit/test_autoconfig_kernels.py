"""The cost model's counted kernels (kernels.py) and their times on a device (compute.py): FLOPs and
bytes against hand counts, wave quantisation against NVIDIA's guide, the measured size curve."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpformer.autoconfig.cluster import load_cluster
from mpformer.autoconfig.compute import gemm_efficiency, size_factor, wave_efficiency
from mpformer.autoconfig.cost import layer_compute, layer_times_parts
from mpformer.autoconfig.kernels import head_work, layer_work
from mpformer.autoconfig.memory import Workload
from mpformer.autoconfig.runtimes import TORCHTITAN
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig

GPT = ModelConfig(arch="gpt2", num_layers=8, hidden_size=4096, num_attention_heads=32, vocab_size=51200,
                  activation="gelu_tanh", attention_bias=True, mlp_bias=True, max_position_embeddings=2048,
                  hidden_dropout=0.1, attention_dropout=0.1)
LLAMA = ModelConfig(arch="llama", num_layers=8, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, vocab_size=128256, max_position_embeddings=8192)


def _flops(gemms) -> float:
    return sum(2.0 * g.m * g.n * g.k * g.batch for g in gemms)


@pytest.mark.parametrize("tp", [1, 8])
def test_gemm_flops_are_megatrons_count(tp):
    """The four GEMMs of a GPT layer: 24 s b h^2 / t forward (Narayanan et al.), each backward product
    as much again; the attention core without flash: 4 s^2 b h / t per pass (two batched GEMMs)."""
    s, b, h = 2048, 2, GPT.hidden_size
    w = layer_work(GPT, ParallelLayout(tp=tp, sequence_parallel=tp > 1), s, b, "bf16", "fused", flash=False)
    assert _flops(w.f.gemms) == pytest.approx(24 * s * b * h * h / tp)
    assert _flops(w.bi.gemms) == _flops(w.bw.gemms) == pytest.approx(_flops(w.f.gemms))
    assert _flops(w.attn_f.gemms) == pytest.approx(4 * s * s * b * h / tp)
    assert _flops(w.attn_b.gemms) == pytest.approx(2 * _flops(w.attn_f.gemms))
    flash = layer_work(GPT, ParallelLayout(tp=tp), s, b, "bf16", "fused", flash=True)
    assert flash.attn_f.attention_flops == pytest.approx(0.5 * 4 * s * s * b * h / tp)  # causal half
    assert flash.attn_b.attention_flops == pytest.approx(2.5 * flash.attn_f.attention_flops)


def test_fused_elementwise_bytes_are_counted_per_kernel():
    """Megatron's fused GPT layer under sequence parallelism, 16-bit, forward: two LayerNorms (read and
    write X = s b h / t), two bias-dropout-adds (read two, write one, a 1-byte mask), the bias-GeLU on
    the 4h / t intermediate: (2*2 + 2*3) X a + 2 X + 2 * 4 X a ... per the docstrings."""
    s, b, h, t, a = 2048, 1, GPT.hidden_size, 8, 2
    w = layer_work(GPT, ParallelLayout(tp=t, sequence_parallel=True), s, b, "bf16", "fused", flash=True)
    X, G = s * b * h / t, s * b * 4 * h / t
    assert w.f.stream_bytes == pytest.approx(2 * 2 * X * a + 2 * (3 * X * a + X) + 2 * G * a)
    assert w.bi.stream_bytes == pytest.approx(2 * 3 * X * a + 2 * (2 * X * a + X) + 3 * G * a)
    eager = layer_work(GPT, ParallelLayout(tp=t, sequence_parallel=True), s, b, "bf16", "eager", flash=True)
    assert eager.f.stream_bytes > w.f.stream_bytes and eager.f.launches > w.f.launches


def test_composite_rmsnorm_costs_more_than_torchs_kernel():
    L = ParallelLayout()
    fused, eager, composite = (layer_work(LLAMA, L, 8192, 1, "bf16", k).f.stream_bytes
                               for k in ("fused", "eager", "composite"))
    assert fused < eager < composite


def test_the_fused_head_writes_no_logit_tensor():
    L = ParallelLayout(tp=8)
    fused = head_work(LLAMA, L, 8192, 1, "bf16", fused_cross_entropy=True)
    plain = head_work(LLAMA, L, 8192, 1, "bf16", fused_cross_entropy=False)
    logits = 8192 * LLAMA.vocab_size / 8
    assert fused.f.stream_bytes < plain.f.stream_bytes + plain.bi.stream_bytes
    assert plain.bi.stream_bytes >= 4 * 4 * logits  # the fp32 gradient of every logit is written and read


def test_wave_quantisation_follows_nvidias_guide():
    """A100 (108 SMs): 2304 x 1536 output = 9 x 12 tiles of 256 x 128, one full wave; 2304 x 1664 needs
    117 tiles of that shape (two waves, 54% busy), or 234 of 128 x 128 (three waves, 72%): the better."""
    assert wave_efficiency(2304, 1536, 108) == pytest.approx(1.0)
    assert wave_efficiency(2304, 1664, 108) == pytest.approx(2304 * 1664 / (3 * 108 * 128 * 128))
    # a long k lets split-K fill the last wave of a GEMM with few output tiles
    assert wave_efficiency(2048, 1536, 132, k=12288) > wave_efficiency(2048, 1536, 132)


def test_the_size_curve_reproduces_its_measurements():
    c = load_cluster("dgx-a100-80gb")
    table = c.gemm_measured
    for m, n, k, tf in table["rows"]:
        t0 = 2.0 * m * n * k / table["peak"]
        want = min(1.0, tf * 1e12 / (table["mamf"] * wave_efficiency(m, n, c.sm_count, 1, k)))
        assert size_factor(c, t0) == pytest.approx(want)
    # and with the MAMF and the wave it gives the measured rate of a measured shape back
    m, n, k, tf = table["rows"][2]  # 4096^3: 228 TFLOP/s
    assert gemm_efficiency(c, "bf16", m, n, k) * c.peak("bf16") == pytest.approx(tf * 1e12 * c.gemm_fraction
                                                                                * 312e12 / table["mamf"], rel=1e-6)


def test_recompute_modes_add_what_they_rerun():
    c, w = load_cluster("dgx-h100"), Workload(8, 1, 4096, "bf16")
    L = ParallelLayout(tp=2, sequence_parallel=True)
    lt = layer_compute(LLAMA, L, w, c)
    none, sel, full = (layer_times_parts(LLAMA, replace(L, recompute=r), w, c) for r in ("none", "selective", "full"))
    assert sel[1] == pytest.approx(none[1] + lt.attn_f)
    assert full[1] == pytest.approx(none[1] + lt.f)
    assert full[3] == pytest.approx(1.5 * none[3])  # the recomputed forward's two collectives
    op = layer_times_parts(LLAMA, replace(L, recompute="selective"), replace(w, runtime=TORCHTITAN), c)
    assert none[1] < op[1] < full[1]  # torchtitan's op-level policy reruns part of the forward
