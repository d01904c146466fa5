"""The compiled timeline (pipeline/timeline.py) and the closed-form bound (cost.pipeline_bound) against
simulate() on every generated schedule with random unequal costs."""

from __future__ import annotations

import random

import pytest

from mpformer.autoconfig.cost import pipeline_bound, pipeline_time
from mpformer.core.errors import ConfigError
from mpformer.pipeline.schedules import build_schedule
from mpformer.pipeline.simulate import Costs, simulate
from mpformer.pipeline.timeline import compile_timeline

SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("zb-h2", 1),
             ("zb-v", 2), ("dualpipev", 2)]


def _costs(rng: random.Random, stages: int, split: bool) -> Costs:
    f = [rng.uniform(0.3, 2.0) for _ in range(stages)]
    b = [x * rng.uniform(1.0, 2.5) for x in f]
    w = [x * rng.uniform(0.0, 1.2) for x in f]
    if not split:  # B carries W
        b, w = [x + y for x, y in zip(b, w)], [0.0] * stages
    a2a = rng.choice([0.0, 0.0, 0.3, 1.5])  # a mixture of experts' exchanges: hidden in pairs, or longer
    a2a_f, a2a_b = a2a, a2a * rng.uniform(0.5, 1.5)
    if a2a and rng.random() < 0.5:  # per stage: sparse and dense stages, exchanges of unequal length
        a2a_f = [a2a * rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(stages)]
        a2a_b = [x * rng.uniform(0.5, 1.5) for x in a2a_f]
    return Costs(f=f, b=b, w=w, p2p=rng.choice([0.0, 0.02, 0.4]), a2a_f=a2a_f, a2a_b=a2a_b)


def _schedules():
    for name, vpp in SCHEDULES:
        for pp in (1, 2, 3, 4, 6):
            for m in sorted({1, 2, pp, pp + 1, 2 * pp, 3 * pp + 1}):
                try:
                    yield build_schedule(name, pp, m, vpp)
                except ConfigError:
                    continue  # fewer micro-batches than the schedule needs
    for name in ("gpipe", "1f1b"):  # token slices
        for pp, m, k in ((2, 1, 2), (2, 3, 4), (4, 4, 2), (6, 2, 3)):
            yield build_schedule(name, pp, m, slices=k)


def test_compiled_timeline_equals_simulate():
    rng = random.Random(0)
    n = 0
    for s in _schedules():
        ct = compile_timeline(s)
        for _ in range(2):
            c = _costs(rng, s.num_stages, s.name.startswith("zb"))
            assert ct.step_time(c) == pytest.approx(simulate(s, c).step_time, rel=1e-12, abs=1e-12), s.name
            n += 1
    assert n > 150


@pytest.mark.parametrize("blocking", [False, True])
def test_closed_form_bounds_the_simulated_timeline(blocking):
    """Never above the simulation (branch and bound relies on it), equal to it for even stages."""
    rng = random.Random(1)
    for s in _schedules():
        c = _costs(rng, s.num_stages, s.name.startswith("zb"))
        sim = simulate(s, c, blocking=blocking).step_time  # the whole timeline, not extrapolated
        assert pipeline_bound(s.name, s.pp, s.microbatches, s.vpp, c, blocking=blocking) <= sim * (1 + 1e-12)
    for name, vpp in SCHEDULES:
        split = name.startswith("zb")
        even = Costs(f=1.0, b=1.0 if split else 2.0, w=1.0 if split else 0.0)
        if name in ("zb-h2", "zb-v", "dualpipev"):
            continue  # their single-step timelines keep fill and drain the bound does not count
        assert pipeline_bound(name, 4, 8, vpp, even) == pytest.approx(pipeline_time(name, 4, 8, vpp, even))


def test_compiled_from_the_orders_equals_compiled_from_the_lists():
    """The cost model's shortcut (no action lists) times every schedule as its lists do."""
    from mpformer.pipeline.timeline import compile_schedule

    rng = random.Random(2)
    for s in _schedules():
        m = s.microbatches // s.slices
        direct, lists = compile_schedule(s.name, s.pp, m, s.vpp, s.slices), compile_timeline(s)
        c = _costs(rng, s.num_stages, s.name.startswith("zb"))
        assert direct.step_time(c) == pytest.approx(lists.step_time(c), rel=1e-12, abs=1e-12), s.name
    big = build_schedule("interleaved", 16, 32, 3)
    c = _costs(rng, big.num_stages, False)
    assert compile_schedule("interleaved", 16, 32, 3).step_time(c) == pytest.approx(simulate(big, c).step_time)
