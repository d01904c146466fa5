"""Mechanics of the cost model (its accuracy against published runs is reported, not asserted, yet)."""

from __future__ import annotations

import pytest

from mpformer.autoconfig.cluster import load_cluster
from mpformer.autoconfig.cost import _collective, gemm_efficiency, iteration_time, layer_times
from mpformer.autoconfig.memory import Workload
from mpformer.models.config import ModelConfig
from mpformer.parallel.layout import ParallelLayout

GPT = ModelConfig(arch="gpt2", num_layers=8, hidden_size=4096, num_attention_heads=32, vocab_size=51200,
                  activation="gelu_tanh", attention_bias=True, mlp_bias=True, max_position_embeddings=2048)
W = Workload(global_batch_size=16, micro_batch_size=1, seq_length=2048, precision="bf16")


def test_ring_collectives_follow_alpha_beta():
    c = load_cluster("dgx-a100-80gb")
    nbytes = 64e6
    ag = _collective(c, "all_gather", nbytes, 8, False)
    assert ag == pytest.approx(7 * c.intra_latency + nbytes * 7 / 8 / c.intra_bandwidth)
    assert _collective(c, "all_reduce", nbytes, 8, False) == pytest.approx(2 * ag)
    assert _collective(c, "all_reduce", nbytes, 8, True) > 5 * _collective(c, "all_reduce", nbytes, 8, False)
    assert _collective(c, "all_reduce", nbytes, 1, False) == 0.0


def test_gemm_efficiency_grows_with_size_and_uses_a_measured_table():
    c = load_cluster("dgx-h100")
    assert gemm_efficiency(c, "bf16", 128, 128, 128) < gemm_efficiency(c, "bf16", 8192, 8192, 8192) <= 0.85
    measured = c.__class__(**{**c.__dict__, "measured": {"matmul": [
        {"dtype": "bf16", "m": 64, "n": 64, "k": 64, "flops_per_s": 1e14},
        {"dtype": "bf16", "m": 4096, "n": 4096, "k": 4096, "flops_per_s": 7e14}]}})
    assert gemm_efficiency(measured, "bf16", 4000, 4000, 4000) == pytest.approx(7e14 / 989e12)


def test_sequence_parallel_moves_the_same_bytes_and_tp_splits_compute():
    c = load_cluster("dgx-a100-80gb")
    f1, _, _, _ = layer_times(GPT, ParallelLayout(), W, c)
    f8, _, _, comm = layer_times(GPT, ParallelLayout(tp=8), W, c)
    _, _, _, comm_sp = layer_times(GPT, ParallelLayout(tp=8, sequence_parallel=True), W, c)
    assert f8 < f1 / 4 and comm > 0
    assert comm_sp == pytest.approx(comm, rel=1e-9)  # AG + RS = one AR on a ring


def test_pipeline_bubble_and_dp_terms():
    c = load_cluster("dgx-a100-80gb", nodes=2)
    small_vocab = ModelConfig(**{**GPT.to_dict(), "vocab_size": 512})  # equal stages: the head is negligible
    n = small_vocab.num_params()
    one = iteration_time(small_vocab, ParallelLayout(dp=1), W, c, params_per_rank=n)
    pp = iteration_time(small_vocab, ParallelLayout(dp=1, pp=4), W, c, params_per_rank=n // 4)
    assert one.pp_bubble_s == 0 and pp.pp_bubble_s > 0
    assert pp.pp_bubble_s / pp.iteration_s == pytest.approx(3 / (16 + 3), rel=0.05)  # (p-1)/(m+p-1)
    big_head = iteration_time(GPT, ParallelLayout(dp=1, pp=4), W, c, params_per_rank=n // 4)
    assert big_head.pp_bubble_s / big_head.iteration_s > 3 / 19  # the LM head makes the last stage slowest
    dp = iteration_time(small_vocab, ParallelLayout(dp=16), W, c, params_per_rank=n)
    assert dp.dp_comm_exposed_s > 0 and dp.extra["microbatches"] == 1


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1)])
def test_pipeline_time_extrapolation_equals_the_full_timeline(name, vpp):
    from mpformer.autoconfig.cost import pipeline_time
    from mpformer.pipeline.schedules import build_schedule
    from mpformer.pipeline.simulate import Costs, simulate

    for p in (2, 4, 5):
        stages = p * vpp
        costs = Costs(f=[1.0 + 0.1 * i for i in range(stages)], b=[2.0 - 0.05 * i for i in range(stages)],
                      w=[0.7] * stages, p2p=0.05)
        for m in (4 * p, 7 * p):
            full = simulate(build_schedule(name, p, m, vpp), costs).step_time
            assert pipeline_time(name, p, m, vpp, costs) == pytest.approx(full, rel=1e-9), (name, p, m)
