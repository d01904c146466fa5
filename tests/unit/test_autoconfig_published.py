"""The cost model against every published run in the repository (hardware data and formulas, nothing
fitted per row), with the published layout pinned in every field its source states.

Issue 16's target: every row within 15% of its publication (iteration time, TFLOP/s or tokens/s per
GPU) and the median within 10%; and a run that ran fits its devices. Time and memory are checked
apart: a row the memory model says cannot fit is timed on the fastest plan its pins allow, memory
aside (published.predict_case). Rows that miss today are listed in ``MISSES`` (time) and
``MEMORY_MISSES`` with the reason as far as it is known; they are expected to fail (strict: a row
that starts to pass must leave the list), so the lists are the honest state of the model. The table
goes to stdout (-s), and benchmarks/bench_published.py prints it with the chosen unstated fields.
"""

from __future__ import annotations

import statistics

import pytest

from mpformer.autoconfig.published import Case, case_error, predict_case, published_cases
from mpformer.autoconfig.search import search

CASES = published_cases()
TOLERANCE, MEDIAN_TOLERANCE = 0.15, 0.10
# The median today (11.4% over 51 rows, benchmarks/README bench_published) is above the 10% target; the
# test asserts it does not get worse than this ceiling, and reports where it stands against the target.
MEDIAN_CEILING = 0.12

# Rows the model misses by more than TOLERANCE, and why as far as it is known (issue 16). Errors as
# benchmarks/bench_published.py printed them when the list was written.
_H100 = ("the model's H100 compute is too fast: NVIDIA's own fully stated H100 runs (the dgxc rows) come out "
         "0-15% too fast, these further (micro-batch, recompute, interleaving unstated: the fastest plan that fits; "
         "the table is an image, and a reading of it in Megatron-LM issue 1571 has batches of 3840 and 960 where "
         "this file has 192)")
MISSES: dict[str, str] = {
    "405B 16384 GPUs cp=1": "-16.1% (too slow): 16 micro-batches per pipeline of 16 stages; Meta's schedule "
                            "runs N contiguous micro-batches (section 3.3.2), not modelled",
    "mcore 1.7B tp1 pp1": f"+21% (too fast): {_H100}",
    "mcore 70B tp8 pp2": f"+22% (too fast): {_H100}",
    "mcore 119B tp8 pp4": f"+23% (too fast): {_H100}",
    "mcore 177B tp8 pp6": f"+24% (too fast): {_H100}",
    "mcore 314B tp8 pp8": f"+19% (too fast): {_H100}",
    "mcore 462B tp8 pp16": f"+23% (too fast): {_H100}",
    "titan llama3-8b 8 GPUs tp1 pp1": "+20% (too fast): the 500 W parts' sustained rate is not published "
                                      "(peak taken between the NVL's and the SXM's)",
    "titan llama3-8b 8 GPUs tp1 pp1 compile": "+31% (too fast): as the eager row",
    "titan llama3-70b 256 GPUs tp8 pp1 compile float8": "+17% (too fast): as the 8B rows on these 500 W parts, "
                                                        "whose FP8 rate is taken as twice the assumed bf16 peak",
    "bloom 176B 384 GPUs": "-16% (too fast): DeepSpeed's 2022 pipeline engine",
    "mt-nlg 530B 2240 GPUs": "-29% (too fast): DeepSpeed's 2021 pipeline engine; micro-batch unpublished",
    "mt-nlg 530B 2800 GPUs": "-30% (too fast): as the 2240-GPU row",
    "mt-nlg 530B 3360 GPUs": "-32% (too fast): as the 2240-GPU row",
}

# Runs that ran, which the memory model says do not fit their devices with the stated fields pinned.
_DGXC_MEMORY = ("the memory model needs {} GB for a run that ran in 80 GB (its table's fewest data-parallel "
                "ranks: the least sharded optimizer state; NeMo's Apex distributed Adam is not modelled)")
_META_MEMORY = ("without recompute (as published) mpformer's block needs 111 GB on the fastest pinned plan (a "
                "rehearsal of its most loaded rank: 109; benchmarks/bench_rehearsal.py) (173 "
                "before the qkv and MLP inputs were kept as sequence shards, 190 before RMSNorm kept only its input "
                "and 1/rms), Megatron's 92 on the same plan; Meta's own runtime (stage inputs and outputs freed "
                "early, section 3.3.2) is not modelled")
MEMORY_MISSES: dict[str, str] = {
    "405B 8192 GPUs cp=1": _META_MEMORY,
    "405B 16384 GPUs cp=1": _META_MEMORY,
    "405B 16384 GPUs cp=16": _META_MEMORY,
    "dgxc llama3.1-8b 8 GPUs": _DGXC_MEMORY.format(83),
    "dgxc llama3.1-405b 576 GPUs": _DGXC_MEMORY.format(83),
    "dgxc nemotron4-340b 128 GPUs": _DGXC_MEMORY.format(111),
}


def published_error(case: Case) -> tuple[float | None, bool]:
    """(predicted / published - 1 in the published figure's unit, whether the memory model lets it fit).
    Positive: predicted faster for throughputs, slower for iteration times. A row the memory model says
    cannot fit is timed on the fastest plan its pins allow, memory aside (published.predict_case)."""
    best, fits = predict_case(case)
    if best is None:
        return None, fits
    _, predicted, published = case_error(case, best)
    return predicted / published - 1, fits


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[float | None, bool]]:
    out = {c.name: published_error(c) for c in CASES}
    for name, (err, fits) in out.items():
        print(f"{name}: {'no plan' if err is None else f'{err:+.1%}'}{'' if fits else ' (memory: does not fit)'}")
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_published_row(case, results):
    err = results[case.name][0]
    within = err is not None and abs(err) <= TOLERANCE
    if case.name in MISSES:  # strict: a row that meets the target must leave the list
        assert not within, f"{case.name} is now within {TOLERANCE:.0%} ({err:+.1%}): remove it from MISSES"
        pytest.xfail(MISSES[case.name])
    assert err is not None, f"{case.name}: no plan even with memory aside"
    assert within, f"{case.name}: {err:+.1%}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_published_row_fits(case, results):
    """A run that ran fits its devices: the memory model must say so with the pinned fields."""
    fits = results[case.name][1]
    if case.name in MEMORY_MISSES:  # strict, as MISSES
        assert not fits, f"{case.name} now fits: remove it from MEMORY_MISSES"
        pytest.xfail(MEMORY_MISSES[case.name])
    assert fits, f"{case.name}: the memory model finds no plan that fits {case.cluster.memory_gb:g} GB"


def test_median_error(results):
    errs = [abs(e) if e is not None else float("inf") for e, _ in results.values()]  # no plan: the worst error
    med = statistics.median(errs)
    assert med <= MEDIAN_CEILING, f"median |error| {med:.1%} over {len(errs)} rows, above the ceiling " \
                                  f"{MEDIAN_CEILING:.0%} (target {MEDIAN_TOLERANCE:.0%})"
    print(f"median |error| {med:.1%} over {len(errs)} rows (target {MEDIAN_TOLERANCE:.0%})")


def test_misses_are_rows():
    assert set(MISSES) <= {c.name for c in CASES} and set(MEMORY_MISSES) <= {c.name for c in CASES}


def test_the_unpinned_search_is_at_least_as_fast():
    """Pinned to Korthikanti's 175B layout and free but for cp, the search finds a plan predicted at
    least as fast (the pinned plan is one of the free search's candidates)."""
    case = next(c for c in CASES if c.name == "175B selective")
    pinned = search(case.model, case.cluster, case.workload, fixed=case.fixed, top_k=1)
    free = search(case.model, case.cluster, case.workload, fixed={"cp": 1}, top_k=1)
    assert free.top and free.top[0].time.iteration_s <= pinned.top[0].time.iteration_s * (1 + 1e-9)
