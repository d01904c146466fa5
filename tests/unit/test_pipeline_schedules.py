"""Schedule IR (text/CSV forms) and generators: orders, validation, and every schedule verifies."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import time

import pytest

from mpformer.core.errors import ConfigError
from mpformer.core.layout import V_SCHEDULES, check_args, min_microbatches
from mpformer.pipeline.actions import Action, Op, Schedule, ScheduleError, parse_token, repeat
from mpformer.pipeline.schedules import SCHEDULES, build_schedule
from mpformer.pipeline.verify import verify

CASES = [("gpipe", 3, 4, 1), ("1f1b", 4, 6, 1), ("interleaved", 2, 4, 3), ("zb-h1", 3, 5, 1), ("zb-h2", 2, 3, 1),
         ("zb-v", 3, 5, 2), ("dualpipev", 3, 7, 2)]


def computes(s: Schedule, rank: int) -> list[str]:
    return [a.token(s.vpp > 1) for a in s.compute_actions(rank)]


# ---- IR ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,pp,m,vpp", CASES)
def test_text_and_csv_round_trip(name, pp, m, vpp):
    s = build_schedule(name, pp, m, vpp)
    assert Schedule.from_text(s.to_text()) == s
    assert Schedule.from_csv(s.to_csv()) == s
    # Without the header the shape is inferred from the lists; only the name is lost.
    bare = Schedule.from_text(s.to_text().split("\n", 1)[1])
    assert (bare.pp, bare.vpp, bare.microbatches, bare.actions, bare.name) == (pp, vpp, m, s.actions, "custom")


def test_token_grammar():
    assert parse_token("F3", 0) == Action(0, Op.F, 3, 0)
    assert parse_token("BI12.1", 2) == Action(2, Op.BI, 12, 1)
    assert parse_token("BW0", 1) == Action(1, Op.BW, 0)
    assert parse_token("sF3.1", 1) == Action(1, Op.SEND_F, 3, 1)
    assert [parse_token(t, 0).op for t in ("rF0", "sB0", "rB0", "B0")] == [Op.RECV_F, Op.SEND_B, Op.RECV_B, Op.B]
    assert Action(1, Op.RECV_B, 3, 1).token() == "rB3.1" and Action(1, Op.RECV_B, 3).token(False) == "rB3"
    for bad in ("X3", "F", "F3.", "sf3", "F-1", "BI"):
        with pytest.raises(ScheduleError, match="cannot read action"):
            parse_token(bad, 0)


def test_hand_written_text_runs_and_reports_bad_lines():
    text = """
    # two stages, two microbatches, written by hand (1F1B)
    r0: F0 sF0 F1 sF1 rB0 B0 rB1 B1
    r1: rF0 F0 B0 sB0 rF1 F1 B1 sB1
    """
    s = Schedule.from_text(text)
    assert (s.pp, s.vpp, s.microbatches, s.name) == (2, 1, 2, "custom")
    assert verify(s).peak_inflight == [2, 1]
    with pytest.raises(ScheduleError, match="rank 1 is listed twice"):
        Schedule.from_text("r0: F0 B0\nr1: F0\nr1: B0")
    with pytest.raises(ScheduleError, match="missing \\[1\\]"):
        Schedule.from_text("# mpformer-schedule pp=2\nr0: F0 B0")
    with pytest.raises(ScheduleError, match="expected 'r<rank>: TOKEN"):
        Schedule.from_text("rank0 F0 B0")
    with pytest.raises(ScheduleError, match="CSV header"):
        Schedule.from_csv("a,b\n1,2")


def test_peer_and_message_mapping_interleaved():
    pp = 4  # rank 3 chunk 0 is stage 3; its forward output goes to stage 4 = rank 0 chunk 1
    send = Action(3, Op.SEND_F, 5, 0)
    assert send.stage(pp) == 3 and send.peer(pp) == (0, 1)
    assert Action(0, Op.RECV_F, 5, 1).message(pp) == send.message(pp) == ("F", 5, 3)
    assert Action(0, Op.SEND_B, 5, 1).peer(pp) == (3, 0)
    assert Action(0, Op.SEND_B, 5, 1).message(pp) == Action(3, Op.RECV_B, 5, 0).message(pp)


def test_repeat_offsets_microbatches():
    s = repeat(build_schedule("1f1b", 2, 2), 2)
    assert s.microbatches == 4 and computes(s, 1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    verify(s)


# ---- generator orders ----------------------------------------------------------------------------
def test_one_f_one_b_order():
    s = build_schedule("1f1b", 4, 6)
    assert computes(s, 0) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert computes(s, 3) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]


def test_gpipe_order():
    s = build_schedule("gpipe", 2, 3)
    assert computes(s, 0) == computes(s, 1) == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_interleaved_order_and_layout():
    s = build_schedule("interleaved", 2, 4, 2)
    # Forwards visit chunk 0 for microbatches 0,1 then chunk 1 for them, then 2,3 likewise.
    fwd = [t for t in computes(s, 0) if t.startswith("F")]
    assert fwd == ["F0.0", "F1.0", "F0.1", "F1.1", "F2.0", "F3.0", "F2.1", "F3.1"]
    bwd = [t for t in computes(s, 0) if t.startswith("B")]
    assert bwd == ["B0.1", "B1.1", "B0.0", "B1.0", "B2.1", "B3.1", "B2.0", "B3.0"]
    # Warmup (v-1)p + p-r-1 forwards (3 on rank 0, 2 on rank 1), then (F, B) pairs.
    assert computes(s, 0)[:5] == ["F0.0", "F1.0", "F0.1", "F1.1", "B0.1"]
    assert computes(s, 1)[:4] == ["F0.0", "F1.0", "F0.1", "B0.1"]


def test_zero_bubble_orders():
    h1 = build_schedule("zb-h1", 3, 4)
    # Step x on rank r: F x, BI x-(p-1-r), BW x-(p-1); the last rank runs F, BI, then deferred BW's.
    assert computes(h1, 2)[:6] == ["F0", "BI0", "F1", "BI1", "F2", "BI2"]
    assert computes(h1, 0) == ["F0", "F1", "F2", "BI0", "BW0", "F3", "BI1", "BW1", "BI2", "BW2", "BI3", "BW3"]
    h2 = build_schedule("zb-h2", 3, 5)
    assert computes(h2, 0)[:5] == ["F0", "F1", "F2", "F3", "F4"]  # 2p-1 warmup forwards
    assert all(op in (Op.F, Op.BI, Op.BW) or op.is_comm for acts in h2.actions for op in (a.op for a in acts))


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n not in V_SCHEDULES])  # a V needs pp >= 2
def test_pp1_has_no_communication(name):
    s = build_schedule(name, 1, 3, 1)
    assert all(not a.op.is_comm for a in s.actions[0])
    assert len(s.compute_actions(0)) == (6 if name in ("gpipe", "1f1b", "interleaved") else 9)


def test_sends_follow_their_compute_and_receives_precede_it():
    for name, pp, m, vpp in [*CASES, ("interleaved", 4, 8, 2), ("zb-h2", 4, 9, 1)]:
        s = build_schedule(name, pp, m, vpp)
        for acts in s.actions:
            seen: set[tuple[str, int, int]] = set()
            for a in acts:
                kind = {Op.SEND_F: "F", Op.SEND_B: "B"}.get(a.op)
                if kind:
                    assert (kind, a.microbatch, a.chunk) in seen, (name, a)
                if a.op in (Op.F, Op.B, Op.BI):
                    seen.add(("F" if a.op == Op.F else "B", a.microbatch, a.chunk))


# ---- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("args,match", [
    (("pipedream", 2, 4, 1), "unknown pipeline schedule 'pipedream'; valid: gpipe, 1f1b, interleaved"),
    (("interleaved", 4, 8, 1), "needs vpp >= 2 at pp=4"),
    (("interleaved", 4, 6, 2), "divisible by pp=4, got 6; valid: 4, 8, 12"),
    (("interleaved", 4, 2, 2), "needs microbatches >= 4"),
    (("interleaved", 1, 4, 2), "vpp=2 needs pp > 1; valid at pp=1: vpp=1"),
    (("1f1b", 4, 8, 2), "schedule 1f1b has no virtual stages"),
    (("zb-h1", 4, 3, 1), "schedule zb-h1 at pp=4 needs microbatches >= 4, got 3"),
    (("zb-h2", 4, 6, 1), "schedule zb-h2 at pp=4 needs microbatches >= 7, got 6"),
    (("zb-v", 4, 8, 1), "schedule zb-v runs two chunks per rank in a V: it needs vpp=2 and pp >= 2 .*valid: vpp=2"),
    (("zb-v", 1, 8, 2), "vpp=2 needs pp > 1"),
    (("zb-h1", 4, 8, 2), "schedule zb-h1 has no virtual stages .*valid: vpp=1, or schedule interleaved or zb-v"),
    (("dualpipev", 4, 7, 2), "schedule dualpipev at pp=4 needs microbatches >= 8, got 7"),
    (("gpipe", 0, 4, 1), "pp=0 must be an integer >= 1"),
    (("1f1b", 2, 0, 1), "microbatches=0 must be an integer >= 1"),
])
def test_bad_arguments_are_one_line_config_errors(args, match):
    with pytest.raises(ConfigError, match=match) as e:
        build_schedule(*args)
    assert "\n" not in str(e.value)


def test_minimums():
    assert [min_microbatches(n, 4) for n in SCHEDULES] == [1, 1, 4, 4, 7, 1, 8]
    build_schedule("1f1b", 4, 1)  # fewer microbatches than stages is legal for GPipe/1F1B (all warmup)
    build_schedule("gpipe", 8, 1)


# ---- property: everything the generators accept verifies ------------------------------------------
def _grid():
    for name, pp, m, vpp in itertools.product(SCHEDULES, range(1, 17), range(1, 65), range(1, 5)):
        try:
            check_args(name, pp, m, vpp)
        except ConfigError:
            continue
        yield name, pp, m, vpp


def test_sampled_grid_verifies():
    """A dense sample of pp <= 16, m <= 64, vpp <= 4 (the full grid is the slow test below)."""
    grid = list(_grid())
    rng = random.Random(0)
    small = [c for c in grid if c[1] <= 4 and c[2] <= 12]  # every small case
    sample = small + rng.sample([c for c in grid if c not in small], 60)
    t0 = time.perf_counter()
    for name, pp, m, vpp in sample:
        verify(SCHEDULES[name](pp, m, vpp))
    assert time.perf_counter() - t0 < 20


def _generate_and_verify(case: tuple[str, int, int, int]) -> str | None:
    name, pp, m, vpp = case
    try:
        verify(SCHEDULES[name](pp, m, vpp))
    except ScheduleError as e:
        return f"{case}: {e}"
    return None


def _landmark_grid():
    """Every case of pp <= 8 at every m <= 32 (at least 4 micro-batches a stage: fewer than the stages,
    the minimum, between, multiples of pp, the steady state), and for pp 9-16 and m up to 64 the
    micro-batch counts where a generator's phases change (the minimum and one above, pp and pp + 1,
    2pp and 2pp + 1, 4pp, 64): the grid's bugs sat at these boundaries, and its long cases (pp 16, m 64:
    2,700 of them, 70 s of the 80) repeat the steady state."""
    for case in _grid():
        name, pp, m, _vpp = case
        if pp <= 8 and m <= 32:
            yield case
            continue
        lo = min_microbatches(name, pp)
        if m in {lo, lo + 1, pp, pp + 1, 2 * pp, 2 * pp + 1, 4 * pp, 64}:
            yield case


@pytest.mark.slow
def test_landmark_grid_verifies():
    """The landmark grid (above), over the machine's cores (pure Python: processes)."""
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(4, os.cpu_count() or 1)) as pool:
        failures = [f for f in pool.imap_unordered(_generate_and_verify, _landmark_grid(), chunksize=16) if f]
    assert not failures, "\n".join(failures[:20])
