"""The cost model against every published run in the repository (hardware data and formulas, nothing
fitted per row), with the published layout pinned in every field its source states.

Issue 16's target: every row within 15% of its publication (iteration time, TFLOP/s or tokens/s per
GPU) and the median within 10%. Rows that miss it today are listed in ``MISSES`` with the reason as
far as it is known; they are expected to fail (strict: a row that starts to pass must leave the
list), so the list is the honest state of the model. The table goes to stdout (-s), and
benchmarks/bench_published.py prints it with the chosen unstated fields.
"""

from __future__ import annotations

import statistics

import pytest

from mpformer.autoconfig.published import Case, published_cases
from mpformer.autoconfig.search import search
from mpformer.cli.autoconfig import model_flops_per_step

CASES = published_cases()
TOLERANCE, MEDIAN_TOLERANCE = 0.15, 0.10

# Rows the model misses by more than TOLERANCE, and why as far as it is known (issue 16). Errors as
# benchmarks/bench_published.py printed them when the list was written.
_H100 = ("the model's H100 compute is too fast: NVIDIA's own fully stated H100 runs (the dgxc rows) come out "
         "10-16% too fast, these further (micro-batch, recompute, interleaving unstated: the fastest plan that fits)")
_DGXC_MEMORY = ("no plan: the memory model needs {} GB for a run that ran in 80 GB (the fewest data-parallel ranks "
                "of its table: the least sharded optimizer state; NeMo's Apex distributed Adam is not modelled)")
MISSES: dict[str, str] = {
    "405B 8192 GPUs cp=1": "-19%: only full recompute fits the memory model with interleaving (no recompute: "
                           "177 GB); Meta's recompute policy is not published",
    "405B 16384 GPUs cp=1": "-32%: as the 8192-GPU row, with 16 micro-batches per pipeline of 16 stages",
    "405B 16384 GPUs cp=16": "-18%: as the cp=1 row (full recompute chosen)",
    "mcore 1.7B tp1 pp1": f"+38% (too fast): {_H100}",
    "mcore 7.1B tp2 pp1": f"+34% (too fast): {_H100}",
    "mcore 16B tp4 pp1": f"+29% (too fast): {_H100}",
    "mcore 32B tp8 pp1": f"+35% (too fast): {_H100}",
    "mcore 70B tp8 pp2": f"+34% (too fast): {_H100}",
    "mcore 119B tp8 pp4": f"+28% (too fast): {_H100}",
    "mcore 177B tp8 pp6": f"+27% (too fast): {_H100}",
    "mcore 314B tp8 pp8": f"+21% (too fast): {_H100}",
    "mcore 462B tp8 pp16": f"+25% (too fast): {_H100}",
    "dgxc llama3.1-8b 8 GPUs": _DGXC_MEMORY.format(84),
    "dgxc llama3.1-405b 576 GPUs": _DGXC_MEMORY.format(84),
    "dgxc nemotron4-340b 128 GPUs": _DGXC_MEMORY.format(112),
    "dgxc gpt3-175b 128 GPUs": "-15.1% (too fast): the H100 compute, as the other dgxc rows (-10 to -16%)",
    "dgxc nemotron4-15b 1024 GPUs": "-16.0% (too fast): as the other dgxc rows",
    "titan llama3-8b 8 GPUs tp1 pp1": "+21% (too fast): the 500 W parts' sustained rate is not published "
                                      "(peak taken between the NVL's and the SXM's)",
    "titan llama3-8b 8 GPUs tp1 pp1 compile": "+33% (too fast): as the eager row",
    "titan llama3-8b 128 GPUs tp1 pp1": "+19% (too fast): as the 8-GPU row",
    "titan llama3-8b 128 GPUs tp1 pp1 compile": "+28% (too fast): as the 8-GPU row",
    "bloom 176B 384 GPUs": "-16% (too fast): DeepSpeed's 2022 pipeline engine",
    "mt-nlg 530B 2240 GPUs": "-29% (too fast): DeepSpeed's 2021 pipeline engine; micro-batch unpublished",
    "mt-nlg 530B 2800 GPUs": "-30% (too fast): as the 2240-GPU row",
    "mt-nlg 530B 3360 GPUs": "-32% (too fast): as the 2240-GPU row",
}


def published_error(case: Case) -> float | None:
    """Predicted / published - 1 in the published figure's unit (positive: predicted faster for
    throughputs, slower for iteration times); None when the search finds no plan."""
    res = search(case.model, case.cluster, case.workload, fixed=case.fixed, top_k=1)
    if not res.top:
        return None
    t = res.top[0].time.iteration_s
    if case.iteration_time_s is not None:
        return t / case.iteration_time_s - 1
    w, world = case.workload, case.cluster.world_size
    if case.tflops_per_gpu is not None:
        return model_flops_per_step(case.model, w.global_batch_size, w.seq_length) / t / world / 1e12 \
            / case.tflops_per_gpu - 1
    return w.global_batch_size * w.seq_length / t / world / case.tokens_per_s_per_gpu - 1


@pytest.fixture(scope="module")
def errors() -> dict[str, float | None]:
    out = {c.name: published_error(c) for c in CASES}
    for name, err in out.items():
        print(f"{name}: {'no plan' if err is None else f'{err:+.1%}'}")
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_published_row(case, errors):
    err = errors[case.name]
    within = err is not None and abs(err) <= TOLERANCE
    if case.name in MISSES:  # strict: a row that meets the target must leave the list
        assert not within, f"{case.name} is now within {TOLERANCE:.0%} ({err:+.1%}): remove it from MISSES"
        pytest.xfail(MISSES[case.name])
    assert err is not None, f"{case.name}: no plan fits"
    assert within, f"{case.name}: {err:+.1%}"


def test_median_error(errors):
    errs = [abs(e) if e is not None else float("inf") for e in errors.values()]  # no plan: the worst error
    med = statistics.median(errs)
    if med > MEDIAN_TOLERANCE:
        pytest.xfail(f"median |error| {med:.1%} over {len(errs)} rows (target {MEDIAN_TOLERANCE:.0%})")
    assert med <= MEDIAN_TOLERANCE


def test_misses_are_rows():
    assert set(MISSES) <= {c.name for c in CASES}


def test_the_unpinned_search_is_at_least_as_fast():
    """Pinned to Korthikanti's 175B layout and free but for cp, the search finds a plan predicted at
    least as fast (the pinned plan is one of the free search's candidates)."""
    case = next(c for c in CASES if c.name == "175B selective")
    pinned = search(case.model, case.cluster, case.workload, fixed=case.fixed, top_k=1)
    free = search(case.model, case.cluster, case.workload, fixed={"cp": 1}, top_k=1)
    assert free.top and free.top[0].time.iteration_s <= pinned.top[0].time.iteration_s * (1 + 1e-9)
