"""The committed fp8 training-quality result (benchmarks/bench_fp8_quality.py, issue 35's "Training quality").

The targets are recomputed here from the recorded per-step losses, not read from the stored pass flags or
metrics: a result file edited by hand, or a script whose metric drifted from the issue's definition, fails.

The committed measurement misses targets (benchmarks/README.md: every recipe's mean gap is 1.45-1.91%, rowwise's
final gap -2.07%; an fp32 run with no float8 is itself 1.30% from bf16 by the same mean gap). Those checks are
strict xfails, listed in MISSES: they fail the suite as soon as a new result meets them, so the list cannot
outlive the miss, and a check that holds today fails the suite if a new result breaks it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
JSON = RESULTS / "fp8_quality.json"
RECIPES = ("tensorwise", "rowwise", "delayed")
STEPS = 300
WINDOW = 10  # the final loss: the mean of the last 10 steps' losses
FINAL_BOUND = 0.015
MEAN_BOUND = 0.01


@pytest.fixture(scope="module")
def result() -> dict:
    return json.loads(JSON.read_text())


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


# (target, recipe) pairs the committed result misses (see the module docstring)
MISSES = {("mean", "tensorwise"), ("mean", "rowwise"), ("mean", "delayed"), ("final", "rowwise")}


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


@pytest.mark.parametrize(("target", "recipe"), [
    pytest.param(t, r, marks=pytest.mark.xfail(strict=True, reason="missed by the committed measurement"))
    if (t, r) in MISSES else (t, r) for t in ("final", "mean") for r in RECIPES])
def test_recipe_meets_the_target(result: dict, target: str, recipe: str) -> None:
    final_gap, mean_gap = _gaps(result, result["runs"][recipe]["loss"])
    if target == "final":
        assert final_gap <= FINAL_BOUND, f"{recipe}: final loss {100 * final_gap:.2f}% from bf16's"
    else:
        assert mean_gap <= MEAN_BOUND, f"{recipe}: mean gap over the curve {100 * mean_gap:.2f}%"


def test_fp32_control_is_recorded(result: dict) -> None:
    """The floor the targets are read against: an fp32 run (no float8) by the same metrics."""
    run = result["control_runs"]["fp32"]["loss"]
    assert len(run) == STEPS
    final_gap, mean_gap = _gaps(result, run)
    assert result["controls"]["fp32"]["mean_gap"] == pytest.approx(mean_gap, rel=1e-9)
    assert abs(result["controls"]["fp32"]["final_gap"]) == pytest.approx(final_gap, rel=1e-9)


def test_plot_exists() -> None:
    png = RESULTS / "fp8_quality.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
