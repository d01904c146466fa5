"""Mechanics of the cost model (its accuracy against published runs is reported, not asserted, yet)."""

from __future__ import annotations

import pytest

from mpformer.autoconfig.cluster import cluster_dir, load_cluster
from mpformer.autoconfig.compute import gemm_efficiency
from mpformer.autoconfig.cost import _collective, iteration_time, layer_compute, layer_times, tp_step_time
from mpformer.autoconfig.memory import Workload
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig

GPT = ModelConfig(arch="gpt2", num_layers=8, hidden_size=4096, num_attention_heads=32, vocab_size=51200,
                  activation="gelu_tanh", attention_bias=True, mlp_bias=True, max_position_embeddings=2048)
W = Workload(global_batch_size=16, micro_batch_size=1, seq_length=2048, precision="bf16")


def test_ring_collectives_follow_alpha_beta():
    c = load_cluster("dgx-a100-80gb")
    nbytes = 64e6
    ag = _collective(c, "all_gather", nbytes, 8, False)
    # NCCL's bus bandwidth reaches bus_fraction of the link's rate (the preset's measured figure)
    assert ag == pytest.approx(7 * c.intra_latency + nbytes * 7 / 8 / (c.intra_bandwidth * c.bus_fraction[0]))
    assert _collective(c, "all_reduce", nbytes, 8, False) == pytest.approx(2 * ag)
    assert _collective(c, "all_reduce", nbytes, 8, True) > 5 * _collective(c, "all_reduce", nbytes, 8, False)
    assert _collective(c, "all_reduce", nbytes, 1, False) == 0.0


def test_gemm_efficiency_grows_with_size_and_uses_a_measured_table():
    c = load_cluster("dgx-h100")
    assert gemm_efficiency(c, "bf16", 128, 128, 128) < gemm_efficiency(c, "bf16", 8192, 8192, 8192) <= c.gemm_fraction
    measured = c.__class__(**{**c.__dict__, "measured": {"matmul": [
        {"dtype": "bf16", "m": 64, "n": 64, "k": 64, "flops_per_s": 1e14},
        {"dtype": "bf16", "m": 4096, "n": 4096, "k": 4096, "flops_per_s": 7e14}]}})
    assert gemm_efficiency(measured, "bf16", 4000, 4000, 4000) == pytest.approx(7e14 / 989e12)


def test_fp32_gemms_run_at_the_tf32_rate_where_the_runtime_enables_it():
    """train.tf32 (on by default): fp32 GEMMs priced at the device's TF32 peak, the attention kernel at
    its own; off, or on a device without TF32 (a CPU preset), at the fp32 rate."""
    from dataclasses import replace

    from mpformer.autoconfig.runtimes import MPFORMER

    fp32 = replace(W, precision="fp32")
    off = replace(fp32, runtime=replace(MPFORMER, tf32=False))
    h100 = load_cluster("dgx-h100")
    on_parts, off_parts = (layer_compute(GPT, ParallelLayout(), w, h100).parts for w in (fp32, off))
    assert on_parts["gemm"] < off_parts["gemm"] / 3  # 494 against 67 TFLOP/s dense (memory-bound ones aside)
    assert on_parts["attention"] == pytest.approx(off_parts["attention"])
    cpu = load_cluster("local-cpu")
    assert layer_compute(GPT, ParallelLayout(), fp32, cpu).parts == layer_compute(GPT, ParallelLayout(), off, cpu).parts


def test_the_attention_kernel_priced_is_the_one_the_runtime_runs():
    """mpformer's attention core is the runtime's own choice (context_parallel/fused.py): fused on a GPU,
    dropout and masks included (flash, or efficient with a mask or in fp32); on a CPU fused but with
    attention dropout (math); a head size no fused GPU kernel takes is refused in one line. The math
    kernel is priced by its GEMMs and score passes, dearer than the flash FLOPs at long sequences."""
    from dataclasses import replace

    from mpformer.autoconfig.cost import fused_attention

    drop = ModelConfig(**{**GPT.to_dict(), "attention_dropout": 0.1})
    window = ModelConfig(**{**drop.to_dict(), "arch": "mistral", "sliding_window": 1024, "activation": "swiglu",
                            "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 4096})
    gpu, cpu = load_cluster("dgx-h100"), load_cluster("local-cpu")
    L = ParallelLayout()
    assert fused_attention(GPT, L, W, gpu) and fused_attention(GPT, L, W, cpu)
    assert fused_attention(drop, L, W, gpu) and not fused_attention(drop, L, W, cpu)
    assert fused_attention(window, L, W, gpu)  # dropout with a window that cuts the 2048 positions: efficient
    assert not fused_attention(GPT, L, replace(W, flash_attention=False), gpu)  # a published run without flash
    from mpformer.autoconfig.kernels import attention_kernel
    from mpformer.core.errors import ConfigError

    def kernel(m, precision="bf16", layout=L, cpu=False):
        return attention_kernel(m, layout, 2048, "mpformer", True, cpu, precision)

    assert (kernel(GPT), kernel(GPT, "fp16"), kernel(GPT, "fp32")) == ("flash", "flash", "efficient")
    assert kernel(window) == "efficient" and kernel(drop) == "flash" and kernel(drop, cpu=True) == "math"
    assert kernel(GPT, layout=ParallelLayout(pp=2, pp_token_slices=2)) == "flash"  # blocks without a mask
    odd = ModelConfig(**{**GPT.to_dict(), "hidden_size": 12 * 6, "num_attention_heads": 12})  # head size 6
    with pytest.raises(ConfigError, match=r"head dim 6 in torch\.bfloat16 has no fused CUDA kernel"):
        kernel(odd)
    fused_s = layer_compute(GPT, L, W, gpu).parts["attention"]
    math = layer_compute(drop, L, W, cpu)
    assert math.parts["attention"] == 0.0 and math.parts["gemm"] > layer_compute(GPT, L, W, cpu).parts["gemm"]
    assert fused_s > 0


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


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
                                      ("zb-v", 2), ("dualpipev", 2)])
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


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_schedules_long_timelines_are_extended_within_one_percent(name):
    import random

    from mpformer.autoconfig.cost import pipeline_time
    from mpformer.pipeline.schedules import build_schedule
    from mpformer.pipeline.simulate import Costs, simulate

    rng = random.Random(3)
    for p in (2, 4, 6):
        st = 2 * p
        costs = Costs(f=[rng.uniform(0.5, 1.5) for _ in range(st)], b=[rng.uniform(0.8, 2.0) for _ in range(st)],
                      w=[rng.uniform(0.3, 1.0) for _ in range(st)], p2p=0.05)
        for m in (8 * p, 12 * p):  # 8p: timed whole; beyond: extended from 4p and 6p
            full = simulate(build_schedule(name, p, m, 2), costs).step_time
            assert pipeline_time(name, p, m, 2, costs) == pytest.approx(full, rel=1e-9 if m == 8 * p else 1e-2)


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2),
                                      ("dualpipev", 2)])
def test_back_to_back_period_is_the_repeated_timelines_growth(name, vpp):
    """train.overlap_validation prices the period of steps with no barrier between them: simulate's
    time of three steps back to back less that of two (actions.repeat), timed whole up to 10p
    micro-batches, extended beyond (within 1% on random uneven stages); the closed form stays a lower
    bound of it; and it is never longer than one step alone."""
    import random

    from mpformer.autoconfig.pipeline_cost import pipeline_bound, pipeline_time
    from mpformer.pipeline.actions import repeat
    from mpformer.pipeline.schedules import build_schedule
    from mpformer.pipeline.simulate import Costs, simulate

    rng = random.Random(1)
    for p in (2, 4):
        st = p * vpp
        for _ in range(2):
            costs = Costs(f=[rng.uniform(0.5, 1.5) for _ in range(st)], b=[rng.uniform(0.5, 1.5) for _ in range(st)],
                          w=[rng.uniform(0.3, 1.0) for _ in range(st)], p2p=rng.uniform(0.0, 0.2))
            for m in (4 * p, 10 * p, 17 * p):
                s = build_schedule(name, p, m, vpp)
                full = simulate(repeat(s, 3), costs).step_time - simulate(repeat(s, 2), costs).step_time
                got = pipeline_time(name, p, m, vpp, costs, back_to_back=True)
                assert got == pytest.approx(full, rel=1e-9 if m <= 10 * p else 1e-2), (p, m)
                assert pipeline_bound(name, p, m, vpp, costs, back_to_back=True) <= full * (1 + 1e-12)
                assert full <= simulate(s, costs).step_time * (1 + 1e-12)


def test_overlap_validation_prices_zb_h2_without_its_bubble():
    """Qi et al.'s setting, T_F = T_B = T_W at p = 6, m = 24: one ZB-H2 step alone keeps 5 units of fill
    and drain (77 for 72 of work each); back to back, under train.overlap_validation, none (72);
    1F1B's first rank ends every step with a backward that waits for the last stage's, so its period
    is a whole step. The cost model's iteration follows the runtime's setting (what is left of the
    bubble there is the stages' imbalance: the embedding's and the head's)."""
    from dataclasses import replace

    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.pipeline_cost import pipeline_time
    from mpformer.autoconfig.runtimes import MPFORMER
    from mpformer.pipeline.simulate import Costs

    even = Costs(f=1.0, b=1.0, w=1.0, p2p=0.0)
    assert pipeline_time("zb-h2", 6, 24, 1, even) == pytest.approx(77.0)
    assert pipeline_time("zb-h2", 6, 24, 1, even, back_to_back=True) == pytest.approx(72.0)
    assert pipeline_time("1f1b", 6, 24, 1, even, back_to_back=True) == pytest.approx(87.0)
    c = load_cluster("dgx-a100-80gb")
    lay = ParallelLayout(tp=1, pp=4, dp=1, schedule="zb-h2")
    w = Workload(global_batch_size=8, micro_batch_size=1, seq_length=2048, precision="bf16")
    w_ov = replace(w, runtime=replace(MPFORMER, post_validation=True, overlap_validation=True))
    alone, ov = (iteration_time(GPT, lay, x, c, params_per_rank=10**9) for x in (w, w_ov))
    assert ov.pp_bubble_s < 0.8 * alone.pp_bubble_s and ov.iteration_s < alone.iteration_s
    assert ov.compute_s == alone.compute_s
    # A tied embedding on the first and the last rank: their gradient sum ends the step for both.
    tied = replace(GPT, tie_embeddings=True)
    assert iteration_time(tied, lay, w_ov, c, params_per_rank=10**9).iteration_s == \
        iteration_time(tied, lay, w, c, params_per_rank=10**9).iteration_s


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_schedules_are_priced_with_the_backward_split(name):
    """The V schedules run the input and the weight gradient apart (as ZB-H1 does): their stages'
    W is priced apart from B, the same total per stage as ZB-H1's with the same layers."""
    from mpformer.autoconfig.cost import stage_costs

    c = load_cluster("dgx-a100-80gb")
    v = ParallelLayout(tp=1, pp=2, dp=1, vpp=2, schedule=name)
    h1 = ParallelLayout(tp=1, pp=4, dp=1, schedule="zb-h1")  # the same 4 stages of 2 layers
    fv, bv, wv, _ = stage_costs(GPT, v, W, c)
    fh, bh, wh, _ = stage_costs(GPT, h1, W, c)
    assert min(wv) > 0
    for x, y in ((fv, fh), (bv, bh), (wv, wh)):
        assert x == pytest.approx(y, rel=1e-12)


@pytest.mark.parametrize("name,pp,m", [("gpipe", 2, 2), ("1f1b", 4, 8), ("zb-h1", 4, 8)])
def test_shared_step_time_is_processor_sharing(name, pp, m):
    """Ranks sharing cores, against what processor sharing must give: a core each (dilation 1) is the
    simulator's timeline; one core for all (dilation k) keeps it busy, so the step is the total work
    (the fixed point within 2%); two cores lie between max(timeline, work / 2) and twice the timeline."""
    from mpformer.autoconfig.sharing import shared_step_time
    from mpformer.pipeline.schedules import build_schedule
    from mpformer.pipeline.simulate import Costs, simulate

    s = build_schedule(name, pp, m, 1)
    c = Costs(f=1.0, b=2.0, w=1.0, p2p=0.0)
    work = sum(c.duration(a, pp) for row in s.actions for a in row)
    alone = simulate(s, c).step_time
    assert shared_step_time(s, c, lambda k: 1.0) == pytest.approx(alone)
    assert shared_step_time(s, c, lambda k: float(k)) == pytest.approx(work, rel=0.02)
    two = shared_step_time(s, c, lambda k: max(1.0, k / 2))
    assert max(alone, work / 2) * 0.99 <= two <= 2 * alone


def test_ranks_sharing_cores_slow_compute_and_fill_the_bubbles():
    """local-cpu with 4 ranks on 2 cores and no profile: compute runs at half the rate when every rank
    computes; a pipeline's bubbles are mostly absorbed (idle ranks lend their cores)."""
    from dataclasses import replace

    from mpformer.autoconfig.sharing import slowdowns

    c = replace(load_cluster("local-cpu"), measured={})  # the preset's numbers, not this machine's profile
    assert slowdowns(c) == {1: 1.0, 2: 1.0, 4: 2.0} and slowdowns(load_cluster("dgx-h100")) is None
    m = ModelConfig(arch="llama", num_layers=8, hidden_size=256, num_attention_heads=8, num_kv_heads=4,
                    ffn_hidden_size=768, vocab_size=512)
    w = Workload(global_batch_size=16, micro_batch_size=1, seq_length=256, precision="fp32")
    n = m.num_params()
    alone = iteration_time(m, ParallelLayout(dp=4), w, replace(c, cores=4), params_per_rank=n)
    shared = iteration_time(m, ParallelLayout(dp=4), w, c, params_per_rank=n)
    assert shared.compute_s == pytest.approx(2 * alone.compute_s, rel=1e-6)
    pp_alone = iteration_time(m, ParallelLayout(dp=1, pp=4), w, replace(c, cores=4), params_per_rank=n // 4)
    pp = iteration_time(m, ParallelLayout(dp=1, pp=4), w, c, params_per_rank=n // 4)
    assert pp_alone.pp_bubble_s > 0.1 * pp_alone.iteration_s  # (p-1)/(m+p-1) = 3/19 on cores of their own
    assert pp.iteration_s < 2 * pp_alone.iteration_s * (1 - 0.1)  # sharing the cores absorbs most of it
    assert pp.iteration_s >= pp.compute_s * 0.9


def test_reference_model_calibrates_compute():
    """A profile's reference measurement scales every compute term by measured / modelled time."""
    from dataclasses import replace

    from mpformer.autoconfig.cost import calibration

    def compute_factor(cluster):
        return calibration(cluster).compute

    c = replace(load_cluster("local-cpu"), measured={})
    ref = {"model": {"arch": "llama", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                     "num_kv_heads": 2, "ffn_hidden_size": 256, "vocab_size": 512},
           "seq_length": 128, "micro_batch_size": 1, "precision": "fp32", "seconds": 1.0}
    k = compute_factor(replace(c, measured={"reference": ref}))
    doubled = compute_factor(replace(c, measured={"reference": {**ref, "seconds": 2.0}}))
    assert compute_factor(c) == 1.0 and doubled == pytest.approx(2 * k)
    w = Workload(global_batch_size=4, micro_batch_size=1, seq_length=128, precision="fp32")
    m = ModelConfig(**ref["model"])
    base = iteration_time(m, ParallelLayout(dp=1), w, replace(c, cores=4), params_per_rank=m.num_params())
    cal = iteration_time(m, ParallelLayout(dp=1), w, replace(c, cores=4, measured={"reference": ref}),
                         params_per_rank=m.num_params())
    assert cal.compute_s == pytest.approx(k * base.compute_s, rel=1e-6)


def test_short_micro_batches_separate_the_cost_per_launch_from_the_work():
    """A reference whose step is k x the modelled kernels + launch x the kernels launched, measured at
    its sequence and as four short micro-batches: calibration.py recovers both, adds launch x the
    kernels of every layer, head and embedding pass, and a layout that launches the same kernels on
    less work (tp: narrower GEMMs) pays relatively more than a compute factor alone would say."""
    from dataclasses import replace

    from mpformer.autoconfig.cost import _PARTS, calibration, kernel_launches, stage_costs

    c = replace(load_cluster("local-cpu"), measured={})
    model = {"arch": "llama", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_kv_heads": 2,
             "ffn_hidden_size": 256, "vocab_size": 512}
    m, one = ModelConfig(**model), ParallelLayout(dp=1)
    k, launch = 1.3, 2e-4

    def step(seq: int) -> tuple[float, float]:  # modelled work, kernels launched (one micro-batch)
        w = Workload(1, 1, seq, "fp32")
        fc, bc, wc, _ = stage_costs(m, one, w, c)
        layer, head, emb = (kernel_launches(m, one, w, p) for p in _PARTS)
        return sum(fc) + sum(bc) + sum(wc), sum(m.num_layers * a + b + e for a, b, e in zip(layer, head, emb))

    (work, n), (short, _) = step(128), step(32)
    t = k * work + launch * n
    ref = {"model": model, "seq_length": 128, "micro_batch_size": 1, "precision": "fp32", "seconds": t,
           "short_pieces": 4, "short_micro_batches_ratio": 4 * (k * short + launch * n) / t}
    cal = calibration(replace(c, measured={"reference": ref}))
    assert cal.compute == pytest.approx(k, rel=1e-9) and cal.launch == pytest.approx(launch, rel=1e-9)
    host = replace(c, measured={"reference": ref}, cores=4)  # ranks on cores of their own: compute alone
    assert step(128)[0] * k + launch * n == pytest.approx(t)
    w = Workload(1, 1, 128, "fp32")
    fc, bc, wc, _ = stage_costs(m, one, w, host)
    assert sum(fc) + sum(bc) + sum(wc) == pytest.approx(t, rel=1e-9)
    tp = ParallelLayout(dp=1, tp=2, sequence_parallel=True)
    with_launch = sum(map(sum, stage_costs(m, tp, w, host)[:3]))
    compute_only = replace(c, measured={"reference": {**ref, "short_micro_batches_ratio": None}}, cores=4)
    assert with_launch > sum(map(sum, stage_costs(m, tp, w, compute_only)[:3]))
    # A ratio that would make the launches negative (noise) leaves everything to the compute factor.
    noisy = calibration(replace(c, measured={"reference": {**ref, "short_micro_batches_ratio": 0.5}}))
    assert noisy.launch == 0.0 and noisy.compute == pytest.approx(t / work)


def _layout_profile(factors: dict[str, float], tp_factor: float) -> tuple:
    """A local-cpu profile whose reference layouts ran ``factors`` times the model's prediction
    (pipelines) and whose tensor-parallel step took ``tp_factor`` times its modelled collectives
    beyond its compute."""
    from dataclasses import replace

    c = replace(load_cluster("local-cpu"), measured={})
    ref = {"model": {"arch": "llama", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                     "num_kv_heads": 2, "ffn_hidden_size": 256, "vocab_size": 512},
           "seq_length": 128, "micro_batch_size": 1, "precision": "fp32", "seconds": 0.1, "split_backward_ratio": 1.0}
    loaded = {"2": {"slowdown": 1.1}, "3": {"slowdown": 1.6}, "4": {"slowdown": 2.2}}
    base = replace(c, measured={"reference": ref, "loaded": loaded})
    m, busy = ModelConfig(**ref["model"]), 2 * 0.1 * 2.2  # 2 micro-batches per rank at slowdown(4)
    layouts = {}
    for name, fields in {"pp4": {"dp": 1, "pp": 4}, "dp2 pp2": {"dp": 2, "pp": 2},
                         "dp2 tp2": {"dp": 2, "tp": 2, "sequence_parallel": True}}.items():
        b = iteration_time(m, ParallelLayout(**fields), Workload(8, 1, 128, "fp32"), base, params_per_rank=0)
        pred = b.iteration_s - b.dp_comm_exposed_s - b.optimizer_s
        row = {"layout": fields, "world": 4, "microbatches": 8}
        if "tp" in fields:  # the profile's step has no once-per-step all-reduce of replicated gradients
            step = tp_step_time(m, ParallelLayout(**fields), base)
            measured = pred - step + (tp_factor - 1) * (b.tp_comm_s - step)
            # The ledger's waits (recorded, not used: the step decides the factor).
            row["tp_waits_relative_to_busy"] = 3 * (b.tp_comm_s - step) / busy
        else:
            measured = factors[name] * pred
        layouts[name] = row | {"relative_to_busy": measured / busy}
    return base, replace(base, measured={**base.measured, "layouts": layouts})


def test_reference_layouts_calibrate_pipelines_and_tensor_parallel_waits():
    """calibration.py recovers the factors a profile's reference layouts ran at against the model's
    prediction (pipelines by depth, the tensor-parallel waits), interpolates depths between, clamps
    absurd ones, and scales other models' candidates by them: a pipeline's factor whatever its
    schedule (interleaved and zero-bubble ones too)."""
    from dataclasses import replace

    from mpformer.autoconfig.calibration import LIMITS
    from mpformer.autoconfig.cost import calibration

    base, c = _layout_profile({"pp4": 1.3, "dp2 pp2": 1.1}, tp_factor=2.0)
    cal = calibration(c)
    assert cal.pipeline == pytest.approx({4: 1.3, 2: 1.1}, rel=1e-9) and cal.tp == pytest.approx({2: 2.0}, rel=1e-9)
    assert cal.pipeline_factor(3) == pytest.approx(1.2) and cal.pipeline_factor(8) == pytest.approx(1.3)
    assert cal.pipeline_factor(1) == 1.0 and cal.pipeline_factor(4, "zb-h2") == pytest.approx(1.3)
    assert cal.pipeline_factor(2, "interleaved") == pytest.approx(1.1)
    assert calibration(base).pipeline == {} and calibration(base).tp == {} and calibration(base).tp_factor(4) == 1.0
    absurd = _layout_profile({"pp4": 50.0, "dp2 pp2": 0.01}, tp_factor=1.0)[1]
    assert calibration(absurd).pipeline == {4: LIMITS[1], 2: LIMITS[0]}

    m = ModelConfig(arch="llama", num_layers=8, hidden_size=256, num_attention_heads=8, num_kv_heads=4,
                    ffn_hidden_size=768, vocab_size=512)
    w = Workload(global_batch_size=16, micro_batch_size=1, seq_length=256, precision="fp32")

    def parts(cluster, **fields):
        b = iteration_time(m, ParallelLayout(**fields), w, cluster, params_per_rank=m.num_params() // 4)
        return b.iteration_s - b.dp_comm_exposed_s - b.optimizer_s, b.tp_comm_s

    assert parts(c, dp=1, pp=4)[0] == pytest.approx(1.3 * parts(base, dp=1, pp=4)[0], rel=1e-9)
    assert parts(c, dp=4)[0] == pytest.approx(parts(base, dp=4)[0], rel=1e-9)  # no pipeline, no TP: as before
    tp_c, tp_base = parts(c, dp=2, tp=2, sequence_parallel=True), parts(base, dp=2, tp=2, sequence_parallel=True)
    assert tp_c[1] == pytest.approx(2.0 * tp_base[1], rel=1e-9)
    assert tp_c[0] - tp_c[1] == pytest.approx(tp_base[0] - tp_base[1], rel=1e-9)
    # A degree the profile did not run: its own fits, times the nearest measured degree's ratio.
    tp4 = {"dp": 1, "tp": 4, "sequence_parallel": True}
    assert cal.tp_factor(4) == pytest.approx(2.0)
    assert parts(c, **tp4)[1] == pytest.approx(2.0 * parts(base, **tp4)[1], rel=1e-9)
    assert calibration(replace(c, measured={})).pipeline == {}
    no_cores = calibration(replace(c, cores=None))  # a CPU profile on a host of its own cores: compute only
    assert no_cores.pipeline == {} and no_cores.compute == pytest.approx(cal.compute)


def test_a_hidden_collective_still_holds_its_sms(tmp_path):
    """links.beside: what the window cannot cover is exposed; the rest costs the compute beside it the
    share of SMs NCCL's CTAs hold (comm_sms / sm_count) for as long as it runs. On the H100 preset
    (24 of 132) a ZeRO-1 step's hidden gradient reduction therefore costs 24/132 of its time."""
    from dataclasses import replace

    from mpformer.autoconfig.links import beside, sm_share
    from mpformer.core.errors import ConfigError

    c = load_cluster("dgx-h100", nodes=4)
    share = 24 / 132
    assert sm_share(c) == pytest.approx(share)
    assert beside(c, 1.0, 0.25) == pytest.approx(0.75 + share * 0.25)  # longer than its window
    assert beside(c, 0.2, 1.0) == pytest.approx(share * 0.2)  # wholly hidden
    assert beside(c, 0.2, 0.0) == pytest.approx(0.2)  # nothing to hide behind
    free = replace(c, comm_sms=0)
    assert sm_share(free) == 0.0 and beside(free, 0.2, 1.0) == 0.0
    assert sm_share(replace(c, sm_count=None)) == 0.0
    # one micro-batch at dp=32: the reduction runs behind the backward; what it hides is not free
    L = ParallelLayout(dp=32, zero=1)
    w = Workload(global_batch_size=32, micro_batch_size=1, seq_length=2048, precision="bf16")
    n = GPT.num_params()
    held, bare = (iteration_time(GPT, L, w, x, params_per_rank=n) for x in (c, free))
    assert held.compute_s == pytest.approx(bare.compute_s)
    assert held.dp_comm_exposed_s > bare.dp_comm_exposed_s > 0
    # the CPU host shares its cores: nothing hides there and the preset states no SMs
    assert load_cluster("local-cpu").comm_sms == 0
    bad = tmp_path / "bad.yaml"
    text = (cluster_dir() / "dgx-h100.yaml").read_text()
    bad.write_text(text.replace("comm_sms: 24", "comm_sms: 132"))
    with pytest.raises(ConfigError, match=r"comm_sms=132 must be a whole number >= 0 and below sm_count \(132\)"):
        load_cluster(str(bad))
