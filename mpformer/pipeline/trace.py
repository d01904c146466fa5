"""Traces of the real pipeline run: the engine's timed actions, gathered, written, and turned into costs.

The engine records ``(action, start, end)`` per compute action and per receive wait, in
``time.perf_counter`` seconds (on CUDA, stream events resolved onto that clock without a synchronise
per action: parallel/device.py's Stopwatch). perf_counter is a system-wide monotonic clock on Linux,
so the ranks of one node share an origin; across nodes the rows are offset by the clocks' difference.
``write_trace`` writes them in the same Chrome-trace form as ``tools/schedule.py --trace`` writes the
simulated schedule, so the two read side by side; ``measured_costs`` takes the median duration of
each operation per global stage, which is what ``simulate`` needs to predict the same run.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from mpformer.pipeline.actions import Action, Op
from mpformer.pipeline.simulate import Costs, chrome_trace

Event = tuple[Action, float, float]


def gather_events(events: list[Event], group: dist.ProcessGroup | None) -> list[Event]:
    """Every rank's events of the pipeline group (all ranks of ``group`` must call this)."""
    if group is None or dist.get_world_size(group) == 1:
        return list(events)
    out: list[list[Event] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, events, group=group)
    return [e for part in out if part for e in part]


def write_trace(path: str | Path, events: Sequence[Event], vpp: int) -> Path:
    """A Chrome trace (chrome://tracing, Perfetto) of measured events, time 0 at the earliest one."""
    origin = min((start for _, start, _ in events), default=0.0)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace([(a, s - origin, e - origin) for a, s, e in events], vpp=vpp)))
    return path


def measured_costs(events: Sequence[Event], num_stages: int, pp: int, p2p: float = 0.0, v: bool = False) -> Costs:
    """Median seconds of F, BI (or a combined B) and BW per global stage.

    A combined B is reported as ``b`` with ``w = 0``, which is how ``Costs.duration`` prices B
    (b + w). A stage that ran both (DualPipeV: full backwards in its steady state, split ones at its
    ends) is priced by its split passes, a full B being their sum. A stage that never ran an op gets
    0 for it.
    """
    by: dict[tuple[Op, int], list[float]] = {}
    for a, start, end in events:
        if not a.op.is_comm:
            by.setdefault((a.op, a.stage(pp, v)), []).append(end - start)

    def med(op: Op, s: int) -> float:
        return statistics.median(by[op, s]) if (op, s) in by else 0.0

    split = [(Op.BI, s) in by for s in range(num_stages)]
    b = [med(Op.BI, s) if split[s] else med(Op.B, s) for s in range(num_stages)]
    w = [med(Op.BW, s) if split[s] else 0.0 for s in range(num_stages)]
    return Costs(f=[med(Op.F, s) for s in range(num_stages)], b=b, w=w, p2p=p2p)


def measured_gap(events: Sequence[Event], windows: Sequence[tuple[float, float]]) -> float:
    """The engine's median time per compute action that is neither compute nor a receive wait (``Costs.gap``).

    Per rank and step window: from the rank's first traced event to its last, the time left once its
    computes and its receive waits are taken out, over its number of computes (the simulator adds the
    gap after each). That time is the engine's own: posting messages, waiting for sends, the offload's
    and the slices' bookkeeping, Python between actions; with more ranks than cores, also a rank
    waiting for a core. The idle before a rank's first event and after its last is the schedule's (the
    simulator has it) and is left out."""
    per: list[float] = []
    for t0, t1 in windows:
        ranks: dict[int, list[Event]] = {}
        for e in events:
            if t0 - 1e-3 <= e[1] <= t1:
                ranks.setdefault(e[0].rank, []).append(e)
        for evs in ranks.values():
            computes = sum(not a.op.is_comm for a, _, _ in evs)
            if not computes:
                continue
            span = max(e for _, _, e in evs) - min(s for _, s, _ in evs)
            left = span - sum(e - s for _, s, e in evs)
            per.append(max(0.0, left) / computes)
    return statistics.median(per) if per else 0.0
