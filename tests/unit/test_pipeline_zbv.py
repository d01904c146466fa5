"""ZB-V (issue 17 part 2): the V placement in the IR, the generator, and its bubble and memory against
ZB-H1 and 1F1B on the simulator (Qi et al. 2024: ZB-V reaches at most ZB-H1's bubble with 1F1B's peak
activations when T_F = T_B = T_W)."""

from __future__ import annotations

import itertools

import pytest

from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.pipeline_plan import rank_ends, stage_plan
from mpformer.pipeline.actions import Action, Op, Schedule, ScheduleError, rank_chunk, stage_of
from mpformer.pipeline.schedules import build_schedule
from mpformer.pipeline.simulate import Costs, simulate
from mpformer.pipeline.verify import verify


def test_the_v_placement_and_its_inverse():
    for pp in (2, 3, 5):
        stages = [stage_of(pp, r, c, True) for c in (0, 1) for r in range(pp)]
        assert sorted(stages) == list(range(2 * pp))
        assert stage_of(pp, 0, 1, True) == 2 * pp - 1 and stage_of(pp, pp - 1, 1, True) == pp
        assert all(rank_chunk(pp, stage_of(pp, r, c, True), True) == (r, c) for r in range(pp) for c in (0, 1))
    with pytest.raises(ScheduleError, match="placement v needs vpp=2 and pp >= 2, got vpp=3"):
        Schedule(2, 3, 1, "x", ((), ()), "v")


def test_rank_zero_holds_both_ends_and_the_turn_has_no_message():
    model = ModelConfig(arch="llama", num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=256)
    L = ParallelLayout(pp=4, vpp=2, schedule="zb-v")
    plans = [stage_plan(model, L, r, 32) for r in range(4)]
    assert plans[0].chunk_layers == ((0,), (7,)) and plans[3].chunk_layers == ((3,), (4,))
    assert plans[0].has_embedding and plans[0].has_head and not plans[3].has_head
    assert rank_ends(L, 0) == (True, True) and rank_ends(L, 3) == (False, False)
    s = build_schedule("zb-v", 4, 8, 2)
    assert s.v and Schedule.from_text(s.to_text()) == s  # the header carries the placement
    turn = [a for a in s.actions[3] if a.op.is_comm and a.peer(4, True)[0] == 3]
    assert turn == []  # stages 3 and 4 hand over in memory on rank 3
    bad = list(s.actions[3])
    i = next(k for k, a in enumerate(bad) if a.op is Op.F and a.chunk == 0)
    bad.insert(i + 1, Action(3, Op.SEND_F, bad[i].microbatch, 0))
    with pytest.raises(ScheduleError, match="joins stages 3 and 4, which sit on this rank"):
        verify(Schedule(4, 2, 8, "zb-v", (*s.actions[:3], tuple(bad)), "v"))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 16), (6, 24), (8, 8), (8, 32)])
def test_bubble_at_most_zb_h1_with_one_f_one_b_peak(pp, m):
    """Equal costs: a ZB-V chunk is half a stage, so its F, BI and BW take half of ZB-H1's."""
    zbv = simulate(build_schedule("zb-v", pp, m, 2), Costs(f=0.5, b=0.5, w=0.5))
    h1 = simulate(build_schedule("zb-h1", pp, m), Costs(f=1.0, b=1.0, w=1.0))
    one = simulate(build_schedule("1f1b", pp, m), Costs(f=1.0, b=2.0, w=0.0))
    assert zbv.bubble_fraction <= h1.bubble_fraction + 1e-12
    # peak activations in layers: a ZB-V unit is half a stage; 1F1B's rank 0 holds p whole stages
    assert max(zbv.peak_inflight) / 2 <= max(one.peak_inflight) == min(pp, m)
    if (pp, m) == (6, 24):  # the case: ZB-H1 idles 0.065 of the step
        assert h1.bubble_fraction == pytest.approx(0.065, abs=5e-4) and zbv.bubble_fraction < 0.04
    for f, b, w in ((1.0, 1.5, 0.5), (1.0, 2.0, 1.0)):  # and with unequal passes: the order is not tuned to them
        v_ = simulate(build_schedule("zb-v", pp, m, 2), Costs(f=f / 2, b=b / 2, w=w / 2)).bubble_fraction
        assert v_ <= simulate(build_schedule("zb-h1", pp, m), Costs(f=f, b=b, w=w)).bubble_fraction + 1e-12


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 7), (4, 8), (6, 24), (8, 16)])
def test_dualpipev_phases_verify_and_match_the_published_bubble(pp, m):
    """DualPipeV's eight phases (v_orders.py): every (micro-batch, chunk) once forward and once
    backward, on the V; peak 2p + 1 chunk activations (the DualPipe README's PP + 1, PP = 2p stages);
    with T_F = T_B = T_W (per chunk: F = 1, full backward B = 2, W = 1) the idle time per rank is the
    README's (PP/2 - 1)(F&B + B - 3W): every rank when a pair takes F + B (no overlap gain), the worst
    rank when the overlapped pair is faster (F&B = 2.5)."""
    s = build_schedule("dualpipev", pp, m, 2)
    assert s.v and verify(s).peak_inflight == [2 * pp + 1] * pp
    assert Schedule.from_text(s.to_text()) == s and Schedule.from_csv(s.to_csv()) == s  # "&" marks a pair
    for r in range(pp):
        ops = [(a.op, a.chunk) for a in s.compute_actions(r)]
        assert ops[:2 * (pp - r - 1)] == [(Op.F, 0)] * (2 * (pp - r - 1))  # phase 1: the warm-up
        assert all(o is Op.BW for o, _ in ops[-(r + 1):])  # phase 8: the deferred weight passes
    for fb in (3.0, 2.5):
        idle = simulate(s, Costs(f=1.0, b=1.0, w=1.0, fb=fb)).idle
        want = (pp - 1) * (fb + 2.0 - 3 * 1.0)
        assert max(idle) == pytest.approx(want)
        if fb == 3.0:
            assert idle == pytest.approx([want] * pp)


def test_an_overlapped_pair_must_be_independent():
    s = build_schedule("dualpipev", 2, 4, 2)
    acts = list(s.actions[1])
    i = next(k for k, (a, b) in enumerate(itertools.pairwise(acts))  # rank 1's turn: F k.0 then F k.1
             if a.op is b.op is Op.F and (a.chunk, b.chunk) == (0, 1) and a.microbatch == b.microbatch)
    acts[i] = Action(1, Op.F, acts[i].microbatch, 0, True)
    with pytest.raises(ScheduleError, match=rf"overlaps F{acts[i].microbatch}.1, which needs its result"):
        verify(Schedule(2, 2, 4, "dualpipev", (s.actions[0], tuple(acts)), "v"))


def test_measured_costs_price_a_stage_with_split_and_full_backwards_by_its_split_passes():
    from mpformer.pipeline.trace import measured_costs

    events = [(Action(0, Op.F, 0, 0), 0.0, 1.0), (Action(0, Op.B, 0, 0), 1.0, 4.0),  # full B: 3 = BI + BW
              (Action(0, Op.BI, 1, 0), 4.0, 5.0), (Action(0, Op.BW, 1, 0), 5.0, 7.0),
              (Action(0, Op.F, 0, 1), 7.0, 9.0), (Action(0, Op.B, 0, 1), 9.0, 13.0),
              (Action(0, Op.SEND_F, 0, 0), 13.0, 14.0)]
    c = measured_costs(events, 4, 2, p2p=0.5, v=True)  # rank 0 holds stages 0 and 3 in the V
    assert (c.f, c.b, c.w, c.p2p) == ([1.0, 0.0, 0.0, 2.0], [1.0, 0.0, 0.0, 4.0], [2.0, 0.0, 0.0, 0.0], 0.5)


def test_a_v_link_carries_both_directions_and_each_keeps_its_order():
    """On a V every link carries activations and gradients both ways (chunk 0 down, chunk 1 back up);
    the verifier orders each direction of a link on its own, so a swap in either is caught."""
    s = build_schedule("zb-v", 2, 4, 2)
    kinds = {(a.op, a.peer(2, True)[0]) for a in s.actions[0] if a.op in (Op.SEND_F, Op.SEND_B)}
    back = {(a.op, a.peer(2, True)[0]) for a in s.actions[1] if a.op in (Op.SEND_F, Op.SEND_B)}
    assert kinds == {(Op.SEND_F, 1), (Op.SEND_B, 1)} and back == {(Op.SEND_F, 0), (Op.SEND_B, 0)}
    for rank in (0, 1):  # swap this rank's first two receives of one kind from the other rank
        acts = list(s.actions[rank])
        idx = [k for k, a in enumerate(acts) if a.op is Op.RECV_F][:2]
        acts[idx[0]], acts[idx[1]] = acts[idx[1]], acts[idx[0]]
        lists = list(s.actions)
        lists[rank] = tuple(acts)
        with pytest.raises(ScheduleError):
            verify(Schedule(2, 2, 4, "zb-v", tuple(lists), "v"))
