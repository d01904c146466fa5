"""The auto-configurator inside pretrain: ``parallel=auto`` and the predicted step time of a run.

    torchrun --nproc_per_node=4 pretrain/pretrain_gpt.py parallel=auto [cluster=local-cpu] [parallel.tp=2]

The cluster is the preset (``cluster=NAME``; local-cpu by default on a CPU run) cut to the run's own
world: ``LOCAL_WORLD_SIZE`` devices per node (torchrun sets it; else the preset's, capped by the
world) and world / that many nodes. Every rank runs the same deterministic search, so the ranks agree
on the plan without a process group. Layout keys given on the command line (``parallel.tp=2``,
``train.micro_batch_size=4``) and ``autoconfig.fixed.*`` are pinned; the rest is searched.
``autoconfig.explain=true`` prints why, term by term (explain.py), under the chosen plan, and adds it
to the run's autoconfig.json, as tools/autoconfig.py does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from mpformer.autoconfig.candidates import NOT_SEARCHED, PINNABLE, Candidate, SearchResult
from mpformer.autoconfig.cluster import Cluster, load_cluster
from mpformer.autoconfig.cost import calibration
from mpformer.autoconfig.explain import Explanation, explain_search
from mpformer.autoconfig.memory import Workload
from mpformer.autoconfig.precision import allowed, check_precision, search_precisions
from mpformer.autoconfig.runtimes import mpformer_runtime
from mpformer.autoconfig.search import evaluate_plan, no_plan_error
from mpformer.core.composed import Composed
from mpformer.core.config import Config
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout


@dataclass
class Prediction:
    """What the cost model expects of the run, logged next to what it measures."""

    candidate: Candidate
    cluster: Cluster
    search: SearchResult | None = None  # set when parallel=auto chose the layout
    explanation: Explanation | None = None  # autoconfig.explain=true: why this plan (explain.py)

    @property
    def step_time_s(self) -> float:
        return self.candidate.time.iteration_s

    def summary(self) -> str:
        c, how = self.candidate, "chose" if self.search is not None else "predicts for"
        line = (f"auto-configurator {how} {c.overrides()}: {self.step_time_s:.3g} s/step, "
                f"{c.memory_bytes / 1e9:.2f} GB per device on {self.cluster.name} "
                f"({self.cluster.nodes} x {self.cluster.devices_per_node})")
        if self.search is not None:
            line += f"; {self.search.evaluated} candidates in {self.search.seconds:.1f} s"
        if self.explanation is not None:
            line += "\n" + self.explanation.text().rstrip("\n")
        return line

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster": self.cluster.name, "devices_per_node": self.cluster.devices_per_node,
            "nodes": self.cluster.nodes, "plan": self.candidate.plan(),
            "pp_partition": self.candidate.layout.pp_partition,
            "predicted": {"iteration_time_s": self.step_time_s,
                          "memory_gb_per_device": self.candidate.memory_bytes / 1e9,
                          "breakdown": {k: v for k, v in self.candidate.time.to_dict().items() if k != "params"}},
            "calibration": calibration(self.cluster).to_dict()}
        if self.search is not None:
            out |= {"candidates_evaluated": self.search.evaluated, "search_time_s": self.search.seconds,
                    "top": [{"plan": c.plan(), "iteration_time_s": c.time.iteration_s} for c in self.search.top],
                    "rejected": self.search.rejected}
        if self.explanation is not None:
            out["explain"] = self.explanation.to_dict()
        return out


def _device_kind(cfg: Config) -> str:
    from mpformer.parallel.device import resolve_device

    return resolve_device(cfg.train.device).kind


def run_cluster(name: str | None, world_size: int, device: str) -> Cluster:
    """The preset cut to this run: devices per node from torchrun's LOCAL_WORLD_SIZE."""
    if name is None:
        if device != "cpu":
            raise ConfigError("parallel=auto on GPUs needs the hardware to plan for: cluster=NAME (a preset in "
                              "configs/cluster, e.g. cluster=dgx-h100)")
        name = "local-cpu"
    c = load_cluster(name)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(world_size, c.devices_per_node)))
    if per_node < 1 or world_size % per_node:
        raise ConfigError(f"world size {world_size} is not a whole number of nodes of {per_node} devices")
    return replace(c, devices_per_node=per_node, nodes=world_size // per_node)


def workload(cfg: Config) -> Workload:
    t = cfg.train
    return Workload(t.global_batch_size, t.micro_batch_size, t.seq_length, t.precision,
                    fused_cross_entropy=t.fused_cross_entropy, cross_entropy_chunk=t.cross_entropy_chunk,
                    runtime=mpformer_runtime(t))


def pinned_fields(composed: Composed) -> dict[str, Any]:
    """autoconfig.fixed.* plus the layout keys (and micro-batch size) the command line sets."""
    cfg = composed.cfg
    pinned = cfg.autoconfig.fixed.pinned()
    for key in composed.overridden_keys("parallel"):
        if key in ("pp_split",):
            raise ConfigError(f"parallel.{key} cannot be combined with parallel=auto (the search splits the layers); "
                              f"pin parallel.pp or parallel.pp_partition instead, or drop parallel=auto")
        if key in PINNABLE and not (key == "dp" and cfg.parallel.dp == -1):
            pinned.setdefault(key, getattr(cfg.parallel, key))
    for key in NOT_SEARCHED:  # not searched: the plan is priced with the run's own value, from YAML or not
        value = getattr(cfg.parallel, key)
        if key != "pp_split" and value != getattr(ParallelLayout, key):
            pinned.setdefault(key, value)
    if "micro_batch_size" in composed.overridden_keys("train"):
        pinned.setdefault("micro_batch_size", cfg.train.micro_batch_size)
    return pinned


def choose_layout(cfg: Config, composed: Composed, world_size: int) -> Prediction:
    """parallel=auto: the best plan for ``cfg`` (its model, its pins from the command line)."""
    device = _device_kind(cfg)
    cluster = run_cluster(cfg.autoconfig.cluster, world_size, device)
    w, fixed = workload(cfg), pinned_fields(composed)
    precisions = allowed(cluster, cfg.autoconfig.precisions, w.precision)
    res, w = search_precisions(cfg.model, cluster, w, precisions, fixed=fixed, top_k=cfg.autoconfig.top_k,
                               device=device)
    if not res.top:
        raise no_plan_error(res, cluster)
    why = explain_search(res, cfg.model, cluster, w, fixed=fixed, device=device) if cfg.autoconfig.explain else None
    return Prediction(res.top[0], cluster, res, why)


def apply_plan(cfg: Config, composed: Composed, prediction: Prediction) -> Config:
    """``cfg`` with the chosen plan: every layout field the search decides (a pinned pp_partition
    stays) and train.micro_batch_size. A new config: the one that was validated is not rewritten."""
    best = prediction.candidate
    keep = set(NOT_SEARCHED) | ({"pp_partition"} if "pp_partition" in composed.overridden_keys("parallel") else set())
    chosen = {f.name: getattr(best.layout, f.name) for f in fields(ParallelLayout) if f.name not in keep}
    precision = best.precision or cfg.train.precision  # chosen among autoconfig.precisions, or the run's own
    return replace(cfg, parallel=replace(cfg.parallel, **chosen),
                   train=replace(cfg.train, micro_batch_size=best.micro_batch_size, precision=precision))


def predict(cfg: Config, layout: ParallelLayout, world_size: int) -> Prediction:
    """The cost model's step time for the layout the run uses (cfg.autoconfig.cluster names the hardware)."""
    device = _device_kind(cfg)
    cluster = run_cluster(cfg.autoconfig.cluster, world_size, device)
    check_precision(cluster, cfg.train.precision)
    return Prediction(evaluate_plan(cfg.model, layout, workload(cfg), cluster, device), cluster)
