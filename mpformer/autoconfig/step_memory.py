"""The peak of one pipeline stage's step, walked through the points where it can occur.

memory.py's plan_memory gives each stage its persistent model state, what each micro-batch keeps
for backward, and what each point of the step adds; this module walks the last micro-batch through
those points, as the runtime runs them, and takes the largest total:

    head forward     every saved activation of the micro-batches in flight, the head's chunk
    head backward    the head's gradients cast to the compute dtype, its gradient bucket
    layer i backward (i from the last) the saved activations of layers 0..i, layer i's recomputed
                     ones and its backward's own, the gradient buckets (stage 2-3: filling and in
                     flight, as the engine's pool lends them), the gathered units (stage 3)
    embedding        its weight gradient, the buckets
    end of backward  stages 0-1: every bucket's reduction in flight (the activations are gone)

Gradient buckets follow the engine (optim/engine.py): stages 0-2 pack the parameters last first into
buckets of ``bucket_mb`` of fp32 elements, stage 3 has one per unit (the embedding, each layer's
units, the head); a bucket launches once the backward of the unit holding its last parameter is
over. Stages 0-1 keep every reduction in flight until the step's end. Stage 2 keeps ``in_flight``
and draws its buffers from a pool (the smallest idle buffer that fits, at most ``in_flight`` idle).
Stage 3 takes a unit's buffer when its backward forms its first gradient, after waiting for the
oldest reductions in flight until they and it hold at most ``budget`` elements; its pool keeps idle
buffers up to ``budget`` elements (a larger one is freed), so at a unit both the moment before the
take (the reductions still in flight) and after it (the unit's own buffer) are walked. Both pools are
emptied when the micro-batch's reductions are drained. On CPU (gloo) a reduce-scatter also holds
receive buffers of (n-1)/n of its input (parallel/pairwise.py); NCCL writes in place.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Unit:
    """What backward meets, in order: a part of the stage with its parameters and activations."""

    name: str
    params: Sequence[int]  # element counts of its parameters, in model order
    saved: float  # activation bytes this unit keeps for backward (one micro-batch)
    backward: float = 0.0  # activation bytes live above ``saved`` in its backward (recompute, the backward's own)
    extra: float = 0.0  # other bytes live in its backward: gradients before the engine takes them, the
    # ZeRO-3 units gathered (itself and the one prefetched), another implementation's gradient buffers
    layer: Hashable | None = None  # the layer it is (a part of); None: the head, the embedding
    expert: Sequence[int] = ()  # of ``params``, the routed experts': they reduce over the expert-data group


@dataclass(frozen=True)
class ReductionSpec:
    """How the stage's gradients are bucketed and reduced: the settings of the engine's Reduction and
    buckets (optim/engine.py) that the memory walk reads, not the runtime object."""

    stage: int  # ZeRO stage
    dp: int  # ranks the gradients are reduced over (dp x cp)
    grad_bytes: int  # bytes per element of the full gradient buffers (fp32; stage 3: the parameter dtype)
    reduce_bytes: int  # bytes per element of the collective
    bucket_elems: float  # stages 0-2: the bucket cap in elements
    in_flight: int  # stage 2: reductions in flight beside the bucket filling
    pairwise: bool  # gloo on CPU: receive buffers of (n-1)/n of each reduce-scatter input
    edp: int = 0  # ranks the experts' gradients are reduced over (dp x cp / ep; 0: read as ``dp``)
    expert_pairwise: bool = False  # ``pairwise`` for the expert-data group
    pooled: bool = True  # stage 3: mpformer's buffers (walked here); False: the units' ``extra`` holds them
    budget: float = float("inf")  # stage 3: elements of the reductions in flight with a new buffer, and idle


@dataclass
class _Pool:
    """The engine's GradPool: lends the smallest idle buffer that fits, keeps at most ``limit`` idle and at
    most ``limit_bytes`` of them (a larger one is not kept), the smallest dropped first."""

    limit: int | None
    limit_bytes: float = float("inf")
    idle: list[float] = field(default_factory=list)

    def take(self, size: float) -> float:
        fits = [b for b in self.idle if b >= size]
        if not fits:
            return size
        self.idle.remove(min(fits))
        return min(fits)

    def give(self, size: float) -> None:
        if size > self.limit_bytes:
            return
        self.idle.append(size)
        while self.idle and ((self.limit is not None and len(self.idle) > self.limit)
                             or sum(self.idle) > self.limit_bytes):
            self.idle.remove(min(self.idle))


@dataclass(frozen=True)
class BucketSpan:
    """A gradient bucket of the walk: its size and the units (backward order) its buffer is live over."""

    elems: float
    first: int  # the unit (backward order) whose gradients reach it first: its buffer is taken then
    last: int  # the unit whose backward completes it: it launches then
    expert: bool = False  # the routed experts' (the engine buckets each mesh view apart)


def buckets(units: Sequence[Unit], red: ReductionSpec) -> list[BucketSpan]:
    """The engine's buckets in launch order: stage 3 one per unit; stages 0-2 the parameters packed
    last first (core/buffers.py plan_buckets: a bucket closes before the parameter that would pass
    the cap; a larger parameter gets one of its own). A bucket holds one mesh view's parameters: the
    routed experts' (``Unit.expert``) are packed apart from the rest, as the engine does."""
    if red.stage == 3:
        out = []
        for k, u in enumerate(units):
            e = float(sum(u.expert))
            out += [BucketSpan(float(sum(u.params)) - e, k, k)] + ([BucketSpan(e, k, k, True)] if e else [])
        return out
    out: list[BucketSpan] = []
    open_: dict[bool, list[float]] = {False: [0.0, 0, 0], True: [0.0, 0, 0]}  # per view: size, first, last
    for k, u in enumerate(units):
        experts = list(u.expert)
        for n in reversed(u.params):
            expert = n in experts
            if expert:
                experts.remove(n)
            b = open_[expert]
            if b[0] and b[0] + n > red.bucket_elems:
                out.append(BucketSpan(b[0], b[1], b[2], expert))
                b[0] = 0.0
            if not b[0]:
                b[1] = k
            b[0], b[2] = b[0] + n, k
    out += [BucketSpan(b[0], b[1], b[2], expert) for expert, b in open_.items() if b[0]]
    return sorted(out, key=lambda bk: bk.last)


def comm_bytes(elems: float, red: ReductionSpec, expert: bool = False) -> float:
    """What one reduction in flight holds besides its input buffer: its output shard (stages 1-3), the
    receive buffers of gloo's pairwise reduce-scatter, and a copy in the collective's dtype when it
    differs from the buffer's; over a group of one rank, nothing (the engine divides in place: the
    experts' when ep = dp x cp). ``expert``: a bucket of the routed experts (the expert-data group)."""
    dp, pairwise = (red.edp or red.dp, red.expert_pairwise) if expert else (red.dp, red.pairwise)
    if dp == 1:
        return 0.0
    shard = elems * red.reduce_bytes / dp if red.stage > 0 else 0.0
    recv = elems * red.reduce_bytes * (dp - 1) / dp if pairwise and red.stage > 0 else 0.0
    cast = elems * red.reduce_bytes if red.reduce_bytes != red.grad_bytes else 0.0
    return shard + recv + cast


@dataclass(frozen=True)
class Peak:
    live: float  # bytes
    activations: float  # of which activations (saved, recomputed, the backward's own)
    where: str


def walk(units: Sequence[Unit], red: ReductionSpec, *, state: float, kept: float, head_forward: float,
         micro: int = 1, offloaded: bool = False) -> Peak:
    """The stage's peak and where it occurs, in the last of ``micro`` micro-batches of a step. ``units``
    in backward order (the head first, the embedding last); ``state``: the persistent bytes; ``kept``:
    activation bytes live throughout (the other micro-batches in flight, the pipeline's inputs and
    outputs); ``head_forward``: what the end of this micro-batch's forward adds (the head's chunk, the
    gathered head). With gradient accumulation at stages 2-3 the pool still holds the buffers the
    previous micro-batch gave back (emptied only at the step's end).

    ``offloaded``: this micro-batch's activations go to host memory as its forward runs and come back a
    layer ahead of its backward (pipeline/offload.py): at any point only two layers' saved activations
    are on the device (at the forward's end the last, whose copy out is in flight, and the head's; in
    the backward the layer back-propagated and the one read ahead).

    ``kept`` adds to every point but the end of the backward (its activations are gone), so the walk
    runs once per stage shape and ``kept`` is added after: the search walks every stage of thousands
    of plans, most of whose stages have the same shape."""
    key = (tuple((u.name, tuple(u.params), u.saved, u.backward, u.extra, tuple(u.expert)) for u in units), red,
           state, head_forward, micro, offloaded)
    hit = _WALKS.get(key)
    if hit is None:
        if len(_WALKS) > 200_000:
            _WALKS.clear()
        hit = _WALKS[key] = _walk(units, red, state, head_forward, micro, offloaded)
    inner, end = hit
    peak = Peak(inner.live + kept, inner.activations + kept, inner.where)
    return end if end is not None and end.live > peak.live else peak


_WALKS: dict[tuple, tuple[Peak, Peak | None]] = {}


def _walk(units: Sequence[Unit], red: ReductionSpec, state: float, head_forward: float, micro: int,
          offloaded: bool = False) -> tuple[Peak, Peak | None]:
    """walk() without ``kept``: the largest point that includes it, and the end of the backward."""
    pool = _Pool(red.in_flight, float("inf")) if red.stage < 3 else _Pool(None, red.budget * red.grad_bytes)
    if micro > 1 and red.stage >= 2 and red.pooled:
        _backward(units, red, pool, state, offloaded)
    idle = sum(pool.idle)
    saved = _resident(units, offloaded)[0]
    head = Peak(state + saved + head_forward + idle, saved, "head forward" if head_forward else "forward")
    back, end = _backward(units, red, pool, state, offloaded)
    return (back if back.live > head.live else head), end


def _resident(units: Sequence[Unit], offloaded: bool) -> list[float]:
    """Per unit (backward order), the micro-batch's saved activations on the device when its backward
    runs: all of its own and the units' after it, or, offloaded, those of the first two units from it
    that save any (a layer's ZeRO-3 parts save with their first)."""
    after = [0.0] * (len(units) + 1)
    if not offloaded:
        for k in range(len(units) - 1, -1, -1):
            after[k] = after[k + 1] + units[k].saved
        return after
    first = second = 0.0  # the saved of the next two saving units from k on
    for k in range(len(units) - 1, -1, -1):
        if units[k].saved:
            first, second = units[k].saved, first
        after[k] = first + second
    return after


def _backward(units: Sequence[Unit], red: ReductionSpec, pool: _Pool, state: float, offloaded: bool = False
              ) -> tuple[Peak, Peak | None]:
    """One micro-batch's backward: the largest total at any unit (without ``kept``), and at its end
    (stages 0-1, whose reductions all stay in flight until the step's end; None at stages 2-3).
    ``pool``: as it was before, left as after."""
    # Suffix sums of the saved activations and the buckets indexed by the unit that opens and closes
    # them: the walk is linear in the units (the search walks every stage of thousands of plans).
    after = _resident(units, offloaded)
    peak = Peak(0.0, 0.0, "")
    plan, pooled = buckets(units, red), red.stage >= 2 and red.pooled
    opens: dict[int, list[int]] = {}
    closes: dict[int, list[int]] = {}
    for j, bk in enumerate(plan):
        opens.setdefault(bk.first, []).append(j)
        closes.setdefault(bk.last, []).append(j)
    filling: dict[int, float] = {}  # bucket -> its buffer's bytes (stages 2-3)
    in_flight: list[tuple[int, float]] = []  # (bucket, its buffer's bytes; 0 for stages 0-1's own)
    comm = buffers_in_flight = elems_in_flight = 0.0

    def complete_oldest() -> None:
        nonlocal comm, buffers_in_flight, elems_in_flight
        i, size = in_flight.pop(0)
        comm -= comm_bytes(plan[i].elems, red, plan[i].expert)
        buffers_in_flight -= size
        elems_in_flight -= plan[i].elems
        pool.give(size)

    def at(k: int, u: Unit) -> None:
        nonlocal peak
        buffers = sum(filling.values()) + buffers_in_flight + sum(pool.idle)
        act = after[k] + u.backward
        live = state + act + u.extra + buffers + comm
        if live > peak.live:
            peak = Peak(live, act, f"{u.name} backward")

    for k, u in enumerate(units):
        if pooled:
            taking = opens.get(k, [])
            if red.stage == 3 and taking:
                at(k, u)  # before its buffer is taken: the reductions still in flight
                for j in taking:
                    while in_flight and elems_in_flight + plan[j].elems > red.budget:
                        complete_oldest()
            for j in taking:
                filling[j] = pool.take(plan[j].elems * red.grad_bytes)
        at(k, u)
        if red.stage >= 2 and not red.pooled:
            continue
        for j in closes.get(k, ()):
            comm += comm_bytes(plan[j].elems, red, plan[j].expert)
            size = filling.pop(j, 0.0)
            in_flight.append((j, size))
            buffers_in_flight += size
            elems_in_flight += plan[j].elems
            while pooled and red.stage == 2 and len(in_flight) > red.in_flight:
                complete_oldest()
    while pooled and in_flight:  # the micro-batch's last launch drains them into the pool
        complete_oldest()
    end = Peak(state + comm, 0.0, "end of backward") if red.stage < 2 else None
    return peak, end
