"""Search the parallel layout: enumerate, reject with the runtime's own validate(), then by memory,
rank by predicted iteration time; return the top plans with breakdowns and why the rest failed.

Enumerated: tp (up to a node), pp, dp (what the world leaves), vpp and schedule, micro-batch size,
ZeRO stage, recompute, sequence parallelism (always on with tp > 1: same traffic, less memory),
cp when pinned. Any field can be pinned (``fixed``). Ranking uses the pipeline's closed form
(bubble (p-1)/(v m + p-1) of each stage's work); the best ``resimulate`` plans are then re-timed
with simulate.py on their actual schedules and re-ranked.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.cost import Breakdown, iteration_time
from mpformer.autoconfig.memory import Workload, plan_memory
from mpformer.core.config import FixedPlan
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout, validate
from mpformer.core.model_config import ModelConfig, divisors

# The plan: every ParallelLayout field but these, and the micro-batch size. pp_split is the user's,
# pp_partition is searched but reported beside the plan, grad_reduce_dtype is not a layout choice.
NOT_SEARCHED = ("pp_split", "grad_reduce_dtype")
PLAN_FIELDS = (*(f.name for f in fields(ParallelLayout) if f.name not in (*NOT_SEARCHED, "pp_partition")),
               "micro_batch_size")
assert set(PLAN_FIELDS) == {f.name for f in fields(FixedPlan)}, "autoconfig.fixed must pin exactly the plan fields"


@dataclass
class Candidate:
    layout: ParallelLayout
    micro_batch_size: int
    memory_bytes: float
    time: Breakdown

    def plan(self) -> dict[str, Any]:
        return {k: self.micro_batch_size if k == "micro_batch_size" else getattr(self.layout, k) for k in PLAN_FIELDS}

    def overrides(self) -> str:
        """The plan as pretrain's command-line overrides."""
        p = self.plan()
        parts = [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in p.items()
                 if k != "micro_batch_size"]
        if self.layout.pp_partition != "uniform":
            parts.append(f"parallel.pp_partition={self.layout.pp_partition}")
        return " ".join([*parts, f"train.micro_batch_size={p['micro_batch_size']}"])


@dataclass
class SearchResult:
    top: list[Candidate]
    feasible: list[Candidate]
    rejected: dict[str, dict[str, Any]] = field(default_factory=dict)  # class -> {"count", "example"}
    smallest: Candidate | None = None  # the least memory among valid plans (when none fits)
    evaluated: int = 0
    seconds: float = 0.0

    def count(self) -> None:
        """One more layout evaluated."""
        self.evaluated += 1

    def reject(self, cls: str, why: str) -> None:
        r = self.rejected.setdefault(cls, {"count": 0, "example": why})
        r["count"] += 1

    def add(self, c: Candidate) -> None:
        self.feasible.append(c)

    def offer_smallest(self, c: Candidate) -> None:
        """A plan that does not fit: kept if it needs the least memory so far (the error names it)."""
        if self.smallest is None or c.memory_bytes < self.smallest.memory_bytes:
            self.smallest = c

    def finished(self, top: list[Candidate], seconds: float) -> SearchResult:
        self.top, self.seconds = top, seconds
        return self


def search(model: ModelConfig, cluster: Cluster, workload: Workload, *, fixed: dict[str, Any] | None = None,
           top_k: int = 5, resimulate: int | None = None, device: str = "cuda") -> SearchResult:
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(PLAN_FIELDS))
    if unknown:
        raise ConfigError(f"autoconfig.fixed has unknown fields {unknown}; valid: {', '.join(PLAN_FIELDS)}")
    t0 = time.perf_counter()
    world, gbs = cluster.world_size, workload.global_batch_size
    result = SearchResult([], [])

    def options(name: str, values: list) -> list:
        return [fixed[name]] if name in fixed else values

    tps = options("tp", [t for t in divisors(cluster.devices_per_node) if model.num_attention_heads % t == 0])
    cps = options("cp", [1])
    for tp in tps:
        for cp in cps:
            pps = [p for p in divisors(world // (tp * cp)) if p <= model.num_layers]
            for pp in options("pp", pps):
                dp = world // (tp * cp * pp)
                if tp * cp * pp * dp != world or ("dp" in fixed and fixed["dp"] != dp):
                    result.reject("world size", f"tp={tp} cp={cp} pp={pp} leave dp={dp} of {world} devices")
                    continue
                _structure(model, cluster, workload, result, fixed, tp, cp, pp, dp, gbs, options, device)
    ranked = sorted(result.feasible, key=lambda c: c.time.iteration_s)
    best = ranked[:resimulate if resimulate is not None else top_k + 2]
    best = sorted((replace(c, time=_retime(model, c, workload, cluster)) for c in best),  # the real timeline
                  key=lambda c: c.time.iteration_s)
    return result.finished(best[:top_k], time.perf_counter() - t0)


def _retime(model: ModelConfig, c: Candidate, w: Workload, cluster: Cluster) -> Breakdown:
    return iteration_time(model, c.layout, _with_mbs(w, c.micro_batch_size), cluster,
                          params_per_rank=c.time.extra["params"], simulate_pipeline=True)


def _with_mbs(w: Workload, mbs: int) -> Workload:
    return replace(w, micro_batch_size=mbs)


def _structure(model: ModelConfig, cluster: Cluster, w: Workload, result: SearchResult, fixed: dict, tp: int,
               cp: int, pp: int, dp: int, gbs: int, options, device: str) -> None:
    per_dp = gbs // dp if gbs % dp == 0 else 0
    if not per_dp:
        result.reject("batch", f"global batch {gbs} does not split over dp={dp}")
        return
    schedules = ["1f1b"] if pp == 1 else ["1f1b", "interleaved", "zb-h1", "zb-h2"]
    for schedule in options("schedule", schedules):
        vpps = [1] if schedule != "interleaved" else [v for v in (2, 3, 4) if pp * v <= model.num_layers]
        for vpp in options("vpp", vpps):
            for mbs in options("micro_batch_size", [b for b in (1, 2, 4, 8) if per_dp % b == 0]):
                for sp in options("sequence_parallel", [tp > 1]):
                    stages = [0] if dp * cp == 1 else [0, 1, 2, 3] if pp == 1 else [0, 1]  # dp=1: all alike
                    for zero in options("zero", stages):
                        # Layers that do not split evenly go to stages balanced by compute (partition.py).
                        part = "uniform" if model.num_layers % (pp * vpp) == 0 else "balanced"
                        _recompute_choice(model, cluster, w, result, fixed, options, device,
                                          ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, vpp=vpp, schedule=schedule,
                                                         sequence_parallel=sp, zero=zero, pp_partition=part), mbs)


def _recompute_choice(model: ModelConfig, cluster: Cluster, w: Workload, result: SearchResult, fixed: dict,
                      options, device: str, base: ParallelLayout, mbs: int) -> None:
    """The cheapest recompute mode that fits (none < selective < full in time), unless pinned."""
    ww = _with_mbs(w, mbs)
    for rec in options("recompute", ["none", "selective", "full"]):
        L = ParallelLayout(**{**asdict(base), "recompute": rec})
        result.count()
        try:
            # A pinned cp > 1 is modelled although the runtime cannot run it yet (published layouts).
            validate(L, model, cluster.world_size, global_batch_size=w.global_batch_size, micro_batch_size=mbs,
                     seq_length=w.seq_length, check_implemented=fixed.get("cp", 1) == 1)
        except ConfigError as e:
            result.reject("invalid layout", str(e))
            return
        stages = plan_memory(model, L, ww, device=device)
        need = max(s.total for s in stages)
        params = max(s.params for s in stages)
        if need > cluster.memory_bytes:
            result.offer_smallest(Candidate(L, mbs, need, Breakdown(extra={"params": params})))
            result.reject("out of memory", f"{_short(L, mbs)} needs {need / 1e9:.1f} GB per device")
            continue
        b = iteration_time(model, L, ww, cluster, params_per_rank=params, simulate_pipeline=False)
        result.add(Candidate(L, mbs, need, b))
        return


def no_plan_error(res: SearchResult, cluster: Cluster) -> ConfigError:
    """The one-line reason nothing was returned: the smallest memory need and its plan, or why every
    layout was invalid."""
    if res.smallest is not None:
        s = res.smallest
        return ConfigError(f"no layout fits {cluster.name} x {cluster.nodes} node(s) ({cluster.memory_bytes / 1e9:.3g} "
                           f"GB per device): the smallest need is {s.memory_bytes / 1e9:.1f} GB per device, with "
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


def _short(L: ParallelLayout, mbs: int) -> str:
    return (f"dp={L.dp} tp={L.tp} pp={L.pp} cp={L.cp} vpp={L.vpp} {L.schedule} mbs={mbs} zero={L.zero} "
            f"recompute={L.recompute}" + (" sp" if L.sequence_parallel else ""))
