"""Timeline of a schedule from per-operation costs: step time, bubble, in-flight activations.

The simulator does not model a schedule, it runs one: ``verify.execute`` walks the very action
lists the engine executes, with the blocking group semantics of actions.py, and this module only
supplies durations (docs/architecture.md, principle 3: the auto-configurator's bubble estimate is the bubble of
the schedule that actually runs).

Costs are per compute action, i.e. per (microbatch, chunk): ``f`` for F, ``b`` for BI (input
gradients), ``w`` for BW (weight gradients) and ``b + w`` for a combined B; each is one number or a
list with one entry per global stage (``pp * vpp``); ``gap`` is the engine's own time after each
compute action (measured by trace.measured_gap), idle in the bubble. A send/receive pair completes
``p2p`` after both sides are posted. By default a rank waits only for the receive its next compute consumes,
so a message produced at time t is usable at t + p2p (an engine that waits for receives at their
consumer and for sends lazily); ``blocking=True`` models an engine that waits for every batched
group as a whole. Both give the closed forms below at unit costs; with unequal costs the blocking
engine adds waits, most for the zero-bubble schedules.

Definitions (``SimResult``):
    step_time            the last action's end; the step starts at 0 on every rank
    idle[r]              step_time - (time rank r spends computing); waiting in p2p counts as idle
    bubble_fraction[r]   idle[r] / step_time;  ``bubble_fraction`` is the mean over ranks
    peak_inflight[r]     the most (microbatch, chunk) activations rank r holds at once (F done,
                         B or BW not yet); with vpp > 1 one unit is a chunk, 1/vpp of the rank's layers

With unit costs and p2p = 0 the mean bubble fraction equals the closed forms of
docs/formulas.md for GPipe, 1F1B and interleaved 1F1B. For the zero-bubble schedules
an isolated step still has the fill (rank p-1 cannot start before (p-1) T_F) and the drain;
ZB-H2 only reaches ~0 when consecutive steps overlap, which ``steady_state_bubble`` measures.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mpformer.core.errors import ConfigError
from mpformer.pipeline.actions import Action, Op, Schedule, repeat
from mpformer.pipeline.verify import TimedAction, execute, verify

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Time of one compute action per op (scalar, or a list per global stage) and of one p2p."""

    f: PerStage = 1.0
    b: PerStage = 1.0
    w: PerStage = 1.0
    p2p: float = 0.0
    fb: float | None = None  # an overlapped F&B pair (DualPipe's F&B); None: from the halves (``pair``)
    # A mixture of experts' dispatch and combine (all-to-all over the ep group) in one compute's
    # forward (``a2a_f``) and input-gradient backward (``a2a_b``; BW has none), per global stage like
    # f/b/w (a stage's sparse layers set them; dense stages have none). A compute alone waits for its
    # own exchanges; in an overlapped pair each half's exchanges run beside the other's compute
    # (DeepSeek-V3, section 3.2.1: that is what DualPipe's pairs are for).
    a2a_f: PerStage = 0.0
    a2a_b: PerStage = 0.0
    copy: float = 0.0  # activation offload: one unit's saved activations to host memory, or back
    # The engine's own time per compute action, outside the compute and the receive waits (posting its
    # messages, the Python between actions; trace.measured_gap): it delays the rank's next action and
    # is idle time, not compute, in the bubble. Small on a GPU; on a CPU, ms, and it grows with the
    # number of actions (token slices multiply them).
    gap: float = 0.0

    def check(self, num_stages: int) -> None:
        for key in ("f", "b", "w", "a2a_f", "a2a_b"):
            val = getattr(self, key)
            vals = [val] if isinstance(val, int | float) else list(val)
            if not isinstance(val, int | float) and len(vals) != num_stages:
                raise ConfigError(f"cost {key} lists {len(vals)} values; give one number or one per global "
                                  f"stage (pp*vpp = {num_stages})")
            if any(v < 0 for v in vals):
                raise ConfigError(f"cost {key}={val} must be >= 0")
        for key in ("p2p", "gap"):
            if getattr(self, key) < 0:
                raise ConfigError(f"cost {key}={getattr(self, key)} must be >= 0")
        if self.fb is not None and self.fb < 0:
            raise ConfigError(f"cost fb={self.fb} must be >= 0")

    def _at(self, key: str, stage: int) -> float:
        val = getattr(self, key)
        return float(val) if isinstance(val, int | float) else float(val[stage])

    def compute(self, action: Action, pp: int, v: bool = False) -> float:
        """The compute of ``action`` alone, without its expert exchanges."""
        stage = action.stage(pp, v)
        if action.op == Op.F:
            return self._at("f", stage)
        if action.op == Op.BI:
            return self._at("b", stage)
        if action.op == Op.BW:
            return self._at("w", stage)
        if action.op == Op.B:
            return self._at("b", stage) + self._at("w", stage)
        return 0.0

    def exchange(self, action: Action, pp: int = 1, v: bool = False) -> float:
        """The expert dispatch and combine inside ``action`` (all-to-all time; 0 for BW and p2p)."""
        key = "a2a_f" if action.op == Op.F else "a2a_b" if action.op in (Op.B, Op.BI) else None
        return self._at(key, action.stage(pp, v)) if key else 0.0

    def duration(self, action: Action, pp: int, v: bool = False) -> float:
        """How long ``action`` keeps its rank busy alone: its compute, then its expert exchanges
        (p2p: 0, its wait is modelled apart)."""
        return self.compute(action, pp, v) + self.exchange(action, pp, v)

    def pair(self, a: Action, b: Action, pp: int, v: bool = False) -> float:
        """An overlapped pair's time: ``fb``, or the longer of the two halves' compute and the two
        halves' exchanges (one stream computes while the other exchanges; with no exchanges, the sum)."""
        if self.fb is not None:
            return self.fb
        return max(self.compute(a, pp, v) + self.compute(b, pp, v), self.exchange(a, pp, v) + self.exchange(b, pp, v))


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    costs: Costs
    timeline: list[list[TimedAction]]  # per rank, in list order
    step_time: float
    busy: list[float]
    idle: list[float]
    bubble_fraction_per_rank: list[float]
    bubble_fraction: float
    peak_inflight: list[int]
    copies: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)  # offload lanes
    exchanges: list[tuple[Action, float, float]] = field(default_factory=list)  # expert all-to-all lane


    def to_json(self) -> dict:
        """The ``tools/schedule.py --json`` object (a stable interface: exactly these keys)."""
        s = self.schedule
        return {
            "schedule": s.name,
            "pp": s.pp,
            "microbatches": s.microbatches,
            "vpp": s.vpp,
            "step_time": self.step_time,
            "bubble_fraction": self.bubble_fraction,
            "bubble_fraction_per_rank": list(self.bubble_fraction_per_rank),
            "peak_inflight_microbatches": list(self.peak_inflight),
        }


def simulate(schedule: Schedule, costs: Costs | None = None, *, blocking: bool = False,
             verified: bool = False, offload: Sequence[set[tuple[int, int]]] | None = None) -> SimResult:
    """Verify, then run the schedule's lists on a clock (ScheduleError if it cannot run).

    ``blocking`` picks the engine semantics of ``verify.execute``: False (default) waits for a
    receive only at its consumer and never for a send; True waits for every group as a whole.
    ``verified``: the schedule comes from build_schedule, which verified it (peak_inflight is then
    left empty; verify() gives it). ``offload``: per rank, the units whose saved activations go to
    host memory (pipeline/offload.py); each copy takes ``costs.copy``, out during the unit's forward
    and back during its backward (a layer ahead of it: the first layer's head start during the compute
    before is left out), and a compute lasts at least as long as the copies beside it (the cost
    model's rule); ``SimResult.copies`` holds them for drawing.
    """
    costs = costs or Costs()
    costs.check(schedule.num_stages)
    peaks = [] if verified else verify(schedule).peak_inflight
    pp, v = schedule.pp, schedule.v
    longer, lanes = _copy_lanes(schedule, offload) if offload else ({}, [])
    gap = costs.gap

    def duration(a: Action) -> float:
        if a.op.is_comm:
            return 0.0
        return max(costs.duration(a, pp, v), costs.copy if a in longer else 0.0) + gap

    timeline = execute(schedule, duration, costs.p2p, blocking=blocking,
                       pair=lambda a, b: costs.pair(a, b, pp, v) + 2 * gap)
    starts = {t.action: t.start for row in timeline for t in row}
    copies = [(r, kind, mb, c, starts[a], starts[a] + costs.copy) for r, kind, mb, c, a in lanes]
    step = max((t.end for row in timeline for t in row), default=0.0)
    busy = [sum(t.end - t.start - gap for t in row if not t.action.op.is_comm) for row in timeline]
    idle = [step - b for b in busy]
    per_rank = [i / step if step > 0 else 0.0 for i in idle]
    return SimResult(schedule, costs, timeline, step, busy, idle, per_rank, sum(per_rank) / len(per_rank), peaks,
                     copies, _exchange_lane(timeline, costs, pp, v))


def _exchange_lane(timeline: list[list[TimedAction]], costs: Costs, pp: int, v: bool
                   ) -> list[tuple[Action, float, float]]:
    """When each compute's expert exchanges run: a compute alone ends with them; in a pair (drawn as
    its halves in turn) the second half's run from the pair's start, beside the first half's compute,
    and the first half's right after, beside the second's: the two streams ``Costs.pair`` prices."""
    out: list[tuple[Action, float, float]] = []
    for row in timeline:
        computes = [t for t in row if not t.action.op.is_comm]
        k = 0
        while k < len(computes):
            t = computes[k]
            if t.action.overlap and k + 1 < len(computes):
                u = computes[k + 1]
                x1, x2 = costs.exchange(t.action, pp, v), costs.exchange(u.action, pp, v)
                out += [(u.action, t.start, t.start + x2), (t.action, t.start + x2, t.start + x2 + x1)]
                k += 2
                continue
            x = costs.exchange(t.action, pp, v)
            out.append((t.action, t.end - x - costs.gap, t.end - costs.gap))
            k += 1
    return [e for e in out if e[2] > e[1]]


def _copy_lanes(schedule: Schedule, offload: Sequence[set[tuple[int, int]]]
                ) -> tuple[set[Action], list[tuple[int, str, int, int, Action]]]:
    """The computes a copy runs beside, and each copy: (rank, "out" | "back", microbatch, chunk, the
    compute): a moved unit's forward and its backward (the input-gradient pass, which reads them)."""
    beside: set[Action] = set()
    lanes: list[tuple[int, str, int, int, Action]] = []
    for r, units in enumerate(offload):
        for a in schedule.actions[r]:
            if a.op in (Op.F, Op.B, Op.BI) and (a.microbatch, a.chunk) in units:
                beside.add(a)
                lanes.append((r, "out" if a.op is Op.F else "back", a.microbatch, a.chunk, a))
    return beside, lanes


def steady_state_bubble(schedule: Schedule, costs: Costs | None = None, *, blocking: bool = False) -> list[float]:
    """Per-rank bubble when steps run back to back without a barrier (Qi et al.'s setting).

    The period is the growth of the step time from two to three repeated steps; each rank computes
    busy[r] per period, so its bubble is 1 - busy[r] / period.
    """
    two, three = (simulate(repeat(schedule, k), costs, blocking=blocking) for k in (2, 3))
    period = three.step_time - two.step_time
    one_step = [b3 - b2 for b2, b3 in zip(two.busy, three.busy)]
    return [1.0 - b / period if period > 0 else 0.0 for b in one_step]


Event = TimedAction | tuple[Action, float, float]


def chrome_trace(events: Iterable[Event], us_per_unit: float = 1e6, vpp: int = 1, comm: bool = True,
                 copies: Sequence[tuple[int, str, int, int, float, float]] = (),
                 exchanges: Sequence[tuple[Action, float, float]] = ()) -> dict:
    """A chrome://tracing / Perfetto object: one process per rank, compute on thread 0, p2p on 1,
    activation offload's copies (``SimResult.copies``) on 2, the experts' all-to-all
    (``SimResult.exchanges``) on 3.

    ``events`` are TimedActions or (action, start, end) tuples: from ``simulate`` (times in cost
    units) or from the trainer timing the real run (seconds, the default ``us_per_unit``; any common
    origin), so the simulated and the measured trace read the same way side by side.
    """
    out: list[dict] = []
    ranks: set[int] = set()
    for ev in events:
        a, start, end = (ev.action, ev.start, ev.end) if isinstance(ev, TimedAction) else ev
        if a.op.is_comm and not comm:
            continue
        ranks.add(a.rank)
        out.append({"name": a.token(vpp > 1), "cat": a.op.value, "ph": "X", "pid": a.rank,
                    "tid": 1 if a.op.is_comm else 0, "ts": start * us_per_unit, "dur": (end - start) * us_per_unit,
                    "args": {"microbatch": a.microbatch, "chunk": a.chunk}})
    for r, kind, mb, c, start, end in copies:
        out.append({"name": f"{kind} {mb}" + (f".{c}" if vpp > 1 else ""), "cat": f"offload {kind}", "ph": "X",
                    "pid": r, "tid": 2, "ts": start * us_per_unit, "dur": (end - start) * us_per_unit,
                    "args": {"microbatch": mb, "chunk": c}})
    for a, start, end in exchanges:
        out.append({"name": f"a2a {a.token(vpp > 1)}", "cat": "expert all-to-all", "ph": "X", "pid": a.rank,
                    "tid": 3, "ts": start * us_per_unit, "dur": (end - start) * us_per_unit,
                    "args": {"microbatch": a.microbatch, "chunk": a.chunk}})
    for r in sorted(ranks):
        out.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "compute"}})
        out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "p2p"}})
        if copies:
            out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 2, "args": {"name": "offload copies"}})
        if exchanges:
            out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 3, "args": {"name": "expert all-to-all"}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, events: Iterable[Event], us_per_unit: float = 1e6,
                       vpp: int = 1, copies: Sequence[tuple[int, str, int, int, float, float]] = (),
                       exchanges: Sequence[tuple[Action, float, float]] = ()) -> Path:
    """Write ``chrome_trace(events)`` as JSON to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, us_per_unit, vpp, copies=copies, exchanges=exchanges)))
    return path
