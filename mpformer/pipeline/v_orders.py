"""The V-shaped schedules' compute orders (actions.py's placement v: rank r holds stage r as chunk 0
and stage 2p - 1 - r as chunk 1). schedules.py places their messages and builds the Schedule; the
V's turn (stages p - 1 and p, both on rank p - 1) hands over in memory.

    zb-v       Qi et al. 2024 ("Pipeline Parallelism with Controllable Memory"), section 6's order
    dualpipev  DeepSeek's DualPipe cut in half onto the V (deepseek-ai/DualPipe), its eight phases
"""

from __future__ import annotations

from mpformer.pipeline.actions import Op

Compute = tuple  # (op, microbatch, chunk[, True: overlapped with the next compute]), as in schedules.py
Orders = list[list[Compute]]


def zbv_orders(pp: int, m: int, vpp: int = 2) -> tuple[int, Orders]:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", section 6; the order
    PyTorch's ScheduleZBVZeroBubble also runs): two chunks per rank in a V, the backward split into BI
    and BW, at most 2p chunk activations per rank (p whole-stage micro-batches: 1F1B's peak). Rank r,
    over n = max(m, 2p - 1) micro-batches (those past m dropped):

        warm-up    F0 x (2(p-r) - 1); then F1 F0 x r; then F1 BI1 W1 x (p-r)
        steady     F0 BI0 W0 F1 BI1 W1 until every micro-batch has had both forwards (F0 only while
                   some remain)
        cool-down  BI0 BI1 x r; then BI0 W0 x (p-r); then the deferred W1's and W0's

    With equal passes a rank idles only in the fill and the drain (p=6, m=24: 0.034 of the step,
    ZB-H1 0.065); with T_B = 1.5, T_W = 0.5 about half of ZB-H1's too (0.065 against 0.122)."""
    n = max(m, 2 * pp - 1)
    return 2, [[x for x in _zbv_rank(pp, n, r) if x[1] < m] for r in range(pp)]


def _zbv_rank(pp: int, n: int, r: int) -> list[Compute]:
    order: list[Compute] = []
    nf, nb, nw = [0, 0], [0, 0], [0, 0]

    def f(c: int) -> None:
        order.append((Op.F, nf[c], c))
        nf[c] += 1

    def bi(c: int) -> None:
        order.append((Op.BI, nb[c], c))
        nb[c] += 1

    def w(c: int) -> None:
        order.append((Op.BW, nw[c], c))
        nw[c] += 1

    for _ in range(2 * (pp - r) - 1):
        f(0)
    for _ in range(r):
        f(1), f(0)
    for _ in range(pp - r):
        f(1), bi(1), w(1)
    while nf[1] < nf[0] or nf[0] < n:
        if nf[0] < n:
            f(0)
        bi(0), w(0), f(1), bi(1), w(1)
    for _ in range(r):
        bi(0), bi(1)
    for _ in range(pp - r):
        bi(0), w(0)
    while nw[1] < nb[1]:
        w(1)
    while nw[0] < nb[0]:
        w(0)
    return order


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
