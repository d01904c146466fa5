"""``mpformer-rehearse`` / ``tools/rehearse.py``: any rank of any layout, run on one CPU process as the GPU
it would run on, before a GPU is spent (rehearsal/).

    mpformer-rehearse model=llama3-8b parallel.tp=8 parallel.pp=4 parallel.dp=4 train.precision=bf16 \\
        train.seq_length=8192 train.global_batch_size=64 rehearse.device=h100-80gb rehearse.ranks=[0,31] \\
        rehearse.json=rehearsal.json

The same Hydra config and overrides as pretraining, plus ``rehearse.device`` (a GPU preset,
rehearsal/devices.py), ``rehearse.ranks`` (default: one rank of each distinct shape), ``rehearse.steps``
(default 1) and ``rehearse.json``. The world is the layout's: ``parallel.dp`` given, or a cluster's
(``cluster=NAME`` [``autoconfig.nodes=N``]). No data files: synthetic token ids. Each rank runs in a
process of its own (two at a time), which prints nothing; the table and the JSON come at the end.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from mpformer.cli.compose import compose_config
from mpformer.core.composed import Composed
from mpformer.core.config import Config
from mpformer.core.errors import ConfigError, check_output_file, user_errors_to_exit

PARALLEL_RANKS = 2  # rank processes at a time (this machine's cores)


def world_size_of(cfg: Config) -> int:
    """The rehearsed world: dp x tp x pp x cp with parallel.dp given, else the named cluster's devices."""
    p = cfg.parallel
    if p.dp not in (-1, None):
        return p.dp * p.tp * p.pp * p.cp
    if cfg.autoconfig.cluster is not None:
        from mpformer.autoconfig.cluster import load_cluster

        cluster = load_cluster(cfg.autoconfig.cluster)
        nodes = cfg.autoconfig.nodes or cluster.nodes
        return cluster.devices_per_node * nodes
    raise ConfigError("a rehearsal needs its world size: give parallel.dp=N (the world is dp*tp*pp*cp), or "
                      "cluster=NAME [autoconfig.nodes=N]")


def _rank_worker(args: list[str], world_size: int, rank: int, steps: int) -> dict:
    import torch

    from mpformer.rehearsal.rank import rehearse_rank

    torch.set_num_threads(1)
    return rehearse_rank(compose_config(args), world_size, rank, steps).to_dict()


def rehearse(composed: Composed, args: list[str]) -> dict:
    """Rehearse the ranks ``composed`` asks for; the report as the JSON holds it (rehearsal/report.py)."""
    import multiprocessing as mp

    from mpformer.rehearsal.devices import gpu_target
    from mpformer.rehearsal.report import check_ranks, default_ranks, with_formulas
    from mpformer.training.preflight import preflight_rehearsal

    cfg = composed.cfg
    r = cfg.rehearse
    device = gpu_target(r.device)
    if r.steps < 1:
        raise ConfigError(f"rehearse.steps={r.steps} must be >= 1")
    if r.json:
        check_output_file(r.json, "rehearse.json", (".json",))
    world = world_size_of(cfg)
    spec = preflight_rehearsal(composed, world)  # every check before a process starts: one line, at once
    ranks = list(r.ranks) if r.ranks else default_ranks(spec.layout)
    check_ranks(ranks, world)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(PARALLEL_RANKS, len(ranks)), maxtasksperchild=1) as pool:
        reports = pool.starmap(_rank_worker, [(args, world, rank, r.steps) for rank in ranks])
    for rep in reports:
        with_formulas(spec.cfg, spec.layout, rep)
    return {"device": device.to_dict(), "world_size": world, "layout": spec.layout.to_dict(),
            "elapsed_s": time.perf_counter() - t0, "ranks": reports}


def rehearse_plans(args: list[str], plans: list[list[str]], device: str) -> list[dict]:
    """The most loaded rank of each plan (``args`` with the plan's overrides) rehearsed on ``device``: one
    report per plan, with the memory model's figures beside it (autoconfig.rehearse)."""
    import multiprocessing as mp

    from mpformer.rehearsal.report import most_loaded_rank, with_formulas
    from mpformer.training.preflight import preflight_rehearsal

    jobs, specs = [], []
    for overrides in plans:
        plan_args = [*args, *overrides, f"rehearse.device={device}"]
        composed = compose_config(plan_args)
        world = world_size_of(composed.cfg)
        spec = preflight_rehearsal(composed, world)
        jobs.append((plan_args, world, most_loaded_rank(spec.cfg, spec.layout), 1))
        specs.append(spec)
    with mp.get_context("spawn").Pool(min(PARALLEL_RANKS, len(jobs)), maxtasksperchild=1) as pool:
        reports = pool.starmap(_rank_worker, jobs)
    for rep, spec in zip(reports, specs, strict=True):
        with_formulas(spec.cfg, spec.layout, rep)
    return reports


@user_errors_to_exit
def main(argv: list[str] | None = None) -> int:
    from mpformer.rehearsal.devices import gpu_target
    from mpformer.rehearsal.report import table

    args = sys.argv[1:] if argv is None else list(argv)
    composed = compose_config(args)
    out = rehearse(composed, args)
    print(table(out["ranks"], gpu_target(composed.cfg.rehearse.device)))
    print(f"{len(out['ranks'])} ranks of {out['world_size']} rehearsed in {out['elapsed_s']:.1f} s", flush=True)
    if composed.cfg.rehearse.json:
        Path(composed.cfg.rehearse.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
