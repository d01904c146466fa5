"""The cost model against every published run in the repository, with the published layout pinned.

For each row of mpformer/autoconfig/published_runs.json (mpformer/autoconfig/published.py lists the
sources), the auto-configurator is run with every layout field the source states pinned (the search
picks the rest: e.g. Megatron-Core's micro-batch and recompute), and its prediction is printed beside
the published figure in that figure's own unit (iteration seconds, model TFLOP/s per GPU, or tokens/s
per GPU), with the signed error, the chosen unstated fields, predicted memory per device ("> 80" when
the memory model says the run that ran cannot fit: its time is then the fastest plan's, memory
aside), and the search time. Then the median |error| and the worst row, per source and over all, and
how many rows do not fit. The baseline is the publication itself.

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

from mpformer.autoconfig.published import case_error, predict_case, published_cases


def predict(case) -> dict:
    t0 = time.perf_counter()
    best, fits = predict_case(case)
    took = time.perf_counter() - t0
    row = {"source": case.source, "case": case.name, "search_s": took, "note": case.note, "fits": fits,
           "device_gb": case.cluster.memory_gb}
    if best is None:
        return {**row, "error": None, "why": "no plan even with memory aside"}
    unit, pred, pub = case_error(case, best)
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
        mem = f"{r['memory_gb']:.0f}" + ("" if r["fits"] else f" > {r['device_gb']:g}")
        table.append([r["case"], r["unit"], f"{r['predicted']:.4g}", f"{r['published']:.4g}", f"{r['error']:+.1%}",
                      mem, f"{r['search_s']:.1f}  {chosen}"])
    print(format_table(["row", "unit", "predicted", "published", "error", "GB/dev", "search s, chosen"], table))
    summary = []
    for source in [*dict.fromkeys(r["source"] for r in rows), "all"]:
        errs = [abs(r["error"]) for r in rows if r["error"] is not None and source in ("all", r["source"])]
        n_none = sum(not r["fits"] for r in rows if source in ("all", r["source"]))
        signed = [r["error"] for r in rows if r["error"] is not None and source in ("all", r["source"])]
        summary.append([source, len(errs), f"{statistics.median(errs):.1%}" if errs else "-",
                        f"{max(errs):.1%}" if errs else "-", f"{statistics.median(signed):+.1%}" if signed else "-",
                        n_none])
    print(format_table(["source", "rows", "median |error|", "worst |error|", "median signed", "do not fit"], summary))
    if args.json:
        write_json(args.json, {"benchmark": "published", "env": env, "results": rows})


if __name__ == "__main__":
    main()
