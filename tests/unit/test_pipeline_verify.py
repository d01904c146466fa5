"""The verifier rejects hand-broken schedules with one line naming the rank, the action and the cause."""

from __future__ import annotations

import itertools

import pytest

from mpformer.pipeline.actions import Action, Op, Schedule, ScheduleError
from mpformer.pipeline.schedules import build_schedule
from mpformer.pipeline.verify import execute, verify

# A correct 1F1B for two ranks and two microbatches, written by hand; each test breaks one thing.
GOOD = """
r0: F0 sF0 F1 sF1 rB0 B0 rB1 B1
r1: rF0 F0 B0 sB0 rF1 F1 B1 sB1
"""


def broken(text: str) -> Schedule:
    return Schedule.from_text(text)


def rejects(text: str, *fragments: str) -> str:
    with pytest.raises(ScheduleError) as e:
        verify(broken(text))
    msg = str(e.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_good_schedule_verifies():
    res = verify(broken(GOOD))
    assert res.peak_inflight == [2, 1] and res.num_actions == 16


def test_missing_receive():
    rejects(GOOD.replace("rF1 F1", "F1"), "rank 1 action F1 needs rF1 before it")


def test_missing_send_is_a_missing_action():
    rejects(GOOD.replace("F1 sF1", "F1"), "rank 0 is missing action sF1")


def test_swapped_sends_deadlock():
    # Rank 0 sends microbatch 1 before 0 (separate groups), rank 1 receives 0 first: under blocking
    # p2p each waits for the other forever.
    msg = rejects("r0: F0 F1 sF1 F2 sF0 sF2 rB0 B0 rB1 B1 rB2 B2\n"
                  "r1: rF0 F0 B0 sB0 rF1 F1 B1 sB1 rF2 F2 B2 sB2",
                  "deadlock: rank 0 action sF1 waits for rank 1 to post rF1, but rank 1 is blocked at action rF0")
    assert "blocked ranks: 0, 1" in msg


def test_swapped_sends_inside_one_group_are_an_order_mismatch():
    # Same group on both sides, so nobody blocks; but NCCL would hand microbatch 1's tensor to rF0.
    rejects("r0: F0 F1 sF1 sF0 rB0 B0 rB1 B1\nr1: rF0 rF1 F0 B0 sB0 F1 B1 sB1",
            "rank 1 action rF0 is receive #1 from rank 0", "send #1 of rank 0 to rank 1 is sF1")


def test_duplicated_forward():
    rejects(GOOD.replace("r0: F0 sF0 F1", "r0: F0 sF0 F0 F1"), "rank 0 action F0 is a duplicate")


def test_weight_grad_before_input_grad():
    text = "r0: F0 sF0 rB0 BW0 BI0\nr1: rF0 F0 BI0 sB0 BW0"
    rejects(text, "rank 0 action BW0 needs BI0 before it")
    rejects("r0: F0 sF0 rB0 BI0\nr1: rF0 F0 BI0 sB0 BW0", "rank 0 is missing action BW0")


def test_backward_before_forward_and_mixed_backwards():
    rejects("r0: B0 F0", "rank 0 action B0 needs F0 before it")
    rejects("r0: F0 B0 BI0 BW0", "mixes B with BI/BW")


def test_range_and_neighbour_errors():
    rejects("# mpformer-schedule pp=1 vpp=1 microbatches=1\nr0: F0 B0 F1 B1", "out of range")
    rejects("r0: F0 sF0 B0", "rank 0 action sF0 on stage 0 has no neighbour stage 1")
    rejects("# mpformer-schedule pp=1 vpp=2\nr0: F0.0 F0.1 B0.1 B0.0", "vpp=2 needs pp > 1")


def test_unknown_rank_in_list():
    s = Schedule(2, 1, 1, "x", ((Action(1, Op.F, 0),), ()))
    with pytest.raises(ScheduleError, match="rank 1 action F0 is in rank 0's list"):
        verify(s)


def test_peak_inflight_counts_until_weight_gradients():
    assert verify(build_schedule("gpipe", 3, 5)).peak_inflight == [5, 5, 5]
    assert verify(build_schedule("1f1b", 4, 8)).peak_inflight == [4, 3, 2, 1]
    assert verify(build_schedule("zb-h1", 4, 8)).peak_inflight == [4, 4, 4, 4]  # BW frees, not BI
    assert verify(build_schedule("zb-h2", 4, 8)).peak_inflight == [7, 7, 7, 7]
    # Interleaved counts chunk activations: v*p on rank 0 = p stages' worth of layers, like 1F1B.
    assert verify(build_schedule("interleaved", 4, 8, 2)).peak_inflight == [8, 7, 6, 5]


def test_blocking_and_overlapped_execution_agree_on_order():
    s = build_schedule("interleaved", 2, 4, 2)
    for blocking in (True, False):
        timeline = execute(s, lambda a: 1.0 if a.op == Op.F else 2.0, blocking=blocking)
        for row in timeline:
            computes = [t for t in row if not t.action.op.is_comm]
            assert all(x.end <= y.start for x, y in itertools.pairwise(computes))


def test_overlapped_execution_reports_a_missing_peer():
    with pytest.raises(ScheduleError, match="never completes"):
        execute(broken("r0: F0 sF0 rB0 B0\nr1: rF0 F0 B0"), lambda a: 1.0, blocking=False)
