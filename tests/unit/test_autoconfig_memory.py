"""The auto-configurator's memory model against docs/formulas.md and the runtime's own parameter counts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mpformer.autoconfig.cluster import cluster_dir, cluster_names, load_cluster
from mpformer.autoconfig.inflight import inflight
from mpformer.autoconfig.memory import Workload, activation_bytes_per_layer, plan_memory, stage_params
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.optim.memory import zero_formula_bytes

LLAMA = ModelConfig(arch="llama", num_layers=8, hidden_size=256, num_attention_heads=8, num_kv_heads=4,
                    ffn_hidden_size=704, vocab_size=8192)


def test_zero_table_published_check_values():
    """docs/formulas.md: Psi = 7.5B, N_d = 64, 2 + 2 + K(12) bytes -> 120 / 31.4 / 16.6 / 1.9 GB."""
    got = [zero_formula_bytes(z, 7.5e9, 64, w=2, g=2, m=4, k=8) / 1e9 for z in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)


def test_parameters_on_one_rank_equal_the_model_count():
    L = ParallelLayout(dp=1)
    assert stage_params(LLAMA, L, 8, first=True, last=True) == LLAMA.num_params()
    tied = ModelConfig(**{**LLAMA.to_dict(), "tie_embeddings": True})
    assert stage_params(tied, L, 8, first=True, last=True) == tied.num_params()
    # pp=2: the stages split the layers; a tied embedding has a copy on each end stage
    pp = ParallelLayout(dp=1, pp=2)
    assert stage_params(tied, pp, 4, True, False) + stage_params(tied, pp, 4, False, True) == \
        tied.num_params() + tied.vocab_size * tied.hidden_size


def test_activation_bytes_follow_korthikanti():
    s, b, h, a = 2048, 1, 12288, 96
    m = ModelConfig(arch="gpt2", num_layers=2, hidden_size=h, num_attention_heads=a, vocab_size=51200,
                    activation="gelu_tanh", attention_bias=True, mlp_bias=True, max_position_embeddings=s)
    w = Workload(1, b, s, "bf16", flash_attention=False)  # the paper's attention writes its s^2 scores
    base = s * b * h
    assert activation_bytes_per_layer(m, ParallelLayout(), w) == pytest.approx(base * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(m, ParallelLayout(tp=8), w) == pytest.approx(
        base * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert activation_bytes_per_layer(m, ParallelLayout(tp=8, sequence_parallel=True, recompute="selective"),
                                      w) == pytest.approx(base * 34 / 8)
    assert activation_bytes_per_layer(m, ParallelLayout(recompute="full"), w) == pytest.approx(2 * base)
    assert activation_bytes_per_layer(m, ParallelLayout(recompute="full"), Workload(1, b, s, "fp32")) == \
        pytest.approx(4 * base)
    # Flash-style attention (the runtime's SDPA and cp kernels) keeps no score matrix.
    assert activation_bytes_per_layer(m, ParallelLayout(), Workload(1, b, s, "bf16")) == pytest.approx(base * 34)


def test_megatron_block_count_is_korthikantis_and_generalises():
    """Megatron's block op by op: on GPT-3 (4h MLP, MHA, dropout 0.1) exactly Korthikanti et al.'s Table 2
    (34 s b h, 10 + 24 / t without sequence parallelism, + 5 a s^2 b / t with the scores written); on
    Llama 3 70B (GQA, SwiGLU, no dropout, flash) the sum of what each op saves, by hand."""
    from mpformer.autoconfig.layer_memory import megatron_layer_bytes

    s, b, h, a = 2048, 1, 12288, 96
    gpt = ModelConfig(arch="gpt2", num_layers=2, hidden_size=h, num_attention_heads=a, vocab_size=51200,
                      activation="gelu_tanh", attention_bias=True, mlp_bias=True, max_position_embeddings=s,
                      hidden_dropout=0.1, attention_dropout=0.1)
    base = s * b * h
    for L, per in ((ParallelLayout(), 34 + 5 * a * s / h), (ParallelLayout(tp=8), 10 + (24 + 5 * a * s / h) / 8),
                   (ParallelLayout(tp=8, sequence_parallel=True), (34 + 5 * a * s / h) / 8),
                   (ParallelLayout(tp=8, sequence_parallel=True, recompute="selective"), 34 / 8)):
        assert megatron_layer_bytes(gpt, L, s, b, "bf16", flash=False) == pytest.approx(base * per)
    assert megatron_layer_bytes(gpt, ParallelLayout(tp=8, sequence_parallel=True), s, b, "bf16", flash=True) == \
        pytest.approx(base * 34 / 8 + 4 * (a // 8) * s * b)  # flash: the log-sum-exp rows, no scores
    assert megatron_layer_bytes(gpt, ParallelLayout(recompute="full"), s, b, "bf16", flash=False) == 2 * base
    # Llama 3 70B at tp 4 with sequence parallelism, cp 2, seq 8192: per token of the rank (4096 of them)
    llama = ModelConfig(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                        num_kv_heads=8, vocab_size=128256, max_position_embeddings=8192)
    L = ParallelLayout(tp=4, cp=2, sequence_parallel=True)
    tokens, h, q, kv, f = 4096, 8192, 8192 // 4, 1024 // 4, 28672 // 4
    by_hand = tokens * (2 * (4 * h / 4) + 2 * (2 * q + 2 * kv) + 4 * 64 / 4 + 2 * 3 * f)
    assert megatron_layer_bytes(llama, L, 8192, 1, "bf16", flash=True) == pytest.approx(by_hand)


def test_inflight_closed_forms_equal_the_verifier():
    from mpformer.autoconfig.inflight import inflight_closed_form
    from mpformer.core.layout import min_microbatches
    from mpformer.pipeline.schedules import build_schedule
    from mpformer.pipeline.verify import verify

    for name, vpp in [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("zb-h2", 1), ("interleaved", 2), ("interleaved", 3),
                      ("zb-v", 2), ("dualpipev", 2)]:
        for p in (2, 3, 4, 5, 8):
            for m in range(p if name == "interleaved" else 1, 4 * p + 2):
                if (name == "interleaved" and m % p) or m < min_microbatches(name, p):
                    continue
                want = tuple(verify(build_schedule(name, p, m, vpp)).peak_inflight)
                assert inflight_closed_form(name, p, m, vpp) == want, (name, p, m, vpp)


def test_inflight_comes_from_the_schedule():
    assert inflight("1f1b", 4, 8, 1) == (4, 3, 2, 1)
    assert inflight("gpipe", 4, 8, 1)[0] == 8
    assert max(inflight("zb-h2", 4, 16, 1)) <= 2 * 4 - 1


def test_plan_memory_per_stage():
    w = Workload(global_batch_size=16, micro_batch_size=1, seq_length=256, precision="bf16")
    one = plan_memory(LLAMA, ParallelLayout(dp=1), w)
    assert len(one) == 1 and one[0].params == LLAMA.num_params()
    assert one[0].model_state == zero_formula_bytes(0, LLAMA.num_params(), 1, w=2, g=4, m=4, k=8)
    z3 = plan_memory(LLAMA, ParallelLayout(dp=8, zero=3), w)[0]
    assert z3.model_state == pytest.approx(16 * LLAMA.num_params() / 8)  # no 16-bit shard: the fp32 masters
    stages = plan_memory(LLAMA, ParallelLayout(dp=1, pp=4), w)
    assert stages[0].activations > stages[2].activations  # 1F1B: the first stage holds p micro-batches
    assert stages[3].params > stages[1].params  # the LM head


def test_clusters():
    assert {"dgx-a100-80gb", "dgx-h100", "h200-node", "local-cpu"} <= set(cluster_names())
    c = load_cluster("dgx-h100", nodes=512)
    assert c.world_size == 4096 and c.peak("bf16") == 989e12 and c.memory_bytes == 85.52e9  # 81559 MiB
    with pytest.raises(ConfigError, match="unknown cluster 'dgx-z'; valid: dgx-a100-80gb"):
        load_cluster("dgx-z")


@pytest.mark.parametrize("name", ["dgx-a100-80gb", "dgx-h100", "grand-teton-h100-96gb", "h200-node"])
def test_a_gpu_plan_fits_what_a_process_can_use(name):
    """Every GPU preset states the CUDA context, NCCL's buffers and the allocator's reserve (each with its
    source in the YAML), and plans are fitted to the device's memory less all three."""
    c = load_cluster(name)
    assert c.context_gb > 0 and c.nccl_gb > 0 and 0 < c.reserve_fraction < 1
    text = (Path(cluster_dir()) / f"{name}.yaml").read_text()
    assert all(f"- {k}:" in text for k in ("context_gb", "nccl_gb", "reserve_fraction"))  # each explained
    assert c.usable_bytes == pytest.approx(c.memory_bytes * (1 - c.reserve_fraction) - (c.context_gb + c.nccl_gb) * 1e9)
    if name == "dgx-h100":  # the README's example: 85.52 GB reported, 79.1 usable (less than the old "80")
        assert c.usable_bytes / 1e9 == pytest.approx(85.52 * 0.96 - 3.0)


@pytest.mark.parametrize("key,value,says", [
    ("context_gb", -1, "context_gb=-1 must be a finite number >= 0"),
    ("nccl_gb", ".inf", "nccl_gb=inf must be a finite number >= 0"),
    ("reserve_fraction", 1.5, "reserve_fraction=1.5 must be below 1"),
    ("context_gb", 90, "nothing is left for tensors"),
    # every rate, size, latency and fraction (a negative link bandwidth once printed negative plan times)
    ("intra_bandwidth", -1, "intra_bandwidth=-1 must be a finite number > 0"),
    ("memory_bandwidth", 0, "memory_bandwidth=0 must be a finite number > 0"),
    ("inter_latency", ".nan", "inter_latency=nan must be a finite number >= 0"),
    ("peak_flops", "{bf16: -1.0}", r"peak_flops.bf16=-1.0 must be a finite number > 0"),
    ("gemm_fraction", 1.5, r"gemm_fraction=1.5 must be a fraction in \(0, 1\]"),
    ("bus_fraction", "[0.8, 0]", "bus_fraction=0 must be a finite number > 0"),
    ("sm_count", "many", "sm_count='many' must be a finite number > 0"),
])
def test_bad_memory_figures_fail_in_one_line(tmp_path, key, value, says):
    text = (Path(cluster_dir()) / "dgx-h100.yaml").read_text()
    lines = [ln for ln in text.splitlines() if not ln.startswith(f"{key}:")]
    path = tmp_path / "c.yaml"
    path.write_text("\n".join([*lines, f"{key}: {value}"]) + "\n")
    with pytest.raises(ConfigError, match=says):
        load_cluster(str(path))


def test_alpha_beta_fit_recovers_a_link():
    from mpformer.autoconfig.profile import fit_alpha_beta, summarise

    pts = [(x, 2e-5 + x / 5e9) for x in (4e3, 6.4e4, 1e6, 1.6e7)]
    alpha, beta = fit_alpha_beta(pts)
    assert alpha == pytest.approx(2e-5, rel=1e-6) and beta == pytest.approx(5e9, rel=1e-6)
    coll = [{"op": "all_reduce", "ranks": 2, "bus_bytes": x, "seconds": t} for x, t in pts]
    mm = [{"dtype": "fp32", "m": 8, "n": 8, "k": 8, "flops_per_s": 3e10}]
    out = summarise(mm, coll)
    assert out["cluster"]["peak_flops"] == {"fp32": 3e10}
    assert out["cluster"]["intra_bandwidth"] == pytest.approx(5e9, rel=1e-6)


def test_the_fused_head_keeps_its_gradients_and_one_chunk_not_the_logits():
    """Fused (layers/fused_cross_entropy.py): fp32 dX [t, h] and dW [v/tp, h] formed in forward, one
    chunk's logits in fp32 and bf16 and their exp; unfused: fp32 logits and their gradient [t, v/tp]."""
    from mpformer.autoconfig.memory import head_bytes

    w = Workload(global_batch_size=8, micro_batch_size=2, seq_length=4096, precision="bf16")
    t, h, v = 2 * 4096, LLAMA.hidden_size, -(-LLAMA.vocab_size // 2)
    L = ParallelLayout(tp=2)
    assert head_bytes(LLAMA, L, w) == 4 * (t * h + v * h) + 1024 * v * (4 + 4 + 2)
    assert head_bytes(LLAMA, L, replace(w, fused_cross_entropy=False)) == 2 * t * v * 4
    assert head_bytes(LLAMA, L, w) < head_bytes(LLAMA, L, replace(w, fused_cross_entropy=False)) / 4
