"""A schedule's overlapped timeline compiled once into a dependency graph, then re-timed for any costs.

``verify.execute(blocking=False)`` runs the action lists on a clock: a compute starts when its rank's
previous compute has ended and its input has arrived; a message arrives ``p2p`` after both its send
and its receive are posted, each posted when its rank reaches it, i.e. when the compute before it on
that rank ends. Which compute waits on which, and the order in which a walk can time them, depend
on the lists alone, not on the durations. ``compile_timeline`` walks the lists once and records, for
every compute in that order, the three computes whose ends it waits on; ``CompiledTimeline.step_time``
is then one pass over arrays. The auto-configurator re-times the same few schedules for thousands of
cost vectors (cost.py); tests check it against ``simulate`` on every generated schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpformer.pipeline.actions import Action, Op, Schedule, ScheduleError
from mpformer.pipeline.simulate import Costs

_KIND = {Op.F: "f", Op.BI: "b", Op.BW: "w"}


@dataclass(frozen=True)
class CompiledTimeline:
    """Computes in a dependency order; per compute: the previous compute of its rank, the computes
    after which its input's send and receive are posted (-1: none, the message or rank starts at 0),
    whether it has an input, and (op, global stage) for its duration. ``partner``: for the first half
    of an overlapped pair (actions.py) the node of its second half, else -1 (empty: no pairs); the
    pair starts when both inputs are there and its time is split as ``simulate`` splits it."""

    num_stages: int
    prev: tuple[int, ...]
    send_post: tuple[int, ...]
    recv_post: tuple[int, ...]
    has_input: tuple[bool, ...]
    ops: tuple[Op, ...]
    stages: tuple[int, ...]
    partner: tuple[int, ...] = ()

    def step_time(self, costs: Costs) -> float:
        """The last compute's end (= simulate(schedule, costs).step_time for the overlapped engine)."""
        costs.check(self.num_stages)
        table: dict[tuple[Op, int], float] = {}  # a compute alone: its compute, then its exchanges
        xtable: dict[tuple[Op, int], float] = {}  # its expert exchanges (a pair runs them beside compute)
        for op in set(self.ops):
            for s in range(self.num_stages):
                alone = costs._at("b", s) + costs._at("w", s) if op is Op.B else costs._at(_KIND[op], s)
                x = costs._at("a2a_f" if op is Op.F else "a2a_b", s) if op is not Op.BW else 0.0
                table[op, s], xtable[op, s] = alone + x, x
        p2p, end = costs.p2p, [0.0] * len(self.prev)
        prev, sp, rp, inp, partner = self.prev, self.send_post, self.recv_post, self.has_input, self.partner
        pair_end: dict[int, float] = {}  # second half of a pair -> the pair's end

        def arrival(i: int) -> float:
            return max(end[sp[i]] if sp[i] >= 0 else 0.0, end[rp[i]] if rp[i] >= 0 else 0.0) + p2p

        for i, (op, s) in enumerate(zip(self.ops, self.stages)):
            if i in pair_end:
                end[i] = pair_end.pop(i)
                continue
            t = end[prev[i]] if prev[i] >= 0 else 0.0
            if inp[i]:
                t = max(t, arrival(i))
            j = partner[i] if partner else -1
            if j < 0:
                end[i] = t + table[op, s]
                continue
            if inp[j]:
                t = max(t, arrival(j))
            c1, c2 = table[op, s], table[self.ops[j], self.stages[j]]
            x1, x2 = xtable[op, s], xtable[self.ops[j], self.stages[j]]
            d = costs.fb if costs.fb is not None else max(c1 - x1 + c2 - x2, x1 + x2)  # as Costs.pair
            end[i], pair_end[j] = t + (d * c1 / (c1 + c2) if c1 + c2 > 0 else 0.0), t + d
        return max(end, default=0.0)


def compile_timeline(s: Schedule) -> CompiledTimeline:
    """Walk the lists as the overlapped engine does (with no durations: only who waits on whom)."""
    pp, acts, last_stage, v = s.pp, s.actions, s.num_stages - 1, s.v
    ptr = [0] * pp
    last = [-1] * pp  # node id of each rank's last compute so far
    posted: dict[tuple[str, int, int], tuple[bool, int]] = {}  # message -> (its send?, node after which posted)
    arrived: dict[tuple[str, int, int], tuple[int, int]] = {}  # message -> (send post, recv post)
    waiting: dict[tuple[str, int, int], int] = {}
    prev: list[int] = []
    send_post: list[int] = []
    recv_post: list[int] = []
    has_input: list[bool] = []
    ops: list[Op] = []
    stages: list[int] = []
    partner: list[int] = []

    def need_of(a: Action) -> tuple[str, int, int] | None:
        op, stage = a.op, a.stage(pp, v)
        if op is Op.F:  # (the V's turn hands over on the rank: after the rank's previous compute)
            return ("F", a.microbatch, stage - 1) if stage > 0 and not (v and s.local(stage, stage - 1)) else None
        if op is Op.BW:
            return None
        return ("B", a.microbatch, stage + 1) if stage < last_stage and not (v and s.local(stage, stage + 1)) else None

    runnable = list(range(pp))
    while runnable:
        r = runnable.pop()
        row = acts[r]
        while ptr[r] < len(row):
            a = row[ptr[r]]
            op, stage = a.op, a.stage(pp, v)
            if op in _COMM:
                msg = _MESSAGE[op](a.microbatch, stage)  # Action.message, inline: called for every action
                other = posted.pop(msg, None)
                is_send = op is Op.SEND_F or op is Op.SEND_B
                if other is None:
                    posted[msg] = (is_send, last[r])
                else:  # the other side was posted before
                    arrived[msg] = (last[r], other[1]) if is_send else (other[1], last[r])
                    if msg in waiting:
                        runnable.append(waiting.pop(msg))
                ptr[r] += 1
                continue
            group = row[ptr[r]:ptr[r] + 2] if a.overlap else (a,)  # a pair waits for both inputs
            needs = [need_of(x) for x in group]
            missing = next((n for n in needs if n is not None and n not in arrived), None)
            if missing is not None:
                waiting[missing] = r
                break
            for x, need in zip(group, needs):
                send, recv = arrived[need] if need is not None else (-1, -1)
                prev.append(last[r])
                send_post.append(send)
                recv_post.append(recv)
                has_input.append(need is not None)
                ops.append(x.op)
                stages.append(x.stage(pp, v))
                partner.append(len(prev) if x.overlap else -1)
                last[r] = len(prev) - 1
            ptr[r] += len(group)
    if any(ptr[r] < len(acts[r]) for r in range(pp)) or posted:
        raise ScheduleError(f"schedule {s.name!r} cannot run to its end (run verify() for the exact cause)")
    return CompiledTimeline(s.num_stages, tuple(prev), tuple(send_post), tuple(recv_post), tuple(has_input),
                            tuple(ops), tuple(stages), tuple(partner) if any(p >= 0 for p in partner) else ())


def compile_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, slices: int = 1) -> CompiledTimeline:
    """``compile_timeline(build_schedule(...))`` without building the action lists: from the
    generator's compute orders and its message placements (schedules._placements, which the lists are
    made of), in the start order of its ideal clock, which every dependency respects. Equal to the
    lists' compiled form on every generated schedule (tests/unit/test_pipeline_timeline.py); the cost
    model compiles schedules of 64 stages and hundreds of micro-batches with it."""
    from mpformer.core.layout import V_SCHEDULES, check_args
    from mpformer.pipeline.actions import stage_of
    from mpformer.pipeline.schedules import _paired, _placements, compute_orders

    check_args(name, pp, microbatches, vpp, slices)
    chunks, orders = compute_orders(name, pp, microbatches, vpp, slices)
    v = name in V_SCHEDULES
    starts, placements = _placements(pp, chunks, orders, v)
    order = sorted((t, r, i) for r, st in enumerate(starts) for i, t in enumerate(st))
    node = {(r, i): k for k, (_, r, i) in enumerate(order)}
    inputs = {(pl.q, pl.consumer): (node[pl.r, pl.gs - 1] if pl.gs else -1, node[pl.q, pl.gr - 1] if pl.gr else -1)
              for pl in placements}
    prev, send_post, recv_post, has_input, ops, stages, partner = [], [], [], [], [], [], []
    for _, r, i in order:
        op, _, c = orders[r][i][:3]
        partner.append(node[r, i + 1] if _paired(orders[r][i]) else -1)
        prev.append(node[r, i - 1] if i else -1)
        s, q = inputs.get((r, i), (-1, -1))
        send_post.append(s)
        recv_post.append(q)
        has_input.append((r, i) in inputs)
        ops.append(op)
        stages.append(stage_of(pp, r, c, v))
    return CompiledTimeline(pp * chunks, tuple(prev), tuple(send_post), tuple(recv_post), tuple(has_input), tuple(ops),
                            tuple(stages), tuple(partner) if any(p >= 0 for p in partner) else ())


_COMM = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
_MESSAGE = {Op.SEND_F: lambda mb, st: ("F", mb, st), Op.SEND_B: lambda mb, st: ("B", mb, st),
            Op.RECV_F: lambda mb, st: ("F", mb, st - 1), Op.RECV_B: lambda mb, st: ("B", mb, st + 1)}
