"""How long the auto-configurator's search takes on large clusters, against simulating every plan.

    python benchmarks/bench_search.py [--rounds 3] [--no-exhaustive] [--json out.json]

Cases (issue 16, part 5): a 1T GPT (128 layers, h 25600, 160 heads, V 51200, s 2048) over 3,072
A100s (global batch 3072), unpinned; Llama 3 405B over 16,384 H100s (global batch 2048 x 8192
tokens), unpinned; and the README's example (llama3-8b on 4 DGX H100 nodes). Each search ranks every
feasible plan by its closed form and simulates, in that order, only those that can still enter the top
k (search.py). The baseline, in the same run, evaluates every structure the search enumerated
(memory, recompute) and simulates every feasible plan: it must choose the same plan, which the table
checks. Times are the median of the rounds
(the machine drifts), each in a fresh process, as a user's run of tools/autoconfig.py is: nothing
cached (schedules, layer times) from an earlier round.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

from mpformer.autoconfig.candidates import Pins, SearchResult
from mpformer.autoconfig.cluster import load_cluster
from mpformer.autoconfig.fit import recompute_choice
from mpformer.autoconfig.memory import Workload
from mpformer.autoconfig.published import LLAMA3, _gpt, _llama3
from mpformer.autoconfig.search import _retime, search
from mpformer.core.model_config import ModelConfig

TARGETS = {"1T GPT / 3072 A100": 5.0, "405B Llama 3 / 16384 H100": 10.0}


def cases() -> dict[str, tuple]:
    gpt1t = replace(_gpt({"layers": 128, "hidden": 25600, "heads": 160, "vocab": 51200, "seq": 2048}),
                    hidden_dropout=0.0, attention_dropout=0.0)
    llama8b = ModelConfig(arch="llama", num_kv_heads=8, vocab_size=128256, max_position_embeddings=8192,
                          rope_theta=500000.0, **LLAMA3["llama3-8b"])
    return {"1T GPT / 3072 A100": (gpt1t, load_cluster("dgx-a100-80gb", nodes=384), Workload(3072, 1, 2048, "bf16")),
            "405B Llama 3 / 16384 H100": (_llama3("llama3-405b", 8192), load_cluster("dgx-h100", nodes=2048),
                                          Workload(2048, 1, 8192, "bf16")),
            "README: llama3-8b / 4 x DGX H100": (llama8b, load_cluster("dgx-h100", nodes=4),
                                                 Workload(512, 1, 4096, "bf16"))}


def _timed_search(name: str, top_k: int) -> tuple[float, object]:
    model, cluster, w = cases()[name]
    t0 = time.perf_counter()
    res = search(model, cluster, w, top_k=top_k)
    return time.perf_counter() - t0, res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--no-exhaustive", action="store_true", help="skip the baseline that simulates every plan")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    env = environment()
    rows, results = [], []
    for name, (model, cluster, w) in cases().items():
        times, res = [], None
        ctx = multiprocessing.get_context("spawn")
        for _ in range(args.rounds):  # a fresh process each: a cold search, as a CLI run
            with ctx.Pool(1) as pool:
                took, res = pool.apply(_timed_search, (name, args.top_k))
            times.append(took)
        assert res is not None and res.top
        simulated = sum(c.time.extra.get("estimate") == "simulated" for c in res.feasible)
        row = {"case": name, "search_s": statistics.median(times), "rounds_s": times, "evaluated": res.evaluated,
               "feasible": len(res.feasible), "simulated": simulated, "pruned": res.pruned,
               "target_s": TARGETS.get(name), "chosen": res.top[0].overrides(),
               "iteration_s": res.top[0].time.iteration_s}
        if not args.no_exhaustive:
            t0 = time.perf_counter()
            every = SearchResult([], [])
            for bases, mbs in res.structures:
                recompute_choice(model, cluster, w, every, Pins({}), "cuda", bases, mbs)
            best = min(every.feasible, key=lambda c: _retime(model, c, w, cluster).iteration_s)
            row["exhaustive_s"] = row["search_s"] + time.perf_counter() - t0
            row["same_choice"] = best.plan() == res.top[0].plan()
            row["feasible_all"] = len(every.feasible)
        results.append(row)
        ratio = f"{row['exhaustive_s'] / row['search_s']:.1f}x" if "exhaustive_s" in row else "-"
        rows.append([name, f"{row['search_s']:.2f} ({min(times):.2f}-{max(times):.2f})",
                     f"{row['target_s']:.0f}" if row["target_s"] else "-",
                     f"{res.evaluated}/{len(res.feasible)}/{simulated}/{res.pruned}",
                     f"{row['exhaustive_s']:.1f}" if "exhaustive_s" in row else "-", ratio,
                     str(row.get("same_choice", "-")), f"{row['iteration_s']:.3g}"])
    print(f"cpu: {env['cpu_model']} ({env['cpu_capability']}) | torch {env['torch']} | top_k={args.top_k}, "
          f"{args.rounds} rounds")
    print(format_table(["case", "search s (range)", "target s", "evaluated/feasible/simulated/pruned",
                        "simulate-all s", "ratio", "same plan", "chosen iter s"], rows))
    for r in results:
        print(f"{r['case']}: {r['chosen']}")
    if args.json:
        write_json(args.json, {"benchmark": "search", "env": env, "results": results})


if __name__ == "__main__":
    main()
