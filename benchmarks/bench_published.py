"""The cost model against every published run in the repository, with the published layout pinned.

For each row of mpformer/autoconfig/published_runs.json (Korthikanti et al. 2022, Llama 3 405B,
Megatron-Core's H100 weak scaling, torchtitan's Llama 3 H100 figures), the auto-configurator is run
with every layout field the source states pinned (the search picks the rest: e.g. Megatron-Core's
micro-batch and recompute), and its prediction is printed beside the published figure in that
figure's own unit (iteration seconds, model TFLOP/s per GPU, or tokens/s per GPU), with the signed
error, the chosen unstated fields, predicted memory per device, and the search time. Then the
median |error| and the worst row, per source and over all. The baseline is the publication itself.

    python benchmarks/bench_published.py [--source NAME] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

from mpformer.autoconfig.published import published_cases
from mpformer.autoconfig.search import search
from mpformer.cli.autoconfig import model_flops_per_step


def predict(case) -> dict:
    t0 = time.perf_counter()
    res = search(case.model, case.cluster, case.workload, fixed=case.fixed, top_k=1)
    took = time.perf_counter() - t0
    row = {"source": case.source, "case": case.name, "search_s": took, "note": case.note}
    if not res.top:
        reasons = sorted({r.split(":")[0] for r in (str(x) for x in res.rejected)})[:2]
        return {**row, "error": None, "why": "; ".join(reasons) or "no plan"}
    best = res.top[0]
    t, world, w = best.time.iteration_s, case.cluster.world_size, case.workload
    if case.iteration_time_s is not None:
        unit, pred, pub = "iteration s", t, case.iteration_time_s
    elif case.tflops_per_gpu is not None:
        flops = model_flops_per_step(case.model, w.global_batch_size, w.seq_length)
        unit, pred, pub = "TFLOP/s/GPU", flops / t / world / 1e12, case.tflops_per_gpu
    else:
        unit, pred, pub = "tokens/s/GPU", w.global_batch_size * w.seq_length / t / world, case.tokens_per_s_per_gpu
    chosen = {k: v for k, v in best.plan().items() if k not in case.fixed and k in
              ("micro_batch_size", "recompute", "vpp", "schedule", "zero")}
    return {**row, "unit": unit, "predicted": pred, "published": pub, "error": pred / pub - 1,
            "memory_gb": best.memory_bytes / 1e9, "chosen": chosen}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default=None, help="only this table (e.g. megatron_core_h100_weak_scaling)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    env = environment()
    cases = [c for c in published_cases() if args.source in (None, c.source)]
    if not cases:
        raise SystemExit(f"error: no published rows for --source {args.source!r}; valid: "
                         f"{', '.join(sorted({c.source for c in published_cases()}))}")
    rows = [predict(c) for c in cases]
    print(f"cpu: {env['cpu_model']} ({env['cpu_capability']}) | torch {env['torch']} | {len(rows)} published rows")
    table = []
    for r in rows:
        if r["error"] is None:
            table.append([r["case"], "-", "-", "-", "no plan: " + r["why"], "-", f"{r['search_s']:.1f}"])
            continue
        chosen = " ".join(f"{k}={v}" for k, v in r["chosen"].items())
        table.append([r["case"], r["unit"], f"{r['predicted']:.4g}", f"{r['published']:.4g}", f"{r['error']:+.1%}",
                      f"{r['memory_gb']:.0f}", f"{r['search_s']:.1f}  {chosen}"])
    print(format_table(["row", "unit", "predicted", "published", "error", "GB/dev", "search s, chosen"], table))
    summary = []
    for source in [*dict.fromkeys(r["source"] for r in rows), "all"]:
        errs = [abs(r["error"]) for r in rows if r["error"] is not None and source in ("all", r["source"])]
        n_none = sum(r["error"] is None for r in rows if source in ("all", r["source"]))
        signed = [r["error"] for r in rows if r["error"] is not None and source in ("all", r["source"])]
        summary.append([source, len(errs), f"{statistics.median(errs):.1%}" if errs else "-",
                        f"{max(errs):.1%}" if errs else "-", f"{statistics.median(signed):+.1%}" if signed else "-",
                        n_none])
    print(format_table(["source", "rows", "median |error|", "worst |error|", "median signed", "no plan"], summary))
    if args.json:
        write_json(args.json, {"benchmark": "published", "env": env, "results": rows})


if __name__ == "__main__":
    main()
