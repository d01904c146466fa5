"""A mixture of experts' dispatch and combine in the pipeline simulator (pipeline/simulate.py): exposed
after a compute alone, hidden behind the other half's compute in DualPipeV's overlapped pairs, and
drawn on its own lane of the Chrome trace. Oracle: the pricing rule written out by hand, and zb-v (the
same V placement without pairs) at the same costs."""

from __future__ import annotations

import itertools

import pytest

from mpformer.pipeline.actions import Action, Op
from mpformer.pipeline.schedules import build_schedule
from mpformer.pipeline.simulate import Costs, chrome_trace, simulate


def test_a_compute_alone_waits_for_its_exchanges_a_pair_hides_them():
    c = Costs(f=1.0, b=2.0, w=1.5, a2a_f=0.4, a2a_b=0.7)
    f, b, bi, bw = (Action(0, op, 0) for op in (Op.F, Op.B, Op.BI, Op.BW))
    assert c.duration(f, 1) == pytest.approx(1.4)
    assert c.duration(bi, 1) == pytest.approx(2.7)
    assert c.duration(b, 1) == pytest.approx(2.0 + 1.5 + 0.7)
    assert c.duration(bw, 1) == pytest.approx(1.5)  # the weight pass exchanges nothing
    assert c.pair(f, bi, 1) == pytest.approx(3.0)  # 1.1 of exchanges beside 3.0 of compute
    slow = Costs(f=1.0, b=2.0, a2a_f=2.5, a2a_b=2.0)
    assert slow.pair(f, bi, 1) == pytest.approx(4.5)  # the exchanges are now the longer stream
    assert Costs(f=1.0, b=2.0, a2a_f=0.4, fb=5.0).pair(f, bi, 1) == 5.0  # a measured pair wins


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 16)])
def test_dualpipev_pairs_hide_most_exchanges_zbv_shows_them(pp, m):
    """The step time each schedule gains from the same exchanges: zb-v all of them (at least the
    exchanges one rank does), DualPipeV at most the share outside its pairs (warm-up and cool-down)."""
    base = Costs(f=0.5, b=0.5, w=0.5)
    moe = Costs(f=0.5, b=0.5, w=0.5, a2a_f=0.25, a2a_b=0.25)
    per_rank = m * 2 * (0.25 + 0.25)  # every micro-batch, both chunks, forward and backward
    zbv, dual = build_schedule("zb-v", pp, m, 2), build_schedule("dualpipev", pp, m, 2)
    gain_zbv = simulate(zbv, moe).step_time - simulate(zbv, base).step_time
    gain_dual = simulate(dual, moe).step_time - simulate(dual, base).step_time
    unpaired = min(sum(1 for a in row if a.op in (Op.F, Op.B, Op.BI)) - 2 * sum(a.overlap for a in row)
                   for row in dual.actions)  # the computes of one rank that run alone
    assert gain_zbv >= per_rank - 1e-9
    assert gain_dual <= per_rank / 2
    assert gain_dual >= unpaired * 0.25 - 1e-9  # what runs alone still waits for its exchanges
    assert simulate(dual, moe).step_time < simulate(zbv, moe).step_time


def test_trace_draws_the_exchanges_beside_the_pair():
    s = build_schedule("dualpipev", 2, 8, 2)
    res = simulate(s, Costs(f=1.0, b=1.0, w=1.0, a2a_f=0.5, a2a_b=0.5))
    lane = [e for e in chrome_trace((t for row in res.timeline for t in row), 1.0, vpp=2,
                                    exchanges=res.exchanges)["traceEvents"] if e.get("tid") == 3 and e["ph"] == "X"]
    computes = sum(1 for row in s.actions for a in row if a.op in (Op.F, Op.B, Op.BI))
    assert len(lane) == computes  # one exchange segment per forward and input-gradient backward
    spans = {(t.action.rank, t.action): (t.start, t.end) for row in res.timeline for t in row}
    for row in res.timeline:  # in a pair, both exchanges lie inside the pair's time
        for t, u in itertools.pairwise(row):
            if t.action.overlap:
                for a in (t.action, u.action):
                    start, end = next((x, y) for b, x, y in res.exchanges if b == a)
                    assert spans[a.rank, t.action][0] - 1e-9 <= start and end <= spans[a.rank, u.action][1] + 1e-9


def test_exchanges_per_stage():
    """Each global stage's own exchanges (a stage of dense layers has none); a list of the wrong length
    is refused; equal lists time the schedule as the scalar does."""
    from mpformer.core.errors import ConfigError

    c = Costs(f=1.0, b=2.0, a2a_f=[0.0, 0.4, 0.8, 0.0], a2a_b=[0.1, 0.5, 0.9, 0.0])
    v = True  # a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    assert [c.exchange(Action(1, Op.F, 0, chunk), 2, v) for chunk in (0, 1)] == [0.4, 0.8]
    assert c.exchange(Action(0, Op.BI, 0, 1), 2, v) == 0.0 and c.exchange(Action(0, Op.B, 0, 0), 2, v) == 0.1
    assert c.pair(Action(1, Op.F, 0, 0), Action(1, Op.BI, 1, 1), 2, v) == pytest.approx(3.0)  # 1.3 beside 3.0
    with pytest.raises(ConfigError, match="a2a_f lists 3 values"):
        Costs(a2a_f=[0.1, 0.2, 0.3]).check(4)
    s = build_schedule("dualpipev", 2, 8, 2)
    same = simulate(s, Costs(f=1.0, b=1.0, w=1.0, a2a_f=[0.7] * 4, a2a_b=[0.5] * 4)).step_time
    assert same == pytest.approx(simulate(s, Costs(f=1.0, b=1.0, w=1.0, a2a_f=0.7, a2a_b=0.5)).step_time)
    dense_end = simulate(s, Costs(f=1.0, b=1.0, w=1.0, a2a_f=[0.7, 0.7, 0.7, 0.0], a2a_b=[0.5, 0.5, 0.5, 0.0]))
    assert dense_end.step_time <= same + 1e-12
