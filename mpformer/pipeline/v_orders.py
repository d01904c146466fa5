"""The V-shaped schedules' compute orders (actions.py's placement v: rank r holds stage r as chunk 0
and stage 2p - 1 - r as chunk 1). schedules.py places their messages and builds the Schedule; the
V's turn (stages p - 1 and p, both on rank p - 1) hands over in memory.

    zb-v       Qi et al. 2024 ("Pipeline Parallelism with Controllable Memory"), list-scheduled on the
               unit clock under 1F1B's peak activations
    dualpipev  DeepSeek's DualPipe cut in half onto the V (deepseek-ai/DualPipe), its eight phases
"""

from __future__ import annotations

from mpformer.pipeline.actions import Op, stage_of

Compute = tuple  # (op, microbatch, chunk[, True: overlapped with the next compute]), as in schedules.py
Orders = list[list[Compute]]


def zbv_orders(pp: int, m: int, vpp: int = 2) -> tuple[int, Orders]:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): two chunks per rank in a
    V (placement v), the backward split into BI and BW, each rank holding at most 2p chunk activations
    (p whole-stage micro-batches: 1F1B's peak). The order is list-scheduled on the unit clock (T_F =
    T_BI = T_W = 1 per chunk, messages free): whenever a rank is free it runs, of what is ready, an
    input-gradient pass (the critical path; oldest micro-batch first, the later stage first), else a
    forward while it holds fewer than 2p activations (the later stage first: it finishes a micro-batch
    already in flight), else a deferred weight pass (the oldest), else it waits. With equal costs a
    rank idles only in the fill and the drain (p=6, m=24: 0.046 of the step, ZB-H1 0.065); the memory
    cap is what keeps the warm-up's forwards to 1F1B's."""
    last, cap = 2 * pp - 1, 2 * pp
    end: dict[tuple[Op, int, int], int] = {}  # (op, microbatch, stage) -> end tick
    orders: list[list[Compute]] = [[] for _ in range(pp)]
    held = [0] * pp
    waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # (microbatch, stage) awaiting BW
    next_f = [[0, 0] for _ in range(pp)]  # per rank and chunk: the next microbatch to forward
    next_b = [[0, 0] for _ in range(pp)]  # ... and to run BI on
    total, done, t = 2 * m * 3 * pp, 0, 0

    def ready(op: Op, mb: int, stage: int) -> bool:
        if op is Op.F:
            return stage == 0 or end.get((Op.F, mb, stage - 1), t + 1) <= t
        if stage == last:
            return end.get((Op.F, mb, stage), t + 1) <= t
        return end.get((Op.BI, mb, stage + 1), t + 1) <= t

    while done < total:
        for r in range(pp):  # every rank free at tick t (all computes take one tick) picks one
            stages = (stage_of(pp, r, 0, True), stage_of(pp, r, 1, True))
            pick = None
            cands = [(next_b[r][c], -stages[c], c) for c in (0, 1) if next_b[r][c] < m]
            for mb, _, c in sorted(cands):
                if ready(Op.BI, mb, stages[c]) and end.get((Op.F, mb, stages[c]), t + 1) <= t:
                    pick = (Op.BI, mb, c)
                    break
            if pick is None and held[r] < cap:
                cands = [(next_f[r][c], -stages[c], c) for c in (0, 1) if next_f[r][c] < m]
                for mb, _, c in sorted(cands):
                    if ready(Op.F, mb, stages[c]):
                        pick = (Op.F, mb, c)
                        break
            if pick is None and waiting_w[r]:
                mb, st = waiting_w[r].pop(0)
                pick = (Op.BW, mb, 0 if st == stages[0] else 1)
            if pick is None:
                continue
            op, mb, c = pick
            orders[r].append(pick)
            end[op, mb, stages[c]] = t + 1
            done += 1
            if op is Op.F:
                next_f[r][c] += 1
                held[r] += 1
            elif op is Op.BI:
                next_b[r][c] += 1
                waiting_w[r].append((mb, stages[c]))
            else:
                held[r] -= 1
        t += 1
        assert t <= 4 * total, "zb-v's list scheduling stalled"  # cannot happen: the cap is 1F1B's
    return 2, orders


def dualpipev_orders(pp: int, m: int, vpp: int = 2) -> tuple[int, Orders]:
    """DualPipeV (DeepSeek's DualPipe cut in half onto a V, deepseek-ai/DualPipe): rank r runs eight
    phases, each a count of steps (chunk 0 = its stage r, chunk 1 = stage 2p-1-r; ``B`` a full
    backward, ``BI`` one whose weight pass is deferred, ``W`` the oldest deferred one):

        1  F0 x 2(p-r-1)            warm-up down the V
        2  F0 F1 x (r+1)            both chunks fill
        3  BI1 W F1 x (p-r-1)       the first backwards, their weight passes at once
        4  F0 B1 F1 B0 x (m-2p+r+1) the steady state: F0 beside B1, F1 beside B0, each an overlapped
                                    pair (actions.py: DualPipe overlaps one's compute with the other's
                                    communication; priced by Costs.fb, run in turn by this engine)
        5  B1 F1 B0 x (p-r-1)       F1 beside B0
        6  B1 B0 x (r+1)            from the middle step on, split backwards (BI)
        7  W BI0 x (p-r-1)
        8  W x (r+1)                the deferred weight passes drain

    Needs m >= 2p."""
    return 2, [_dualpipev_rank(pp, m, r) for r in range(pp)]


def _dualpipev_rank(pp: int, m: int, r: int) -> list[Compute]:
    order: list[Compute] = []
    nf, nb = [0, 0], [0, 0]
    deferred: list[tuple[int, int]] = []

    def f(c: int, pair: bool = False) -> None:  # pair: overlapped with the backward that follows
        order.append((Op.F, nf[c], c, True) if pair else (Op.F, nf[c], c))
        nf[c] += 1

    def b(c: int, split: bool = False) -> None:
        order.append((Op.BI if split else Op.B, nb[c], c))
        if split:
            deferred.append((nb[c], c))
        nb[c] += 1

    def w() -> None:
        mb, c = deferred.pop(0)
        order.append((Op.BW, mb, c))

    ahead, behind = pp - r - 1, r + 1
    for _ in range(2 * ahead):
        f(0)
    for _ in range(behind):
        f(0), f(1)
    for _ in range(ahead):
        b(1, True), w(), f(1)
    for i in range(m - 2 * pp + behind):  # the middle rank's first F0, B1 apart: a smaller bubble
        f(0, i > 0 or r < pp - 1), b(1), f(1, True), b(0)
    for _ in range(ahead):
        b(1), f(1, True), b(0)
    for i in range(behind):  # the split starts mid-phase: with B0 on even ranks, with B1 on odd ones
        b(1, i > behind // 2 or (i == behind // 2 and r % 2 == 1)), b(0, i >= behind // 2)
    for _ in range(ahead):
        w(), b(0, True)
    for _ in range(behind):
        w()
    return order
