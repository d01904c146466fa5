"""Out-of-sample local truth (issue 16 part 4): the layouts benchmarks/bench_autoconfig.py scores are
disjoint from the layouts the profile calibrates on, and the CPU host's context-parallel attention is
priced from the profile's measurement of it. No processes, no timing: nothing here depends on the
speed of the machine that runs it."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mpformer.autoconfig.cluster import load_cluster
from mpformer.autoconfig.cp_cost import cp_traffic, measured_on_host
from mpformer.autoconfig.memory import Workload
from mpformer.autoconfig.profile_ranks import IDENTITY, calibration_identities, layout_identity, reference_layouts
from mpformer.core.layout import ParallelLayout, validate
from mpformer.core.model_config import ModelConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("bench_autoconfig", BENCHMARKS / "bench_autoconfig.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_scored_layouts_are_disjoint_from_the_calibration_layouts(bench):
    assert IDENTITY == ("dp", "tp", "pp", "cp", "vpp", "schedule", "zero")
    assert bench.check_out_of_sample(bench.LAYOUTS) == {}
    scored = {layout_identity(f, bench.WORLD) for f in bench.LAYOUTS.values()}
    assert not scored & set(calibration_identities(bench.WORLD)) and len(bench.LAYOUTS) >= 6
    kinds = {(layout_identity(f, bench.WORLD), f.get("cp_kind")) for f in bench.LAYOUTS.values()}
    assert len(kinds) == len(bench.LAYOUTS)  # no two scored layouts alike either (cp kinds told apart)
    # The in-sample rows (--in-sample) are exactly the calibration layouts, each caught by the check.
    assert bench.check_out_of_sample(bench.IN_SAMPLE) == {n: n for n in reference_layouts(bench.WORLD)}


def test_scored_layouts_cover_the_families_the_issue_names_and_run(bench):
    """ZeRO-3 x tp, interleaving, a zero-bubble schedule, context parallelism, and plain ones; each a
    layout the runtime accepts for the benchmark's model and batch."""
    fields = list(bench.LAYOUTS.values())
    assert any(f.get("zero") == 3 and f.get("tp", 1) > 1 for f in fields)
    assert any(f.get("schedule") == "interleaved" and f.get("vpp", 1) > 1 for f in fields)
    assert any(f.get("schedule", "").startswith("zb-") for f in fields)
    assert {f.get("cp_kind", "ring") for f in fields if f.get("cp", 1) > 1} >= {"ring", "ulysses"}
    m = ModelConfig(arch="llama", **{k.split(".")[1]: v for k, v in bench.MODEL.items() if k.startswith("model.")})
    for f in fields:
        validate(ParallelLayout(**f), m, bench.WORLD, global_batch_size=bench.GLOBAL_BATCH, micro_batch_size=1,
                 seq_length=bench.SEQ)


def test_a_collision_is_caught_by_identity_not_by_name(bench):
    assert layout_identity({"pp": 4}, 4) == (1, 1, 4, 1, 1, "1f1b", 0)
    # Same degrees, schedule and ZeRO stage as the profile's "dp2 tp2", other name and sp flag: a collision.
    assert bench.check_out_of_sample({"mine": {"dp": 2, "tp": 2}}) == {"mine": "dp2 tp2"}
    assert bench.check_out_of_sample({"z1": {"pp": 4, "zero": 1}, "v2": {"pp": 4, "vpp": 2,
                                                                         "schedule": "interleaved"}}) == {}


def _host(rows: list[tuple[int, float]]):
    """local-cpu (4 ranks on 2 cores) whose profile measured ring/2 at (score elements, extra seconds)."""
    c = replace(load_cluster("local-cpu"), measured={})
    fit = {"heads": 6, "kv_heads": 2, "head_dim": 64,
           "rows": [{"seq": 0, "scores_per_rank": p, "seconds": e + 0.001, "fused_s": 0.001, "extra_s": e}
                    for p, e in rows]}
    return replace(c, measured={"cp_attention": {"ring/2": fit}})


def test_cpu_host_prices_cp_attention_on_the_profiles_line():
    m = ModelConfig(arch="llama", num_layers=2, hidden_size=256, num_attention_heads=8, num_kv_heads=4,
                    ffn_hidden_size=512, vocab_size=512)
    w = Workload(global_batch_size=4, micro_batch_size=1, seq_length=256, precision="fp32")
    ring = ParallelLayout(dp=2, cp=2)
    scores = 8 * 256 * 256 / 2  # heads x b x s x s / cp
    c = _host([(scores / 4, 0.010), (scores / 2, 0.014)])  # 0.004 s more per scores / 4
    fwd, bwd = measured_on_host(m, ring, w, c)
    assert fwd + bwd == pytest.approx(0.014 + 0.008) and bwd == pytest.approx(2 * fwd)  # split as compute.py
    assert cp_traffic(m, ring, w, c, attn=1.0) == pytest.approx((fwd, bwd))
    # Recompute reruns the forward's part; tp shares the heads (fewer scores per rank).
    assert cp_traffic(m, replace(ring, recompute="full"), w, c, attn=1.0) == pytest.approx((fwd, bwd + fwd))
    tp2 = measured_on_host(m, ParallelLayout(dp=1, tp=2, cp=2), w, c)
    assert sum(tp2) == pytest.approx(0.014)
    # Never below zero, and a slope measured negative (noise) is taken as flat.
    assert sum(measured_on_host(m, ring, w, _host([(1.0, 0.02), (scores, 0.01)]))) == pytest.approx(0.01)
    tiny = replace(w, seq_length=16)
    assert sum(measured_on_host(m, ring, tiny, _host([(scores / 2, 0.001), (scores, 0.1)]))) == 0.0
    # Not measured: a kind or degree the profile did not run, an accelerator, no profile.
    assert measured_on_host(m, replace(ring, cp_kind="ulysses"), w, c) is None
    assert measured_on_host(m, ParallelLayout(dp=1, cp=4), w, c) is None
    assert measured_on_host(m, ring, w, replace(c, cores=None)) is None
    assert measured_on_host(m, ring, w, replace(c, measured={})) is None
