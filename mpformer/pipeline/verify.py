"""Prove a schedule can run before any process exists: matching, ordering, no deadlock, memory.

``verify(schedule)`` runs three passes, all O(number of actions):

1. Per rank, in list order (static): every action is in range and points at a real neighbour;
   each (microbatch, chunk) gets exactly one F and one full backward (B, or BI then BW); F comes
   after its RECV_F (stages > 0), B/BI after its F and, below the last stage, after its RECV_B;
   BW after its BI; SEND_F after the F it sends, SEND_B after the B/BI it sends; with token slices,
   a slice's F after the previous slice's and its backward after the next slice's. With these, every
   message (kind, microbatch, stage boundary) has exactly one send and one receive, on the stages
   at its two ends, so the shapes agree by construction.
2. ``execute``: every rank runs its list under blocking semantics. Compute is local (its inputs
   were checked in pass 1); a group of adjacent communication actions (the batching rule of
   actions.py) is posted at once and completes when every peer has posted the matching
   operation. If ranks remain blocked, the schedule deadlocks: the error names a blocked rank,
   its action and what it waits for. The simulator runs this same function with real costs
   (in this blocking mode, or overlapped: see ``execute``).
3. Between each ordered pair of ranks the sends and the receives must come in the same order,
   since NCCL (and gloo without tags) match messages between two ranks in posting order; a swap
   inside one batched group would otherwise silently exchange two same-shaped tensors.

It also counts the peak number of in-flight (microbatch, chunk) activations per rank: +1 at F,
-1 when the backward that needs them last is done (B, or BW for a split backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpformer.pipeline.actions import Action, Op, Schedule, ScheduleError


@dataclass(frozen=True)
class TimedAction:
    """An action with its start and end time. For a communication action: posted at ``start``,
    matched and transferred at ``end`` (its group, hence the rank, resumes at the group's max end)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class VerifyResult:
    peak_inflight: list[int]  # per rank: peak (microbatch, chunk) activations held
    num_actions: int
    num_groups: int  # batched communication groups, all ranks together


def verify(schedule: Schedule) -> VerifyResult:
    """Raise ScheduleError (one line: rank, action, what it waits for / what is missing) or return stats."""
    if schedule.pp == 1 and schedule.vpp > 1:
        raise ScheduleError(f"vpp={schedule.vpp} needs pp > 1 (consecutive chunks would sit on one rank); "
                            "valid: vpp=1")
    peaks = [_check_rank(schedule, r) for r in range(schedule.pp)]
    execute(schedule, lambda a: 1.0)
    _check_channel_order(schedule)
    groups = sum(a.op.is_comm and (i == 0 or not acts[i - 1].op.is_comm)
                 for acts in schedule.actions for i, a in enumerate(acts))
    return VerifyResult(peak_inflight=peaks, num_actions=len(schedule), num_groups=groups)


def _check_rank(s: Schedule, r: int) -> int:
    """Pass 1 for rank r; returns its peak in-flight activations."""
    pp, last, v = s.pp, s.num_stages - 1, s.v
    seen: set[tuple[Op, int, int]] = set()
    inflight = peak = 0

    def fail(a: Action, what: str) -> None:  # messages are built only on failure: this loop is hot
        raise ScheduleError(f"{a.describe(s.vpp)} {what}")

    def need(op: Op, a: Action, why: str) -> None:
        if (op, a.microbatch, a.chunk) not in seen:
            fail(a, f"needs {Action(r, op, a.microbatch, a.chunk).token(s.vpp > 1)} before it ({why}, "
                    f"stage {a.stage(pp, v)})")

    def need_local(op: Op, a: Action, chunk: int, why: str) -> None:  # the V's turn: in memory
        if (op, a.microbatch, chunk) not in seen and (op is not Op.B or (Op.BI, a.microbatch, chunk) not in seen):
            fail(a, f"needs {Action(r, op, a.microbatch, chunk).token(True)} before it ({why}, on this rank)")

    acts = s.actions[r]
    for k, a in enumerate(acts):
        op, mb, c = a.op, a.microbatch, a.chunk
        if a.rank != r:
            fail(a, f"is in rank {r}'s list")
        if a.overlap:
            _check_pair(s, a, acts[k + 1] if k + 1 < len(acts) else None, fail)
        if not (0 <= c < s.vpp and 0 <= mb < s.microbatches):
            fail(a, f"is out of range: microbatch 0..{s.microbatches - 1}, chunk 0..{s.vpp - 1}")
        stage = a.stage(pp, v)
        key = (op, mb, c)
        if key in seen:
            fail(a, f"is a duplicate: stage {stage} already has it for this microbatch")
        if s.slices > 1 and op is not Op.BW and not op.is_comm:
            _check_slice(s, a, seen, fail)
        if op is Op.F:
            if stage > 0 and v and s.local(stage, stage - 1):
                need_local(Op.F, a, 1 - c, "the previous stage's forward")
            elif stage > 0:
                need(Op.RECV_F, a, "the activation from the previous stage")
            inflight += 1
            peak = max(peak, inflight)
        elif op is Op.B or op is Op.BI:
            if ((Op.BI if op is Op.B else Op.B), mb, c) in seen:
                fail(a, "mixes B with BI/BW for the same microbatch and chunk")
            need(Op.F, a, "its forward")
            if stage < last and v and s.local(stage, stage + 1):
                need_local(Op.B, a, 1 - c, "the next stage's backward")
            elif stage < last:
                need(Op.RECV_B, a, "the output gradient from the next stage")
            inflight -= op is Op.B
        elif op is Op.BW:
            need(Op.BI, a, "the input-gradient pass of the same microbatch and chunk")
            inflight -= 1
        else:
            if not 0 <= a.peer_stage(pp, v) <= last:
                fail(a, f"on stage {stage} has no neighbour stage {a.peer_stage(pp, v)} (stages 0..{last})")
            if v and s.local(stage, a.peer_stage(pp, v)):
                fail(a, f"joins stages {stage} and {a.peer_stage(pp, v)}, which sit on this rank and hand over "
                        "in memory: no message")
            if op is Op.SEND_F:
                need(Op.F, a, "the forward whose output it sends")
            elif op is Op.SEND_B and (Op.B, mb, c) not in seen:
                need(Op.BI, a, "the backward whose input gradient it sends")
        seen.add(key)
    _check_complete(s, r, seen)
    return peak


def _check_slice(s: Schedule, a: Action, seen: set[tuple[Op, int, int]], fail: Callable[[Action, str], None]
                 ) -> None:
    """Token slices (actions.py): a slice's forward reads the keys and values of the slice before it on
    this stage; its backward needs the key/value gradients the slice after it adds."""
    k, mb, c = s.slices, a.microbatch, a.chunk
    if a.op is Op.F and mb % k and (Op.F, mb - 1, c) not in seen:
        fail(a, f"needs F{mb - 1} before it (the previous slice's keys and values, slice {mb % k} of {k})")
    if a.op in (Op.B, Op.BI) and (mb + 1) % k and (Op.B, mb + 1, c) not in seen and (Op.BI, mb + 1, c) not in seen:
        fail(a, f"needs the backward of {mb + 1} before it (the next slice adds to this slice's key and value "
                f"gradients, slice {mb % k} of {k})")


def _check_pair(s: Schedule, a: Action, b: Action | None, fail: Callable[[Action, str], None]) -> None:
    """An overlapped pair: two computes back to back, the second not needing the first (they run at
    once), the second not opening another pair."""
    if a.op.is_comm or b is None or b.op.is_comm or b.overlap:
        fail(a, "is marked to overlap the next action, which must be a compute (and not itself marked)")
    same = (a.microbatch, a.chunk) == (b.microbatch, b.chunk)
    turn = a.microbatch == b.microbatch and s.v and s.local(a.stage(s.pp, True), b.stage(s.pp, True))
    if (same and a.op is Op.F) or (same and a.op is Op.BI and b.op is Op.BW) or (turn and a.op is b.op is Op.F) \
            or (turn and a.op in (Op.B, Op.BI) and b.op in (Op.B, Op.BI)):
        fail(a, f"overlaps {b.token(s.vpp > 1)}, which needs its result: a pair must be independent")


def _check_complete(s: Schedule, r: int, seen: set[tuple[Op, int, int]]) -> None:
    last = s.num_stages - 1
    for c in range(s.vpp):
        stage = s.stage(r, c)
        for mb in range(s.microbatches):
            missing = None
            if (Op.F, mb, c) not in seen:
                missing = Op.F
            elif (Op.B, mb, c) not in seen and (Op.BI, mb, c) not in seen:
                missing = Op.B
            elif (Op.BI, mb, c) in seen and (Op.BW, mb, c) not in seen:
                missing = Op.BW
            elif stage < last and (Op.SEND_F, mb, c) not in seen and not s.local(stage, stage + 1):
                missing = Op.SEND_F
            elif stage > 0 and (Op.SEND_B, mb, c) not in seen and not s.local(stage, stage - 1):
                missing = Op.SEND_B
            if missing is not None:
                tok = Action(r, missing, mb, c).token(s.vpp > 1)
                raise ScheduleError(f"rank {r} is missing action {tok} (stage {stage}, microbatch {mb})")


def _segments(acts: tuple[Action, ...]) -> list[tuple[int, int, bool]]:
    """Split a rank's list into (lo, hi, is_comm_group): single compute actions and maximal comm runs."""
    out: list[tuple[int, int, bool]] = []
    i = 0
    while i < len(acts):
        j = i + 1
        if acts[i].op.is_comm:
            while j < len(acts) and acts[j].op.is_comm:
                j += 1
        out.append((i, j, acts[i].op.is_comm))
        i = j
    return out


def execute(schedule: Schedule, duration: Callable[[Action], float], p2p: float = 0.0, *,
            blocking: bool = True, pair: Callable[[Action, Action], float] | None = None
            ) -> list[list[TimedAction]]:
    """Run every rank's list in order; return each action's (start, end). Two engine semantics:

    blocking=True: a group is posted when its rank reaches it; each operation completes ``p2p``
    after both sides are posted; the rank resumes when its whole group is done (batch_isend_irecv
    then wait on everything). The verifier uses it: it is the strictest, so a schedule that runs
    this way also runs under the overlapped semantics below.
    blocking=False (overlapped): posting a group never stops the rank; a compute waits only for
    the receive it consumes (complete ``p2p`` after both sides posted). This is the engine that
    waits for a receive right before its consumer and for its sends lazily.

    A compute takes ``duration(action)``; an overlapped pair (actions.py) starts when both its inputs
    are there and takes ``pair(first, second)`` (default: the two durations' sum), split between its
    halves in proportion to their own durations. Times do not depend on the order ranks are advanced in.
    """
    def run_pair(r: int, i: int, t: float) -> float:
        a, b = acts[r][i], acts[r][i + 1]
        da, db = duration(a), duration(b)
        d = pair(a, b) if pair is not None else da + db
        mid = t + (d * da / (da + db) if da + db > 0 else 0.0)
        timed[r][i], timed[r][i + 1] = TimedAction(a, t, mid), TimedAction(b, mid, t + d)
        return t + d

    acts = schedule.actions
    timed: list[list[TimedAction | None]] = [[None] * len(a) for a in acts]
    if not blocking:
        return _run_overlapped(schedule, duration, p2p, run_pair, timed)
    pp, v = schedule.pp, schedule.v
    segs = [_segments(a) for a in acts]
    ptr, clock = [0] * pp, [0.0] * pp
    pending, group_end = [0] * pp, [0.0] * pp
    posted: dict[tuple[str, int, int], tuple[int, int, float]] = {}  # message -> (rank, index, time)
    runnable = list(range(pp))
    while runnable:
        r = runnable.pop()
        while ptr[r] < len(segs[r]):
            lo, hi, is_comm = segs[r][ptr[r]]
            if not is_comm:
                a, t = acts[r][lo], clock[r]
                if a.overlap:  # its partner is the next segment: both run now
                    clock[r] = run_pair(r, lo, t)
                    ptr[r] += 2
                    continue
                clock[r] = t + duration(a)
                timed[r][lo] = TimedAction(a, t, clock[r])
                ptr[r] += 1
                continue
            t = clock[r]
            pending[r], group_end[r] = hi - lo, t
            for i in range(lo, hi):
                msg = acts[r][i].message(pp, v)
                other = posted.pop(msg, None)
                if other is None:
                    posted[msg] = (r, i, t)
                    continue
                q, j, tq = other
                done = max(t, tq) + p2p
                timed[r][i], timed[q][j] = TimedAction(acts[r][i], t, done), TimedAction(acts[q][j], tq, done)
                for x in (r, q):
                    pending[x] -= 1
                    group_end[x] = max(group_end[x], done)
                if q != r and pending[q] == 0:
                    clock[q] = group_end[q]
                    ptr[q] += 1
                    runnable.append(q)
            if pending[r]:
                break
            clock[r] = group_end[r]
            ptr[r] += 1
    blocked = [r for r in range(pp) if ptr[r] < len(segs[r])]
    if blocked:
        raise ScheduleError(_deadlock_message(schedule, blocked, posted))
    return timed  # type: ignore[return-value]


def _input_message(s: Schedule, a: Action) -> tuple[str, int, int] | None:
    """The message a compute consumes (None for BW and at the ends of the pipeline)."""
    stage = a.stage(s.pp, s.v)
    if a.op == Op.F and stage > 0 and not s.local(stage, stage - 1):
        return Action(a.rank, Op.RECV_F, a.microbatch, a.chunk).message(s.pp, s.v)
    if a.op in (Op.B, Op.BI) and stage < s.num_stages - 1 and not s.local(stage, stage + 1):
        return Action(a.rank, Op.RECV_B, a.microbatch, a.chunk).message(s.pp, s.v)
    return None  # the pipeline's ends, a weight pass, or the V's turn (its input is on the rank already)


def _run_overlapped(s: Schedule, duration: Callable[[Action], float], p2p: float,
                    run_pair: Callable[[int, int, float], float], timed: list[list[TimedAction | None]]
                    ) -> list[list[TimedAction]]:
    pp, acts, v = s.pp, s.actions, s.v
    ptr, clock = [0] * pp, [0.0] * pp
    posted: dict[tuple[str, int, int], tuple[int, int, float]] = {}
    done: dict[tuple[str, int, int], float] = {}  # message -> time its receive completes
    waiting: dict[tuple[str, int, int], int] = {}  # message -> rank whose next compute needs it
    runnable = list(range(pp))
    while runnable:
        r = runnable.pop()
        while ptr[r] < len(acts[r]):
            a, t = acts[r][ptr[r]], clock[r]
            if a.op.is_comm:
                msg = a.message(pp, v)
                other = posted.pop(msg, None)
                if other is None:
                    posted[msg] = (r, ptr[r], t)
                else:
                    q, j, tq = other
                    done[msg] = max(t, tq) + p2p
                    timed[r][ptr[r]], timed[q][j] = TimedAction(a, t, done[msg]), TimedAction(acts[q][j], tq, done[msg])
                    if msg in waiting:
                        runnable.append(waiting.pop(msg))
                ptr[r] += 1
                continue
            needs = [_input_message(s, x) for x in (acts[r][ptr[r]:ptr[r] + 2] if a.overlap else (a,))]
            missing = next((n for n in needs if n is not None and n not in done), None)
            if missing is not None:
                waiting[missing] = r
                break
            t = max([t] + [done[n] for n in needs if n is not None])
            if a.overlap:
                clock[r] = run_pair(r, ptr[r], t)
                ptr[r] += 2
                continue
            clock[r] = t + duration(a)
            timed[r][ptr[r]] = TimedAction(a, t, clock[r])
            ptr[r] += 1
    stuck = [r for r in range(pp) if ptr[r] < len(acts[r])]
    if stuck or posted:
        r = stuck[0] if stuck else posted[next(iter(posted))][0]
        i = ptr[r] if stuck else posted[next(iter(posted))][1]
        raise ScheduleError(f"{acts[r][i].describe(s.vpp)} never completes: its peer never posts the matching "
                            "operation (run verify() first for the exact cause)")
    return timed  # type: ignore[return-value]


def _deadlock_message(s: Schedule, blocked: list[int], posted: dict) -> str:
    earliest: dict[int, int] = {}  # rank -> index of its first unmatched operation
    for rank, i, _ in posted.values():
        earliest[rank] = min(i, earliest.get(rank, i))
    first_wait = {rank: s.actions[rank][i] for rank, i in earliest.items()}
    r = blocked[0]
    a = first_wait[r]
    q, c = a.peer(s.pp, s.v)
    mirror = {Op.SEND_F: Op.RECV_F, Op.RECV_F: Op.SEND_F, Op.SEND_B: Op.RECV_B, Op.RECV_B: Op.SEND_B}[a.op]
    want = Action(q, mirror, a.microbatch, c).token(s.vpp > 1)
    there = f"blocked at action {first_wait[q].token(s.vpp > 1)}" if q in first_wait else "never posting it"
    return (f"deadlock: {a.describe(s.vpp)} waits for rank {q} to post {want}, but rank {q} is {there} "
            f"(blocked ranks: {', '.join(map(str, blocked))})")


def _check_channel_order(s: Schedule) -> None:
    """Pass 3: between two ranks, the k-th send and the k-th receive must carry the same message."""
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.op in (Op.SEND_F, Op.SEND_B):
                sends.setdefault((r, a.peer(s.pp, s.v)[0]), []).append(a)
            elif a.op.is_comm:
                recvs.setdefault((a.peer(s.pp, s.v)[0], r), []).append(a)
    for (src, dst), out in sends.items():
        for k, (snd, rcv) in enumerate(zip(out, recvs.get((src, dst), []))):
            if snd.message(s.pp, s.v) != rcv.message(s.pp, s.v):
                raise ScheduleError(
                    f"{rcv.describe(s.vpp)} is receive #{k + 1} from rank {src} but send #{k + 1} of rank {src} "
                    f"to rank {dst} is {snd.token(s.vpp > 1)}; messages between two ranks match in posting "
                    "order, so both lists must order them alike")
