"""What a pipeline rank holds in flight: the peak count of (micro-batch, chunk) units a schedule keeps
(or token slices of them), how many of them activation offload leaves on the device, and how many it
copies. Pure arithmetic on the schedules, shared by the memory model (memory.py), the cost model
(pipeline_cost.py) and the search."""

from __future__ import annotations

from functools import lru_cache

from mpformer.core.layout import SPLIT_BACKWARD, ParallelLayout


def inflight_closed_form(schedule: str, pp: int, microbatches: int, vpp: int, slices: int = 1
                         ) -> tuple[int, ...] | None:
    """Peak in-flight (micro-batch, chunk) units per rank of each generated schedule; equal to verify()
    on the schedules' own action lists for every valid micro-batch count (checked by the unit tests).
    With token slices a unit is a slice: 1F1B warms up with k - 1 more (pipeline/schedules.py)."""
    p, m, v, k = pp, microbatches, vpp, slices
    if k > 1:
        return {"1f1b": tuple(min(p - r - 1 + k, m * k) for r in range(p)), "gpipe": (m * k,) * p}.get(schedule)
    forms = {"1f1b": tuple(min(p - r, m) for r in range(p)), "gpipe": (m,) * p, "zb-h1": (min(p, m),) * p,
             "zb-h2": (min(2 * p - 1, m),) * p, "interleaved": tuple(min(v * p - r, v * m) for r in range(p)),
             # the V's two chunks a rank: ZB-V warms up to 2p units (1F1B's p micro-batches of whole
             # stages); DualPipeV's two directions hold one more
             "zb-v": tuple(min(2 * p, m + 1 + r, 2 * m) for r in range(p)), "dualpipev": (2 * p + 1,) * p}
    return forms.get(schedule)


@lru_cache(maxsize=4096)
def inflight(schedule: str, pp: int, microbatches: int, vpp: int, slices: int = 1) -> tuple[int, ...]:
    """Peak (micro-batch, chunk) activations each rank holds under the schedule (token slices: slices
    of them): the closed form (a generated schedule), else verify.py on the schedule's own action lists."""
    from mpformer.pipeline.schedules import build_schedule
    from mpformer.pipeline.verify import verify

    if pp == 1:
        return (1,)
    closed = inflight_closed_form(schedule, pp, microbatches, vpp, slices)
    if closed is not None:
        return closed
    return tuple(verify(build_schedule(schedule, pp, microbatches, vpp, slices=slices)).peak_inflight)


@lru_cache(maxsize=4096)
def weighted_peak(schedule: str, pp: int, microbatches: int, vpp: int, rank: int,
                  weights: tuple[float, ...]) -> float:
    """The most rank ``rank`` keeps in flight when its chunks' units weigh differently (``weights``:
    bytes a unit of each chunk keeps; a balanced or explicit split gives chunks unequal layer counts):
    the largest sum over its compute order, where ``inflight`` counts units. Rank 0 of Llama 3 405B,
    tp=8 pp=16 vpp=4 balanced, holds chunks of 1, 2, 2 and 2 layers: counting its 64 units as the
    walked chunk's 2 layers each was 13% over the rehearsed peak, and 35% under on the last rank
    (chunks of 2, 2, 2 and 1: the walked chunk is the 1)."""
    from mpformer.pipeline.actions import Op
    from mpformer.pipeline.schedules import compute_orders

    held = peak = 0.0
    for op, _, chunk in (x[:3] for x in compute_orders(schedule, pp, microbatches, vpp)[1][rank]):
        if op is Op.F:
            held += weights[chunk]
            peak = max(peak, held)
        elif op is Op.B or op is Op.BW:  # a split backward frees its unit after the weight pass
            held -= weights[chunk]
    return peak


def offloaded(L: ParallelLayout, peak: int, device: str = "cuda") -> tuple[int, bool]:
    """Activation offload (pipeline/offload.py): the units a rank with ``peak`` in flight keeps on the
    device, and whether some are copied out. ``all`` keeps one, ``auto`` that one and ``offload_keep``
    more (under full recompute what moves is each layer's kept input). The one is the unit the memory
    walk runs, which when some are copied out is itself a moved one: two of its layers on the device at
    a time (step_memory.walk's ``offloaded``). On a CPU host memory is the device's: no saving there.
    Split-backward schedules (zero-bubble, DualPipeV) are counted as if nothing moved, an upper bound:
    there a unit in flight is either waiting for its input-gradient pass (movable, unless that pass
    follows its forward at once, as on a last stage) or holds the weight pass's stash, which stays on
    the device (pipeline/offload.py); counting one unit held, as below, was 16% under the rehearsed
    peak on rank 0 of Llama 3 8B zb-h2 pp2 and 41% under on rank 1, which moved nothing."""
    if L.offload == "none" or device == "cpu" or L.schedule in SPLIT_BACKWARD:
        return peak, False
    keep = 0 if L.offload == "all" else L.offload_keep
    return (keep + 1, True) if peak > keep + 1 else (peak, False)


@lru_cache(maxsize=256)
def moved_per_stage(schedule: str, pp: int, microbatches: int, vpp: int, slices: int, mode: str,
                    keep: int = 1) -> tuple[int, ...]:
    """Units (micro-batches, or token slices) of each global stage whose activations activation
    offload moves in a step: pipeline/offload.py's choice on the generator's compute orders (what the
    engine runs, without building the messages)."""
    from mpformer.core.layout import V_SCHEDULES
    from mpformer.core.pipeline_plan import stage_of
    from mpformer.pipeline.offload import moved_units
    from mpformer.pipeline.schedules import compute_orders

    chunks, orders = compute_orders(schedule, pp, microbatches, vpp, slices)
    out = [0] * (pp * chunks)
    for r, order in enumerate(orders):
        for _, chunk in moved_units([x[:3] for x in order], mode, keep):
            out[stage_of(pp, r, chunk, schedule in V_SCHEDULES)] += 1
    return tuple(out)
