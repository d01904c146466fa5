"""The committed fp8 training-quality result (benchmarks/bench_fp8_quality.py, issue 35's "Training quality").

The targets are recomputed here from the recorded per-step losses, not read from the stored pass flags or
metrics: a result file edited by hand, or a script whose metric drifted from the issue's definition, fails.

Three results are committed (benchmarks/README.md). fp8_quality.json: optim.lr=6e-4 with 50 warm-up steps,
where an fp32 run with no float8 lies within the bounds of bf16 (the setting resolves a 1% gap): every recipe
meets both targets (rowwise since its gradients are e4m3, train.fp8.grad_dtype=auto: with e5m2 its mean gap
was 1.05%, kept under the result's ``superseded``); fp8_quality_seed2.json: the same at train.seed=2 (every
recipe meets both). fp8_quality_demo_lr.json: the
demo's lr 2e-3 with 20 warm-up steps, where bf16 and fp32 spike at the end of warm-up and part ways (fp32 is
itself 1.30% from bf16 by the mean gap). The targets missed are strict xfails, listed per file in MISSES,
which fail the suite as soon as a new result meets them, so the list cannot outlive the miss; a check that
holds today fails the suite if a new result breaks it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FILES = ("fp8_quality.json", "fp8_quality_seed2.json", "fp8_quality_demo_lr.json")
RECIPES = ("tensorwise", "rowwise", "delayed")
STEPS = 300
WINDOW = 10  # the final loss: the mean of the last 10 steps' losses
FINAL_BOUND = 0.015
MEAN_BOUND = 0.01


@pytest.fixture(scope="module", params=FILES)
def result(request) -> dict:
    return {**json.loads((RESULTS / request.param).read_text()), "file": request.param}


def _final(losses: list[float]) -> float:
    return sum(losses[-WINDOW:]) / WINDOW


def test_runs_are_the_issues(result: dict) -> None:
    """300 steps of a ~25M model for bf16 and every recipe, every loss finite, from the same start."""
    assert 20e6 <= result["params"] <= 30e6
    assert result["steps"] == STEPS and result["window"] == WINDOW
    assert set(result["runs"]) == {"bf16", *RECIPES}
    for name, run in result["runs"].items():
        assert len(run["loss"]) == STEPS, name
        assert all(x == x and abs(x) < 1e3 for x in run["loss"]), name
    first = result["runs"]["bf16"]["loss"][0]
    # the same initial weights and batch: step 1's losses differ only by float8's rounding of one forward
    for recipe in RECIPES:
        assert result["runs"][recipe]["loss"][0] == pytest.approx(first, rel=2e-3), recipe
    for dims in ("hidden_size", "ffn_hidden_size"):
        assert result["model_config"][dims] % 16 == 0


# (file, target, recipe) the committed results miss (see the module docstring)
MISSES = {("fp8_quality_demo_lr.json", "mean", r) for r in RECIPES}


def _gaps(result: dict, run: list[float]) -> tuple[float, float]:
    """(|final gap|, mean gap) of a curve against bf16's, by the issue's definitions."""
    base = result["runs"]["bf16"]["loss"]
    final_gap = abs(_final(run) - _final(base)) / _final(base)
    return final_gap, sum(abs(o - b) / b for b, o in zip(base, run)) / len(base)


def test_stored_metrics_are_the_recomputed_ones(result: dict) -> None:
    for recipe in RECIPES:
        final_gap, mean_gap = _gaps(result, result["runs"][recipe]["loss"])
        assert result["metrics"][recipe]["mean_gap"] == pytest.approx(mean_gap, rel=1e-9)
        assert abs(result["metrics"][recipe]["final_gap"]) == pytest.approx(final_gap, rel=1e-9)
        assert result["metrics"][recipe]["pass_final"] == (final_gap <= FINAL_BOUND)
        assert result["metrics"][recipe]["pass_mean"] == (mean_gap <= MEAN_BOUND)


@pytest.mark.parametrize(("file", "target", "recipe"), [
    pytest.param(f, t, r, marks=pytest.mark.xfail(strict=True, reason="missed by the committed measurement"))
    if (f, t, r) in MISSES else (f, t, r) for f in FILES for t in ("final", "mean") for r in RECIPES])
def test_recipe_meets_the_target(file: str, target: str, recipe: str) -> None:
    result = json.loads((RESULTS / file).read_text())
    final_gap, mean_gap = _gaps(result, result["runs"][recipe]["loss"])
    if target == "final":
        assert final_gap <= FINAL_BOUND, f"{recipe}: final loss {100 * final_gap:.2f}% from bf16's"
    else:
        assert mean_gap <= MEAN_BOUND, f"{recipe}: mean gap over the curve {100 * mean_gap:.2f}%"


def test_the_setting_resolves_the_bounds() -> None:
    """fp8_quality.json's setting is one where the fp32 control (no float8) is within both bounds of bf16."""
    result = json.loads((RESULTS / "fp8_quality.json").read_text())
    final_gap, mean_gap = _gaps(result, result["control_runs"]["fp32"]["loss"])
    assert final_gap <= FINAL_BOUND and mean_gap <= MEAN_BOUND, (final_gap, mean_gap)


def test_fp32_control_is_recorded(result: dict) -> None:
    """The floor the targets are read against: an fp32 run (no float8) by the same metrics."""
    run = result["control_runs"]["fp32"]["loss"]
    assert len(run) == STEPS
    final_gap, mean_gap = _gaps(result, run)
    assert result["controls"]["fp32"]["mean_gap"] == pytest.approx(mean_gap, rel=1e-9)
    assert abs(result["controls"]["fp32"]["final_gap"]) == pytest.approx(final_gap, rel=1e-9)


@pytest.mark.parametrize("file", FILES)
def test_plot_exists(file: str) -> None:
    png = RESULTS / file.replace(".json", ".png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
