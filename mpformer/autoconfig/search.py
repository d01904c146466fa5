"""Search the parallel layout: enumerate, reject with the runtime's own validate(), then by memory,
rank by predicted iteration time; return the top plans with breakdowns and why the rest failed.

Enumerated: tp (up to a node), cp, pp, dp (what the world leaves), vpp and schedule, micro-batch
size, ZeRO stage, recompute, sequence parallelism (always on with tp > 1: same traffic, less memory).
Any field can be pinned (``fixed``). Recompute: the cheapest that fits, and for selective and full
the fewest layers per pipeline chunk that must recompute (``recompute_layers``, as Megatron-LM's
--recompute-num-layers) unless the mode is pinned.

Ranking (one estimate everywhere): every feasible plan gets the closed form of cost.py, whose
pipeline term (``pipeline_bound``) is a lower bound of the simulated timeline of its schedule (equal
to it for even stages). Plans are then simulated on their actual schedules in the order of their
bounds until the next bound is no better than the k-th best simulated time: a plan never simulated
cannot beat the ones returned (branch and bound), so the pre-ranking never drops a plan that full
simulation would rank first. Each candidate's ``time.extra["estimate"]`` says which it carries
("simulated", or "bound": at least that); the table, plan.json and the plot show that one number. On
a CPU host (ranks sharing cores) the timeline's processor sharing and calibration are no bound, so
every feasible plan is simulated (such hosts have few).

Context parallelism: cp in powers of two that leave each rank at least ``MIN_CP_TOKENS`` positions
(a pruning bound: on shorter sequences cp saves little activation memory, its attention blocks are
short to hide traffic behind, and dp or tp do the same work without that traffic; pin cp to go
below it), every cp kind of CP_KINDS (hybrid with each Ulysses degree that properly
divides cp); validate() drops what the model cannot run (Ulysses degrees must divide the heads per
tp rank). The kind changes only the attention's traffic and a few saved bytes, so per layout and
recompute mode the kinds are tried fastest first (by their exposed per-layer traffic) and the
first that fits is timed, as recompute modes are.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import replace
from typing import Any

from mpformer.autoconfig.candidates import NOT_SEARCHED, PINNABLE, Candidate, Pins, SearchResult, with_mbs
from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.cost import Breakdown, iteration_time
from mpformer.autoconfig.fit import recompute_choice
from mpformer.autoconfig.memory import Workload, plan_memory, rank_layers, stage_params
from mpformer.autoconfig.sharing import slowdowns
from mpformer.core.errors import ConfigError
from mpformer.core.layout import CP_KINDS, EP_DISPATCHERS, V_SCHEDULES, ParallelLayout, validate
from mpformer.core.model_config import ModelConfig, divisors
from mpformer.core.pipeline_plan import rank_ends, stage_counts, stage_index

MIN_CP_TOKENS = 2048  # the fewest positions per cp rank the search tries cp at (unless cp is pinned)


def search(model: ModelConfig, cluster: Cluster, workload: Workload, *, fixed: dict[str, Any] | None = None,
           top_k: int = 5, device: str = "cuda") -> SearchResult:
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(PINNABLE))
    if unknown:
        raise ConfigError(f"autoconfig.fixed has unknown fields {unknown}; valid: {', '.join(PINNABLE)}")
    if "pp_split" in fixed:
        raise ConfigError("autoconfig.fixed.pp_split cannot be pinned: the search splits the layers; pin pp or "
                          "pp_partition instead")
    t0 = time.perf_counter()
    world, gbs = cluster.world_size, workload.global_batch_size
    result = SearchResult([], [])

    options = Pins(fixed)

    tps = options("tp", [t for t in divisors(cluster.devices_per_node) if model.num_attention_heads % t == 0])
    for tp in tps:
        # cp attention has no dropout: a model with attention dropout trains at cp=1 (or cp pinned: explained)
        cps = cp_values(world // tp, workload.seq_length) if model.attention_dropout == 0 else [1]
        for cp in options("cp", cps):
            pps = [p for p in divisors(world // (tp * cp)) if p <= model.num_layers]
            for pp in options("pp", pps):
                dp = world // (tp * cp * pp)
                if tp * cp * pp * dp != world or ("dp" in fixed and fixed["dp"] != dp):
                    result.reject("world size", f"tp={tp} cp={cp} pp={pp} leave dp={dp} of {world} devices")
                    continue
                _structure(model, cluster, workload, result, fixed, tp, cp, pp, dp, gbs, options, device)
    top = _rank(model, cluster, workload, result, top_k, options, device)
    return result.finished(top, time.perf_counter() - t0)


def _rank(model: ModelConfig, cluster: Cluster, w: Workload, result: SearchResult, top_k: int, options: Pins,
          device: str) -> list[Candidate]:
    """Branch and bound. Each valid structure (every field but recompute) gets the closed form of its
    cheapest recompute (none, or the pinned mode): no plan of it can be faster. Structures are taken in
    that order; each yields its plan (memory, the recompute that fits) with its own closed form, a
    lower bound of its simulated timeline; plans are simulated in bound order. The search stops when
    the next bound, of a plan or of a structure, cannot enter the top k: what it never evaluated or
    simulated cannot beat what it returns. Plans without a pipeline are exact already. On a CPU host
    the closed form is no bound (processor sharing, calibration): every plan is evaluated and simulated."""
    if slowdowns(cluster) is not None:
        for bases, mbs in result.structures:
            recompute_choice(model, cluster, w, result, options, device, bases, mbs)
        done = [replace(c, time=_retime(model, c, w, cluster)) for c in result.feasible]
        for c in done:
            c.time.extra["estimate"] = "simulated"
        result.feasible = done
        return sorted(done, key=lambda c: c.time.iteration_s)[:top_k]
    order = sorted(((_structure_bound(model, cluster, w, bases, mbs, options), i)
                    for i, (bases, mbs) in enumerate(result.structures)))
    done: list[Candidate] = []
    waiting: list[tuple[float, int, Candidate]] = []  # (bound, tie-break, plan) not yet simulated

    def kth() -> float:
        return done[top_k - 1].time.iteration_s if len(done) >= top_k else math.inf

    nxt = 0
    while nxt < len(order) or waiting:
        struct_bound = order[nxt][0] if nxt < len(order) else math.inf
        if waiting and waiting[0][0] <= struct_bound:
            bound, _, c = heapq.heappop(waiting)
            if bound >= kth():
                break
            if c.layout.pp > 1:
                c.time = _retime(model, c, w, cluster)
            c.time.extra["estimate"] = "simulated"
            done = sorted([*done, c], key=lambda x: x.time.iteration_s)
            continue
        if struct_bound >= kth():
            break
        bases, mbs = result.structures[order[nxt][1]]
        nxt += 1
        before = len(result.feasible)
        recompute_choice(model, cluster, w, result, options, device, bases, mbs)
        for c in result.feasible[before:]:
            heapq.heappush(waiting, (c.time.iteration_s, id(c), c))
    result.pruned = len(order) - nxt
    return done[:top_k]


def _structure_bound(model: ModelConfig, cluster: Cluster, w: Workload, bases: list[ParallelLayout], mbs: int,
                     options: Pins) -> float:
    """The closed form of the structure's cheapest plan: its pinned recompute (or none), the fastest of
    its cp kinds, its most loaded stage's parameters; a lower bound of every plan it can yield."""
    ww = with_mbs(w, mbs)
    rec = options("recompute", ["none"])[0]
    k = options("recompute_layers", [None])[0] if rec != "none" else None
    best = math.inf
    for L in bases:
        L = replace(L, recompute=rec, recompute_layers=k)
        counts = stage_counts(model, L, w.seq_length)
        params = max(stage_params(model, L, sum(counts[stage_index(L, r, c)] for c in range(L.vpp)),
                                  *rank_ends(L, r), rank_layers(model, L, counts, r)) for r in range(L.pp))
        best = min(best, iteration_time(model, L, ww, cluster, params_per_rank=params,
                                        simulate_pipeline=False).iteration_s)
    return best


def cp_values(ranks: int, seq_length: int) -> list[int]:
    """cp degrees worth trying on ``ranks`` devices (the world over tp): 1, and powers of two that
    divide them and leave every rank two zigzag chunks of at least MIN_CP_TOKENS / 2 positions."""
    out, cp = [1], 2
    while cp <= ranks and seq_length // cp >= MIN_CP_TOKENS:
        if ranks % cp == 0 and seq_length % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return out


def cp_kinds(cp: int, fixed: dict[str, Any]) -> list[tuple[str, int]]:
    """(cp_kind, cp_ulysses) pairs to try at this cp: every kind of CP_KINDS, hybrid at each Ulysses
    degree strictly between 1 and cp that divides it; pinned fields narrow them (validate() explains
    a pinned pair that cannot run). At cp=1 the kind is moot: the default (or the pinned one)."""
    kinds = [fixed["cp_kind"]] if "cp_kind" in fixed else list(CP_KINDS)
    if fixed.get("cp_ulysses", 1) != 1 and "cp_kind" not in fixed:
        kinds = ["hybrid"]  # only hybrid has a Ulysses degree of its own
    if cp == 1:
        return [(kinds[0] if "cp_kind" in fixed else "ring", fixed.get("cp_ulysses", 1))]
    out = []
    for kind in kinds:
        degrees = [u for u in divisors(cp) if 1 < u < cp] if kind == "hybrid" else [1]
        if "cp_ulysses" in fixed or (not degrees and "cp_kind" in fixed):  # validate() says what is wrong
            degrees = [fixed.get("cp_ulysses", 1)]
        out += [(kind, u) for u in degrees]
    return out


def _retime(model: ModelConfig, c: Candidate, w: Workload, cluster: Cluster) -> Breakdown:
    return iteration_time(model, c.layout, with_mbs(w, c.micro_batch_size), cluster,
                          params_per_rank=c.time.extra["params"], simulate_pipeline=True)


V_SEARCH_MAX_PP = 16


def _structure(model: ModelConfig, cluster: Cluster, w: Workload, result: SearchResult, fixed: dict, tp: int,
               cp: int, pp: int, dp: int, gbs: int, options: Pins, device: str) -> None:
    per_dp = gbs // dp if gbs % dp == 0 else 0
    if not per_dp:
        result.reject("batch", f"global batch {gbs} does not split over dp={dp}")
        return
    rt = w.runtime
    # The V schedules (two chunks a rank: two layers at least) are tried up to 16 stages, as deep as
    # DeepSeek-V3 ran DualPipe: their timelines settle late (priced whole up to 8p micro-batches) and
    # compiling them grows as p^2; deeper, pin parallel.schedule to price one (bench_search.py).
    v_ok = 1 < pp <= V_SEARCH_MAX_PP and 2 * pp <= model.num_layers
    schedules = [s for s in (["1f1b"] if pp == 1 else ["1f1b", "interleaved", "zb-h1", "zb-h2",
                                                         *(V_SCHEDULES if v_ok else ())])
                 if rt.schedules is None or s in rt.schedules]
    kinds = cp_kinds(cp, fixed)
    for schedule in options("schedule", schedules):
        vpps = [2] if schedule in V_SCHEDULES else [1] if schedule != "interleaved" else \
            [v for v in (2, 3, 4) if pp * v <= model.num_layers]
        for vpp in options("vpp", vpps):
            for mbs in options("micro_batch_size", [b for b in (1, 2, 4, 8) if per_dp % b == 0]):
                for sp in options("sequence_parallel", [tp > 1]):
                    stages = [0] if dp * cp == 1 else [0, 1, 2, 3] if pp == 1 else [0, 1]  # dp=1: all alike
                    stages = [z for z in stages if rt.zero_stages is None or z in rt.zero_stages]
                    for zero, experts in itertools.product(options("zero", stages), expert_options(model, tp, dp, cp,
                                                                                                   options)):
                        # Layers that do not split evenly go to stages balanced by compute (partition.py).
                        part = "uniform" if model.num_layers % (pp * vpp) == 0 else "balanced"
                        base = ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, vpp=vpp, schedule=schedule,
                                              sequence_parallel=sp, zero=zero,
                                              pp_partition=fixed.get("pp_partition", part),
                                              **{**{k: fixed[k] for k in NOT_SEARCHED if k in fixed}, **experts})
                        valid = _valid_kinds(model, cluster, w, result, mbs,
                                             [replace(base, cp_kind=k, cp_ulysses=u) for k, u in kinds])
                        if valid:
                            result.structures.append((valid, mbs))


def expert_options(model: ModelConfig, tp: int, dp: int, cp: int, options: Pins) -> list[dict[str, Any]]:
    """A mixture of experts' expert-parallel choices, each its own structure (the memory and the time
    differ, not only the traffic): ep among the divisors of dp x cp that divide the experts, etp 1 or tp,
    and at ep > 1 each dispatcher; pinned fields as pinned. A dense model: none (the pins as given)."""
    if not model.num_experts:
        return [{}]
    eps = options("ep", [e for e in divisors(dp * cp) if model.num_experts % e == 0])
    etps = options("etp", sorted({1, tp}))
    out = []
    for ep, etp in itertools.product(eps, etps):
        for kind in options("ep_dispatcher", list(EP_DISPATCHERS) if ep > 1 else ["alltoall"]):
            out.append({"ep": ep, "etp": etp, "ep_dispatcher": kind})
    return out


def _valid_kinds(model: ModelConfig, cluster: Cluster, w: Workload, result: SearchResult, mbs: int,
                 bases: list[ParallelLayout]) -> list[ParallelLayout]:
    """The layouts of ``bases`` (alike but for the cp kind) that validate() accepts; the rest rejected."""
    def invalid(L: ParallelLayout) -> str | None:
        try:
            validate(L, model, cluster.world_size, global_batch_size=w.global_batch_size, micro_batch_size=mbs,
                     seq_length=w.seq_length)
        except ConfigError as e:
            result.count()
            result.reject("invalid layout", str(e))
            return str(e)
        return None

    # Every rule a ring layout must meet binds every other kind too (they add rules of their own):
    # one check rejects the whole batch of kinds for a reason none of them can fix.
    if len(bases) > 1 and invalid(replace(bases[0], cp_kind="ring", cp_ulysses=1)):
        return []
    return [L for L in bases if not invalid(L)]


def no_plan_error(res: SearchResult, cluster: Cluster) -> ConfigError:
    """The one-line reason nothing was returned: the smallest memory need and its plan, or why every
    layout was invalid."""
    if res.smallest is not None:
        s = res.smallest
        return ConfigError(f"no layout fits {cluster.name} x {cluster.nodes} node(s) ({cluster.memory_note()}): "
                           f"the smallest need is {s.memory_bytes / 1e9:.1f} GB per device, with "
                           f"{s.overrides()}")
    why = "; ".join(f"{k}: {v['count']} (e.g. {v['example']})" for k, v in res.rejected.items())
    return ConfigError(f"no valid layout for {cluster.world_size} devices: {why}")


def evaluate_plan(model: ModelConfig, layout: ParallelLayout, w: Workload, cluster: Cluster,
                  device: str = "cuda") -> Candidate:
    """One given layout (dp resolved) timed and sized as the search would: memory, and the iteration
    time with the pipeline simulated on its schedule."""
    stages = plan_memory(model, layout, w, device=device)
    params = max(s.params for s in stages)
    b = iteration_time(model, layout, w, cluster, params_per_rank=params, simulate_pipeline=True)
    b.extra["params"] = params
    return Candidate(layout, w.micro_batch_size, max(s.total for s in stages), b)
