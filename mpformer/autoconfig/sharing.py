"""Ranks sharing a CPU host's cores: how much slower each computes while k compute, and a pipeline's
timeline under processor sharing.

On a host with more ranks than cores (local-cpu), a rank idle in a pipeline bubble or in a collective
lends its core to the busy ones; a busy rank slowed down stays busy longer and slows the others in
turn. ``slowdowns`` gives the measured slowdown by the number of busy ranks (profile.py), and
``shared_step_time`` runs a schedule's action lists with each action lasting until its work alone is
done at the rates of the ranks busy around it, iterated to a fixed point.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

from mpformer.autoconfig.cluster import Cluster
from mpformer.pipeline.actions import Schedule
from mpformer.pipeline.simulate import Costs


def slowdowns(c: Cluster) -> dict[int, float] | None:
    """On a CPU host (``cores`` set): how much slower a rank computes while k ranks of the host compute
    at once, for k = 1 (1.0), every count the profile measured (its reference model run by k processes
    at once, against one alone), and all the host's ranks (measured, else ranks per core); linear in k
    between. None on accelerators (a device per rank)."""
    if not c.cores:
        return None
    out = {1: 1.0}
    for key, row in c.measured.get("loaded", {}).items():
        if 1 < int(key) <= c.devices_per_node and "slowdown" in row:
            out[int(key)] = row["slowdown"]
    if c.devices_per_node not in out:
        if c.devices_per_node > c.cores:
            out.setdefault(c.cores, 1.0)
        out[c.devices_per_node] = max(1.0, c.devices_per_node / c.cores)
    return out


def interpolate(points: dict[int, float], k: float) -> float:
    xs = sorted(points)
    if k <= xs[0]:
        return points[xs[0]]
    for lo, hi in itertools.pairwise(xs):
        if k <= hi:
            return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)
    return points[xs[-1]]


def shared_step_time(schedule: Schedule, costs: Costs, dilation: Callable[[int], float],
                     iterations: int = 12) -> float:
    """Step time when the pipeline's ranks share cores (processor sharing): while k ranks compute,
    each progresses at 1 / dilation(k) of its speed alone, so a compute action lasts until its work
    alone is done at the rates of the ranks busy around it. The rates come from the previous timeline;
    the timeline is re-run with the new durations until it settles (a damped fixed-point iteration).
    A rank idle in a bubble lends its core to the busy ones; one slowed down stays busy longer and
    slows the others in turn, which a one-pass stretch of the alone timeline would miss."""
    from mpformer.pipeline.verify import execute

    alone = {a: costs.duration(a, schedule.pp) for row in schedule.actions for a in row}
    dur = dict(alone)
    timeline = execute(schedule, dur.__getitem__, costs.p2p, blocking=False)
    for _ in range(iterations):
        progress, until = _progress(timeline, dilation)
        new = {t.action: until(progress(t.start) + alone[t.action]) - t.start
               for row in timeline for t in row if not t.action.op.is_comm and t.end > t.start}
        dur = {a: 0.5 * (d + new.get(a, d)) for a, d in dur.items()}
        timeline = execute(schedule, dur.__getitem__, costs.p2p, blocking=False)
    return max((t.end for row in timeline for t in row), default=0.0)


def _progress(timeline: list, dilation: Callable[[int], float]
              ) -> tuple[Callable[[float], float], Callable[[float], float]]:
    """G(t) = integral from 0 of 1 / dilation(k(s)) ds, k(s) the ranks computing at s (at least one:
    the rank whose progress is asked), and its inverse; past the timeline, speed alone."""
    edges = sorted((t.start, 1) if i == 0 else (t.end, -1) for row in timeline for t in row
                   if not t.action.op.is_comm and t.end > t.start for i in (0, 1))
    times, values, busy, total, last = [0.0], [0.0], 0, 0.0, 0.0
    for time, delta in edges:
        if time > last:
            total += (time - last) / dilation(max(busy, 1))
            times.append(time)
            values.append(total)
        busy, last = busy + delta, time

    def interp(xs: list[float], ys: list[float], x: float) -> float:
        i = bisect.bisect_right(xs, x) - 1
        if i >= len(xs) - 1:
            return ys[-1] + (x - xs[-1])  # beyond the timeline: alone, rate 1 both ways
        return ys[i] + (x - xs[i]) * (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])

    return (lambda t: interp(times, values, t)), (lambda g: interp(values, times, g))
