"""The pipeline term of the cost model: a schedule's simulated timeline, and its closed-form bound.

``pipeline_time`` times the schedule the engine would run (its own action lists: pipeline/timeline.py
compiles them once and re-times them for any costs; ranks sharing CPU cores go through sharing.py's
processor-sharing fixed point); ``pipeline_bound`` is the closed form the search ranks every plan by,
a lower bound of that timeline (tests/unit/test_pipeline_timeline.py checks it on every generated
schedule), so that branch and bound simulates only the plans that can still win (search.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.sharing import shared_step_time
from mpformer.core.layout import SPLIT_BACKWARD, V_SCHEDULES, ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.pipeline.actions import Schedule, repeat
from mpformer.pipeline.simulate import Costs
from mpformer.pipeline.timeline import CompiledTimeline, compile_schedule, compile_timeline

if TYPE_CHECKING:
    from mpformer.autoconfig.memory import Workload


@lru_cache(maxsize=64)
def _schedule(name: str, pp: int, microbatches: int, vpp: int, slices: int = 1) -> Schedule:
    from mpformer.pipeline.schedules import build_schedule

    return build_schedule(name, pp, microbatches, vpp, slices=slices)


@lru_cache(maxsize=64)
def _compiled(name: str, pp: int, microbatches: int, vpp: int, slices: int = 1) -> CompiledTimeline:
    """The schedule's timeline compiled from its generator's orders and message placements (the lists
    the engine runs are made of them; tests check the two agree on every generated schedule)."""
    return compile_schedule(name, pp, microbatches, vpp, slices)


@lru_cache(maxsize=64)
def _compiled_steps(name: str, pp: int, microbatches: int, vpp: int, slices: int, steps: int) -> CompiledTimeline:
    """``steps`` steps of the schedule back to back (actions.repeat), compiled."""
    return compile_timeline(repeat(_schedule(name, pp, microbatches, vpp, slices), steps))


def pipeline_time(schedule: str, pp: int, microbatches: int, vpp: int, costs: Costs,
                  dilation: Callable[[int], float] | None = None, blocking: bool = False, slices: int = 1,
                  back_to_back: bool = False) -> float:
    """simulate()'s step time of the schedule. Past p micro-batches (ZB-H2: its minimum, 2p - 1) every
    schedule here but the V ones (below) is in its steady state, where each further micro-batch adds the same time: the
    timelines at that many and p more micro-batches are simulated and extended linearly (tests check
    this against the full timeline), so a 64-stage pipeline of 512 micro-batches costs two small ones.

    ``dilation(k)``: how much slower compute runs while k ranks of the pipeline compute at once (ranks
    sharing cores); the timeline is then the processor-sharing fixed point of ``shared_step_time``.
    ``blocking``: each batched send/receive group blocks its rank until it completes (an engine
    without p2p overlap: Megatron-LM's and DeepSpeed's pipelines before MegaScale's change).
    ``slices``: token slices, ``costs`` then price one slice (one unit of the schedule).
    ``back_to_back``: the period of steps run with no barrier between them (train.overlap_validation:
    a rank starts the next step as soon as its own optimizer step is taken, the check of the step
    still in flight), the growth of the time from two to three steps, as simulate.steady_state_bubble
    takes it; a step's drain then overlaps the next one's fill where the schedule lets it (ZB-H2 and
    the V schedules, whose first rank finishes early; 1F1B's first rank finishes last, so not there)."""
    from mpformer.core.layout import min_microbatches
    from mpformer.pipeline.simulate import simulate

    def steps(mb: int, k: int) -> float:
        if not blocking and dilation is None:  # the same timeline, compiled once per schedule (timeline.py)
            compiled = _compiled(schedule, pp, mb, vpp, slices) if k == 1 else \
                _compiled_steps(schedule, pp, mb, vpp, slices, k)
            return compiled.step_time(costs)
        one = _schedule(schedule, pp, mb, vpp, slices)
        if k > 1:
            one = repeat(one, k)
        if dilation is not None:
            return shared_step_time(one, costs, dilation)
        return simulate(one, costs, verified=True, blocking=blocking).step_time

    def run(mb: int) -> float:
        return steps(mb, 3) - steps(mb, 2) if back_to_back else steps(mb, 1)

    lo = max(pp, min_microbatches(schedule, pp))  # ZB-H2 runs from 2p - 1 micro-batches
    hi, whole = lo + pp, lo + pp
    if schedule in V_SCHEDULES:
        # The V schedules settle late, into cycles whose length depends on the costs: timed whole up
        # to 8p micro-batches, beyond that extended from 4p and 6p (within 0.7% of the whole timeline
        # on random stage costs, p <= 8, at 8p and 16p; tests/unit/test_autoconfig_cost.py holds 1%)
        lo, hi, whole = 4 * pp, 6 * pp, 8 * pp
    if back_to_back:
        # A step's tail meets the next one's head: with uneven stages the period grows linearly in m
        # only from up to 7p micro-batches on (ZB-H2 on random stage costs, p <= 6): timed whole up
        # to 10p, beyond that extended from 8p and 10p.
        lo, hi, whole = 8 * pp, 10 * pp, 10 * pp
    if microbatches <= whole:
        return run(microbatches)
    t_lo, t_hi = run(lo), run(hi)
    return t_hi + (microbatches - hi) * (t_hi - t_lo) / (hi - lo)


def pipeline_bound(schedule: str, pp: int, microbatches: int, vpp: int, costs: Costs, blocking: bool = False,
                   slices: int = 1, back_to_back: bool = False) -> float:
    """A lower bound of simulate()'s step time for every generated schedule, in closed form (the
    search ranks every plan by it and simulates only those that can still win, search.py).

    Rank r holds global stages r, r + p, ... (one per chunk; in a V, r and 2p - 1 - r). It cannot start before the first
    micro-batch has come through the stages before it, fill_r = sum of F and p2p over stages < r; it
    then does all its work, m x its stages' F + B + W (blocking p2p: a transfer more each); and in
    the schedules whose B carries W (1F1B, GPipe, interleaved) its last action is a backward of its
    first chunk, after which the stages before it still run theirs, tail_r = sum of B and p2p over
    stages < r. T >= max_r fill_r + work_r + tail_r, which is the simulated time when stages are
    equal ((m + p - 1) slots of 1F1B, (p - 1) / v of interleaving's fill); the zero-bubble schedules
    may run W after that backward, so their tail is not counted. ``back_to_back`` (the period of
    steps with no barrier between them): each rank still does its work once per period, but the
    fill and the tail may overlap the steps beside it, so they are not counted.

    A mixture of experts' exchanges (``Costs.a2a_f`` / ``a2a_b``) lengthen every compute that runs
    alone, so they count as F and B time; in DualPipeV's overlapped pairs they may hide entirely
    behind the other half's compute (``Costs.pair``), so there they are left out (a lower bound)."""
    exposed = schedule != "dualpipev"  # the only schedule with overlapped pairs (actions.py)
    f = [costs._at("f", s) + (costs._at("a2a_f", s) if exposed else 0.0) for s in range(pp * vpp)]
    b = [costs._at("b", s) + (costs._at("a2a_b", s) if exposed else 0.0) for s in range(pp * vpp)]
    w = [costs._at("w", s) for s in range(pp * vpp)]
    hop = costs.p2p if pp > 1 else 0.0
    microbatches *= slices  # token slices: the units flow as micro-batches do, ``costs`` price one
    # blocking: every (micro-batch, chunk) but the one whose transfers lie on the fill and tail waits
    # for at least one transfer of its own
    # (DualPipeV's overlapped pairs wait for their two inputs at once: not counted for it)
    extra = hop * (microbatches - 1) * vpp if blocking and pp > 1 and schedule != "dualpipev" else 0.0
    best = 0.0
    for r in range(pp):
        mine = (r, 2 * pp - 1 - r) if schedule in V_SCHEDULES else range(r, pp * vpp, pp)
        work = microbatches * sum(f[s] + b[s] + w[s] for s in mine) + extra
        fill = 0.0 if back_to_back else sum(f[:r]) + r * hop
        tail = 0.0 if schedule in SPLIT_BACKWARD or back_to_back else sum(b[:r]) + r * hop
        best = max(best, fill + work + tail)
    return best


@lru_cache(maxsize=64)
def _pair_counts(schedule: str, pp: int, microbatches: int, vpp: int, slices: int
                 ) -> tuple[dict[tuple[tuple[str, int], tuple[str, int]], int], ...]:
    """Per rank: how many overlapped pairs of each ((op, global stage), (op, global stage)) its
    compute order holds (from the generator's orders, as timeline.compile_schedule reads them)."""
    from mpformer.pipeline.actions import stage_of
    from mpformer.pipeline.schedules import _paired, compute_orders

    _, orders = compute_orders(schedule, pp, microbatches, vpp, slices)
    v = schedule in V_SCHEDULES
    out = []
    for r, order in enumerate(orders):
        counts: dict[tuple[tuple[str, int], tuple[str, int]], int] = {}
        for x, y in itertools.pairwise(order):
            if _paired(x):
                key = ((x[0].value, stage_of(pp, r, x[2], v)), (y[0].value, stage_of(pp, r, y[2], v)))
                counts[key] = counts.get(key, 0) + 1
        out.append(counts)
    return tuple(out)


def hidden_exchanges(schedule: str, pp: int, microbatches: int, vpp: int, costs: Costs, slices: int = 1
                     ) -> list[float]:
    """Per rank, the expert exchanges (Costs.a2a_f / a2a_b) its overlapped pairs run beside compute in
    one step: a pair of computes c1, c2 with exchanges x1, x2 takes max(c1 + c2, x1 + x2) against
    c1 + x1 + c2 + x2 alone, so it hides min(x1 + x2, c1 + c2). Zero but for DualPipeV's pairs."""
    if schedule != "dualpipev" or pp == 1:
        return [0.0] * pp
    from mpformer.pipeline.actions import Op

    def parts(op: str, s: int) -> tuple[float, float]:  # (compute, exchange) of one action alone
        o = Op(op)
        if o is Op.BW:
            return costs._at("w", s), 0.0
        c = costs._at("f" if o is Op.F else "b", s) + (costs._at("w", s) if o is Op.B else 0.0)
        return c, costs._at("a2a_f" if o is Op.F else "a2a_b", s)

    out = []
    for counts in _pair_counts(schedule, pp, microbatches, vpp, slices):
        hidden = 0.0
        for (a, b), n in counts.items():
            (c1, x1), (c2, x2) = parts(*a), parts(*b)
            hidden += n * min(x1 + x2, c1 + c2)
        out.append(hidden)
    return out


def offload_exposed(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, counts: list[int],
                    fs: list[float], bs: list[float]) -> tuple[list[float], list[float]]:
    """Activation offload (pipeline/offload.py): a moved unit's saved activations go out during its own
    forward and come back a layer ahead of its backward (its last layer during the compute before),
    each over the host link beside the compute: a copy out hides behind the forward, a copy back behind
    the backward (the input-gradient pass, which reads them). The part of a copy longer than the
    compute it hides behind is added to that compute, spread over the stage's units by the share of
    them that move (inflight.py's moved_per_stage: offload's own choice on the schedule; under
    offload=all every unit whose backward does not follow its forward at once, so not the last
    stage's under 1F1B; under offload=auto only those beyond the budget of offload_keep)."""
    from mpformer.autoconfig.inflight import moved_per_stage
    from mpformer.autoconfig.layer_memory import layer_bytes

    k = L.pp_token_slices
    per_layer = layer_bytes(m, L, w.seq_length // k, w.micro_batch_size, w.precision).saved
    micro = w.global_batch_size // (w.micro_batch_size * L.dp)
    moved = moved_per_stage(L.schedule, L.pp, micro, L.vpp, k, L.offload, L.offload_keep)
    fs, bs = list(fs), list(bs)
    for s_, n in enumerate(moved):
        copy, share = counts[s_] * per_layer / c.host_bandwidth, n / (micro * k)
        fs[s_], bs[s_] = fs[s_] + share * max(0.0, copy - fs[s_]), bs[s_] + share * max(0.0, copy - bs[s_])
    return fs, bs
