"""``mpformer-autoconfig`` / ``tools/autoconfig.py``: the fastest layout that fits, and why.

    tools/autoconfig.py model=llama3-8b cluster=dgx-h100 autoconfig.nodes=4 train.global_batch_size=512 \\
        train.seq_length=4096 [train.precision=bf16] [autoconfig.fixed.tp=8 ...] [autoconfig.top_k=5] \\
        [autoconfig.output=plan.json] [autoconfig.plot=plans.png] [autoconfig.explain=true]

Every key is the pretraining config's own (composed and checked the same way): ``model=``, ``train.*``,
``cluster=`` (a preset in configs/cluster/, short for ``autoconfig.cluster=``; default local-cpu) and
``autoconfig.*``. On a GPU cluster the most loaded rank of each printed plan is rehearsed on its GPU
first (``autoconfig.rehearse``, on by default there; rehearsal/): a plan whose rehearsed peak exceeds the
device's usable memory (the preset's total less the CUDA context, NCCL's buffers and the allocator's
reserve) is dropped, and the table shows predicted beside rehearsed memory.
The output JSON (``autoconfig.output``) has ``plan``, ``predicted``, ``top``,
``candidates_evaluated`` and ``search_time_s``; next to it ``<stem>.parallel.yaml`` holds the plan as a
Hydra parallel config and the overrides line to pass to pretrain is printed. ``autoconfig.explain=true``
prints after the table the chosen plan's time term by term against the runner-up and against the plan a
person picks first (autoconfig/explain.py), and adds it to the JSON as ``explain``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mpformer.core.config import check_training_config
from mpformer.core.errors import PLOT_SUFFIXES, ConfigError, check_output_file, user_errors_to_exit
from mpformer.core.model_config import model_flops_per_step


def _predicted(c, model, world: int, w) -> dict[str, Any]:
    t = c.time.iteration_s
    rehearsed = None if c.rehearsed is None else {**c.rehearsed, "peak_gb": c.rehearsed["peak_bytes"] / 1e9}
    return {"iteration_time_s": t, "memory_gb_per_device": c.memory_bytes / 1e9, "rehearsed": rehearsed,
            "model_tflops_per_device": model_flops_per_step(model, w.global_batch_size, w.seq_length) / t / world
            / 1e12, "breakdown": {k: v for k, v in c.time.to_dict().items() if k != "params"}}


@user_errors_to_exit
def main(argv: Sequence[str] | None = None) -> int:
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.explain import explain_search
    from mpformer.autoconfig.memory import Workload
    from mpformer.autoconfig.precision import allowed, search_precisions
    from mpformer.autoconfig.runtimes import mpformer_runtime
    from mpformer.autoconfig.search import no_plan_error
    from mpformer.cli.compose import compose_config

    args = list(sys.argv[1:] if argv is None else argv)
    cfg = compose_config(args).cfg
    cfg.model.validate()
    check_training_config(cfg)  # the train-section rules pretraining applies (precision, sequence, batch)
    t, ac = cfg.train, cfg.autoconfig
    if ac.top_k < 1:
        raise ConfigError(f"autoconfig.top_k={ac.top_k} must be >= 1 (plans to print)")
    if ac.output:
        check_output_file(ac.output, "autoconfig.output")
    if ac.plot:
        check_output_file(ac.plot, "autoconfig.plot", PLOT_SUFFIXES)
    cluster = load_cluster(ac.cluster or "local-cpu", ac.nodes)
    w = Workload(t.global_batch_size, t.micro_batch_size, t.seq_length, t.precision, runtime=mpformer_runtime(t))
    device = "cpu" if cluster.cores else "cuda"
    fixed = ac.fixed.pinned()
    precisions = allowed(cluster, ac.precisions, t.precision)
    res, w = search_precisions(cfg.model, cluster, w, precisions, fixed=fixed, top_k=ac.top_k, device=device)
    if not res.top:
        raise no_plan_error(res, cluster)
    dropped = _rehearse(res, cluster, args, ac.rehearse)
    _print(res, cfg.model, cluster, w)
    explanation = explain_search(res, cfg.model, cluster, w, fixed=fixed, device=device) if ac.explain else None
    if explanation is not None:
        print(explanation.text(width=_width()), end="")
    best = res.top[0]
    payload = {"plan": best.plan(), "precision": w.precision,
               "predicted": _predicted(best, cfg.model, cluster.world_size, w),
               "top": [{"plan": c.plan(), "predicted": _predicted(c, cfg.model, cluster.world_size, w)}
                       for c in res.top],
               "candidates_evaluated": res.evaluated, "structures_pruned": res.pruned, "search_time_s": res.seconds,
               "rejected": res.rejected, "cluster": cluster.name, "nodes": cluster.nodes,
               "usable_gb_per_device": cluster.usable_bytes / 1e9, "dropped_by_rehearsal": dropped}
    if explanation is not None:
        payload["explain"] = explanation.to_dict()
    print(f"pretrain with: {best.overrides()}")
    if ac.output:
        out = Path(ac.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1))
        yaml = out.with_suffix("").with_suffix(".parallel.yaml") if out.suffix else Path(f"{out}.parallel.yaml")
        plan = {k: v for k, v in best.plan().items() if k != "micro_batch_size"}
        plan["pp_partition"] = best.layout.pp_partition
        yaml.write_text("# written by tools/autoconfig.py; train.micro_batch_size=" f"{best.micro_batch_size}\n"
                        + "".join(f"{k}: {_yaml_value(v)}\n" for k, v in plan.items()))
        print(f"wrote {out} and {yaml}")
    if ac.plot:
        _plot(res, Path(ac.plot))
    return 0


def _rehearse(res, cluster, args: list[str], wanted: bool | None) -> list[dict[str, Any]]:
    """Rehearse each top plan's most loaded rank on the cluster's GPU; drop those that do not fit. Returns
    the dropped plans (plan, predicted and rehearsed GB)."""
    from mpformer.cli.rehearse import rehearse_plans
    from mpformer.rehearsal.devices import DEVICES, gpu_of_cluster

    gpu = gpu_of_cluster(cluster)
    if wanted is False or (wanted is None and gpu is None):
        return []
    if gpu is None:
        known = sorted({g.cluster for g in DEVICES.values()})
        raise ConfigError(f"autoconfig.rehearse=true needs a GPU the rehearsal knows; cluster {cluster.name} is not "
                          f"one of {known}")
    print(f"rehearsing the most loaded rank of {len(res.top)} plan(s) on {gpu.name} ...", flush=True)
    reports = rehearse_plans(args, [c.overrides().split() for c in res.top], gpu.name)
    kept, dropped = [], []
    for c, rep in zip(res.top, reports, strict=True):
        c.rehearsed = {"rank": rep["rank"], "peak_bytes": rep["peak_bytes"], "device": gpu.name,
                       "usable_bytes": cluster.usable_bytes, "peak_where": rep["peak_where"]}
        if rep["peak_bytes"] <= cluster.usable_bytes:
            kept.append(c)
        else:
            dropped.append({"plan": c.plan(), "predicted_gb": c.memory_bytes / 1e9,
                            "rehearsed_gb": rep["peak_bytes"] / 1e9, "rank": rep["rank"]})
            print(f"dropped {c.overrides()}: rank {rep['rank']} rehearsed at {rep['peak_bytes'] / 1e9:.1f} GB, above "
                  f"{cluster.usable_bytes / 1e9:.1f} GB usable (predicted {c.memory_bytes / 1e9:.1f})")
    if not kept:
        raise ConfigError(f"no plan of the top {len(res.top)} fits when rehearsed on {gpu.name} "
                          f"({cluster.memory_note()}); raise autoconfig.top_k or add nodes")
    res.top = kept
    return dropped


def _print(res, model, cluster, w) -> None:
    from rich.console import Console
    from rich.table import Table

    pruned = f", {res.pruned} more pruned by their bound" if res.pruned else ""
    rehearsed = any(c.rehearsed for c in res.top)
    table = Table(title=f"{len(res.feasible)} feasible of {res.evaluated} evaluated{pruned} on {cluster.name} x "
                        f"{cluster.nodes} ({res.seconds:.1f} s)")
    experts = model.num_experts > 0  # ep, etp and the dispatcher, and the exchanges' wait, as their own columns
    for col in ("dp", "tp", "pp", "cp", "cp kind", "vpp", "schedule", "mbs", "zero", "recompute", "offload", "sp",
                *(["ep/etp/dispatch"] if experts else []),
                "iter s", "GB/dev", *(["rehearsed GB"] if rehearsed else []), "TFLOP/s/dev", "compute", "tp comm",
                "cp comm", *(["ep comm"] if experts else []), "bubble", "dp comm"):
        table.add_column(col, justify="right")
    for c in res.top:
        p, b = c.plan(), c.time
        pred = _predicted(c, model, cluster.world_size, w)
        sp = "y" if p["sequence_parallel"] else "n"
        etp = c.layout.tp if c.layout.etp is None else c.layout.etp
        table.add_row(*map(str, (p["dp"], p["tp"], p["pp"], p["cp"], _cp_kind(p), p["vpp"], p["schedule"],
                                 p["micro_batch_size"], p["zero"], p["recompute"], _offload(p), sp)),
                      *([f"{c.layout.ep}/{etp}/{c.layout.ep_dispatcher}"] if experts else []),
                      f"{b.iteration_s:.3g}", f"{c.memory_bytes / 1e9:.1f}",
                      *([f"{c.rehearsed['peak_bytes'] / 1e9:.1f}"] if rehearsed else []),
                      f"{pred['model_tflops_per_device']:.0f}",
                      f"{b.compute_s:.3g}", f"{b.tp_comm_s:.3g}", f"{b.cp_comm_s:.3g}",
                      *([f"{b.ep_comm_s:.3g}"] if experts else []), f"{b.pp_bubble_s:.3g}",
                      f"{b.dp_comm_exposed_s:.3g}")
    Console(width=_width()).print(table)
    print(f"memory: {cluster.memory_note()}" + (" (rehearsed: the most loaded rank of each plan)" if rehearsed else ""))
    for cls, r in res.rejected.items():
        print(f"rejected {r['count']} as {cls}, e.g. {r['example']}")


def _yaml_value(v: Any) -> str:
    """A plan value as YAML writes it (None is null: recompute_layers unset recomputes every layer)."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _width() -> int:
    from rich.console import Console

    return max(160, Console().width)


def _offload(p: dict) -> str:
    """offload=auto with its budget (units kept on the device before copying out)."""
    return f"auto {p['offload_keep']}" if p["offload"] == "auto" else p["offload"]


def _cp_kind(plan: dict[str, Any]) -> str:
    """The cp kind as the table shows it: '-' without cp, hybrid with its Ulysses degree."""
    if plan["cp"] == 1:
        return "-"
    return f"hybrid u={plan['cp_ulysses']}" if plan["cp_kind"] == "hybrid" else plan["cp_kind"]


def _plot(res, path: Path) -> None:
    """Predicted time against memory of every feasible plan, each at the one estimate the search holds
    for it (the table's and plan.json's): its simulated timeline, or for a plan the search did not
    need to simulate its closed form, a lower bound no better than the plans it returned (hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for simulated, style in ((False, {"facecolors": "none", "edgecolors": "tab:blue", "alpha": 0.5,
                                      "label": "feasible, lower bound (not simulated)"}),
                             (True, {"color": "tab:blue", "alpha": 0.8, "label": "feasible, simulated"})):
        pts = [c for c in res.feasible if (c.time.extra.get("estimate") == "simulated") == simulated]
        if pts:
            ax.scatter([c.memory_bytes / 1e9 for c in pts], [c.time.iteration_s for c in pts], s=10, **style)
    best = res.top[0]
    ax.scatter([best.memory_bytes / 1e9], [best.time.iteration_s], color="red", s=30, label="chosen")
    ax.set_xlabel("memory per device (GB)")
    ax.set_ylabel("predicted iteration time (s)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

