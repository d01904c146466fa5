"""Schedule generators: pure functions (pp, microbatches, vpp) -> Schedule (docs/architecture.md, principle 3).

Each generator decides the order of the compute actions on every rank, then ``_aligned_comm``
inserts the communication actions (actions.py explains the IR and the batching rule). The
compute orders, for rank r of p, m microbatches (``F i`` = forward of microbatch i):

    gpipe        F 0..m-1, then B 0..m-1                                  (holds m activations)
    1f1b         w = min(p-r-1, m) forwards; then (F w+i, B i) for i < m-w; then the last w B's
    interleaved  Megatron's order over the m*v virtual microbatches: forward k is microbatch
                 (k // (p v)) p + k % p on chunk (k // p) % v, backward k the same microbatch on
                 chunk v-1 - (k // p) % v; w = min(m v, (v-1) p + p-r-1) forwards, then
                 (forward w+i, backward i) pairs, then the remaining backwards. Megatron warms up
                 with (p-r-1) more forwards, which its lockstep p2p needs; ours places messages
                 on the ideal timeline instead, so the extra forwards would only cost memory (the
                 first rank holds v p chunk activations = p stages' worth, like 1F1B)
    zb-h1        step x = 0, 1, ... of rank r runs F x, BI x-(p-1-r), BW x-(p-1) (those in
                 range); Qi et al.'s ZB-H1: p activations on every rank, bubble (p-1)(T_F+T_B-T_W)
    zb-h2        the same with lags 2(p-1-r) and 2(p-1): 2p-1 activations on every rank, extra
                 warmup forwards fill the start, the deferred BW's fill the drain
    zb-v         two chunks per rank in a V (actions.py's placement v: chunk 1 is stage 2p-1-r),
                 Qi et al.'s section-6 order: 2p chunk activations (1F1B's peak) (v_orders.py)
    dualpipev    the same V, DeepSeek's eight phases per rank (v_orders.py): 2p + 1
                 chunk activations; its F&B pairs run one after the other (not overlapped)

Token slices (``slices`` = k > 1, TeraPipe; gpipe and 1f1b): the m k units (actions.py) go forward
in order and come back slice k-1 first within each microbatch; 1f1b warms up with k-1 more forwards
(p-r-1+k-1), which the last stage needs to reach a microbatch's last slice before its first backward:
p-1+k units in flight on rank 0, (p-1)/k + 1 microbatches' worth.

Communication (``_aligned_comm``): replay the compute orders on an ideal clock (T_F = T_BI = T_W
= 1, T_B = 2, a message usable the moment it is produced) and post both sides of each message at
the earliest tick, between producer and consumer, at which both ranks are between two computes.
The receive therefore always precedes its consumer and the send follows its producer; each group
finds all its peers posted while it is open, so blocking execution replays the ideal timeline:
deadlock-free for any real costs, and with the clock's costs the bubble equals the closed forms.

``build_schedule`` validates the arguments (ConfigError naming the valid values) and verifies the
result before returning it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from mpformer.core.layout import V_SCHEDULES, check_args
from mpformer.pipeline.actions import Action, Op, Schedule, make_schedule, rank_chunk, stage_of
from mpformer.pipeline.v_orders import dualpipev_orders, zbv_orders
from mpformer.pipeline.verify import verify

Compute = tuple[Op, int, int]  # (op, microbatch, chunk) on the rank whose order list holds it
TICKS = {Op.F: 1, Op.B: 2, Op.BI: 1, Op.BW: 1}  # the clock that places messages: T_F = T_BI = T_W


Orders = list[list[Compute]]


def _sliced_orders(pp: int, microbatches: int, slices: int, warmup: Callable[[int], int]) -> Orders:
    """Forwards in unit order, backwards last slice first within each microbatch; rank r runs
    ``warmup(r)`` forwards, then (forward, backward) pairs, then the remaining backwards."""
    k, total = slices, microbatches * slices
    fwd = [(Op.F, u, 0) for u in range(total)]
    bwd = [(Op.B, (j // k) * k + k - 1 - j % k, 0) for j in range(total)]
    orders = []
    for r in range(pp):
        w = min(total, warmup(r))
        order = fwd[:w]
        for i in range(total - w):
            order += [fwd[w + i], bwd[i]]
        orders.append(order + bwd[total - w:])
    return orders


def _gpipe_orders(pp: int, microbatches: int, vpp: int = 1) -> tuple[int, Orders]:
    return 1, [[(Op.F, i, 0) for i in range(microbatches)] + [(Op.B, i, 0) for i in range(microbatches)]
               for _ in range(pp)]


def _1f1b_orders(pp: int, microbatches: int, vpp: int = 1) -> tuple[int, Orders]:
    m, orders = microbatches, []
    for r in range(pp):
        w = min(pp - r - 1, m)
        order: list[Compute] = [(Op.F, i, 0) for i in range(w)]
        for i in range(m - w):
            order += [(Op.F, w + i, 0), (Op.B, i, 0)]
        order += [(Op.B, i, 0) for i in range(m - w, m)]
        orders.append(order)
    return 1, orders


def _interleaved_orders(pp: int, microbatches: int, vpp: int = 2) -> tuple[int, Orders]:
    v, total = vpp, microbatches * vpp

    def mb(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    orders = []
    for r in range(pp):
        w = min(total, (pp - r - 1) + (v - 1) * pp)
        fwd = [(Op.F, mb(k), (k // pp) % v) for k in range(total)]
        bwd = [(Op.B, mb(k), v - 1 - (k // pp) % v) for k in range(total)]
        order = fwd[:w]
        for i in range(total - w):
            order += [fwd[w + i], bwd[i]]
        order += bwd[total - w:]
        orders.append(order)
    return v, orders


def _zero_bubble_orders(pp: int, m: int, k: int) -> tuple[int, Orders]:
    """Qi et al.'s handcrafted order: step x of rank r runs F x, BI x - k(p-1-r), BW x - k(p-1)."""
    orders = []
    for r in range(pp):
        lag_b, lag_w = k * (pp - 1 - r), k * (pp - 1)
        order: list[Compute] = []
        for x in range(m + lag_w):
            order += [(op, i, 0) for op, i in ((Op.F, x), (Op.BI, x - lag_b), (Op.BW, x - lag_w)) if 0 <= i < m]
        orders.append(order)
    return 1, orders


def _messages(pp: int, vpp: int, r: int, op: Op, mb: int, c: int, v: bool = False
              ) -> tuple[tuple | None, tuple | None]:
    """The messages (Action.message) of the receive a compute needs and of the send it feeds, without
    building the actions: the generators call this for every compute of every rank. None at the ends of
    the pipeline and at the V's turn (``v``: stages pp-1 and pp on rank pp-1 hand over in memory)."""
    stage, last = stage_of(pp, r, c, v), pp * vpp - 1
    before = stage > 0 and not (v and stage == pp)
    after = stage < last and not (v and stage == pp - 1)
    if op == Op.F:
        return (("F", mb, stage - 1) if before else None), (("F", mb, stage) if after else None)
    if op in (Op.B, Op.BI):
        return (("B", mb, stage + 1) if after else None), (("B", mb, stage) if before else None)
    return None, None


def _paired(x: tuple) -> bool:
    """Whether a compute of an order opens an overlapped pair with the next (a 4th element, True)."""
    return len(x) > 3 and bool(x[3])


def _clock(pp: int, vpp: int, orders: list[list[Compute]], v: bool = False) -> list[list[int]]:
    """Start tick of every compute (costs TICKS) when a message arrives as soon as it is produced."""
    arrived: dict[tuple[str, int, int], int] = {}
    waiting: dict[tuple[str, int, int], int] = {}  # message -> the rank blocked on it
    ptr, clock = [0] * pp, [0] * pp
    starts: list[list[int]] = [[] for _ in range(pp)]
    runnable = list(range(pp))
    while runnable:
        r = runnable.pop()
        order, n = orders[r], len(orders[r])
        while ptr[r] < n:
            op, mb, c = order[ptr[r]][:3]
            key, out = _messages(pp, vpp, r, op, mb, c, v)
            keys = [key]
            if _paired(order[ptr[r]]):  # an overlapped pair starts when its second half's input is there too
                keys.append(_messages(pp, vpp, r, *order[ptr[r] + 1][:3], v)[0])
            missing = next((k for k in keys if k is not None and k not in arrived), None)
            if missing is not None:
                waiting[missing] = r
                break
            t = max([clock[r]] + [arrived[k] for k in keys if k is not None])
            starts[r].append(t)
            clock[r], ptr[r] = t + TICKS[op], ptr[r] + 1
            if out is not None:
                arrived[out] = clock[r]
                if out in waiting:
                    runnable.append(waiting.pop(out))
    assert not waiting, "generator produced a compute order with a cyclic dependency"
    return starts


@dataclass(frozen=True)
class Placement:
    """Where a message's two sides go: the sender's compute ``i`` on rank ``r`` posts its send in gap
    ``gs`` of its rank (gap g precedes compute g), the receive sits in gap ``gr`` of rank ``q``, before
    its consumer, compute ``consumer``; ``key`` orders the messages of a gap alike on both ranks."""

    r: int
    i: int
    gs: int
    q: int
    gr: int
    consumer: int
    key: tuple


def _placements(pp: int, vpp: int, orders: Orders, v: bool = False) -> tuple[list[list[int]], list[Placement]]:
    """Post both sides of every message at one tick where sender and receiver both sit in a gap.

    On the TICKS clock (no waiting for messages: the ideal timeline) a rank's gaps are the
    intervals between its computes. For each message we take the earliest tick, after the
    producer ends and before the consumer starts, that lies in a gap of both ranks, and put the
    send and the receive in those gaps. Every group then finds all its peers posted while it is
    open, so the blocking execution reproduces the ideal timeline: no deadlock, no added wait.
    Returns every compute's start tick and the placements.
    """
    starts = _clock(pp, vpp, orders, v)
    ends = [[t + TICKS[x[0]] for t, x in zip(st, o)] for st, o in zip(starts, orders)]
    index = [{(x[0] if x[0] != Op.BI else Op.B, x[1], x[2]): i for i, x in enumerate(o)} for o in orders]
    inside = [[g > 0 and _paired(o[g - 1]) for g in range(len(o) + 1)] for o in orders]  # within a pair
    inf = float("inf")

    def gap(r: int, g: int) -> tuple[float, float]:  # gap g precedes compute g; none inside a pair
        if inside[r][g]:
            return inf, -inf
        return (ends[r][g - 1] if g else 0), (starts[r][g] if g < len(starts[r]) else inf)

    out: list[Placement] = []
    for r, order in enumerate(orders):
        for i, x in enumerate(order):
            op, mb, c = x[:3]
            msg = _messages(pp, vpp, r, op, mb, c, v)[1]
            if msg is None:
                continue
            q, qc = rank_chunk(pp, msg[2] + (1 if op == Op.F else -1), v)  # the neighbouring global stage
            consumer = index[q][(Op.F if op == Op.F else Op.B, mb, qc)]
            last = consumer - inside[q][consumer]  # a pair's second half takes its input before the pair
            gs, gr = i + 1, bisect_left(starts[q], ends[r][i])  # first gaps at or after the send
            while True:
                (a_s, b_s), (a_r, b_r) = gap(r, gs), gap(q, gr)
                if max(a_s, a_r) <= min(b_s, b_r) or gr == last:
                    break  # a shared tick; or the receiver's last chance, where the sender waits
                # Move the gap that ends first past every gap of its rank that ends before the other
                # one begins (none of those can share a tick with it): a walk one gap at a time would
                # stop at the same place, in steady state after thousands of back-to-back computes.
                if b_s < b_r:
                    gs = max(gs + 1, bisect_left(starts[r], a_r, gs + 1))
                else:
                    gr = min(last, max(gr + 1, bisect_left(starts[q], a_s, gr + 1)))
            while inside[r][gs]:  # the receiver's last chance came first: post after the pair
                gs += 1
                a_s = ends[r][gs - 1]
            out.append(Placement(r, i, gs, q, gr, consumer, (max(a_s, a_r), ends[r][i], msg)))
    return starts, out


def _aligned_comm(pp: int, vpp: int, orders: Orders, v: bool = False) -> list[list[Action]]:
    """The action lists: every rank's computes with the messages placed by ``_placements``."""
    groups: dict[tuple[int, int], list[tuple[tuple, Action]]] = {}
    for pl in _placements(pp, vpp, orders, v)[1]:
        op, mb, c = orders[pl.r][pl.i][:3]
        fwd = op == Op.F
        qc = orders[pl.q][pl.consumer][2]
        groups.setdefault((pl.r, pl.gs), []).append((pl.key, Action(pl.r, Op.SEND_F if fwd else Op.SEND_B, mb, c)))
        groups.setdefault((pl.q, pl.gr), []).append((pl.key, Action(pl.q, Op.RECV_F if fwd else Op.RECV_B, mb, qc)))
    out = []
    for r, order in enumerate(orders):
        acts: list[Action] = []
        for g in range(len(order) + 1):
            # Both ends of a message use the same sort key, so two ranks order their messages alike.
            acts += [a for _, a in sorted(groups.get((r, g), []), key=lambda x: x[0])]
            if g < len(order):
                acts.append(Action(r, *order[g]))
        out.append(acts)
    return out


def gpipe(pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    return _make("gpipe", pp, microbatches, vpp)


def one_f_one_b(pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    return _make("1f1b", pp, microbatches, vpp)


def interleaved_1f1b(pp: int, microbatches: int, vpp: int = 2) -> Schedule:
    return _make("interleaved", pp, microbatches, vpp)


def zb_h1(pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    return _make("zb-h1", pp, microbatches, vpp)


def zb_h2(pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    return _make("zb-h2", pp, microbatches, vpp)


def zb_v(pp: int, microbatches: int, vpp: int = 2) -> Schedule:
    return _make("zb-v", pp, microbatches, vpp)


def dualpipev(pp: int, microbatches: int, vpp: int = 2) -> Schedule:
    return _make("dualpipev", pp, microbatches, vpp)


ORDERS: dict[str, Callable[[int, int, int], tuple[int, Orders]]] = {
    "gpipe": _gpipe_orders,
    "1f1b": _1f1b_orders,
    "interleaved": _interleaved_orders,
    "zb-h1": lambda pp, m, vpp=1: _zero_bubble_orders(pp, m, 1),
    "zb-h2": lambda pp, m, vpp=1: _zero_bubble_orders(pp, m, 2),
    "zb-v": zbv_orders,
    "dualpipev": dualpipev_orders,
}


def compute_orders(name: str, pp: int, microbatches: int, vpp: int, slices: int = 1) -> tuple[int, Orders]:
    """(chunks per rank, every rank's compute order) of a schedule; with token slices (gpipe, 1f1b:
    check_args) over the microbatches x slices units."""
    if slices == 1:
        return ORDERS[name](pp, microbatches, vpp)
    warm = (lambda r: microbatches * slices) if name == "gpipe" else (lambda r: pp - r - 1 + slices - 1)
    return 1, _sliced_orders(pp, microbatches, slices, warm)


def _make(name: str, pp: int, microbatches: int, vpp: int, slices: int = 1) -> Schedule:
    chunks, orders = compute_orders(name, pp, microbatches, vpp, slices)
    place = "v" if name in V_SCHEDULES else "interleaved"  # a V schedule's chunks sit in a V (actions.py)
    return make_schedule(name, pp, chunks, microbatches * slices, _aligned_comm(pp, chunks, orders, place == "v"),
                         place, slices)


Generator = Callable[[int, int, int], Schedule]
SCHEDULES: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zb-v": zb_v,
    "dualpipev": dualpipev,
}


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, *, slices: int = 1,
                   check: bool = True) -> Schedule:
    """Validate, generate and verify (ScheduleError if a generator were ever wrong). ``check=False``
    skips the verification: the cost model's timelines (pipeline/timeline.py) fail on a schedule that
    cannot run, and the generators are verified by the tests; the engine always checks. ``slices``:
    token-level pipelining, each of the ``microbatches`` cut into that many units (actions.py)."""
    check_args(name, pp, microbatches, vpp, slices)
    schedule = _make(name, pp, microbatches, vpp, slices)
    if check:
        verify(schedule)
    return schedule
