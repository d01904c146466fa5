"""The auto-configurator's cost model against this machine: predicted and measured step time of layouts.

    python benchmarks/bench_autoconfig.py [--json F] [--profile] [--steps 6] [--rounds 1]

A small Llama (h=256, 8 layers, 8/4 heads, ffn 768, vocab 8192; 10.5M parameters) trains on 4 gloo
ranks through pretrain's own entry point, fp32, 16 x 256 tokens per step, once per layout: mixes of
dp, tp (with sequence parallelism), pp and ZeRO, plus the layout ``parallel=auto`` picks. Each run
names ``cluster=local-cpu``, so the trainer logs the cost model's prediction (from the measured
profile, configs/cluster/local-cpu-profile.json; ``--profile`` re-measures it before every round, as
it does when the file is missing) next to the measured step time in metrics.jsonl; the benchmark
reads both back. The machine's speed drifts by tens of percent within minutes, hence the profile per
round and several rounds in alternating order.

Columns: predicted seconds per step (median over the rounds' predictions), measured seconds per
step (median over the steps after the first, over the rounds), the range of the rounds' medians
(the machine's noise), the error of the prediction, and the measured time as a ratio to the fastest
measured layout. Below the table: Spearman's rank correlation of predicted and measured times, the
median absolute error, and the regret of the search: the measured time of the layout it picked over
the fastest measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zero import _make_data
from common import environment, format_table, write_json

from mpformer.parallel.spawn import run_distributed

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "configs" / "cluster" / "local-cpu-profile.json"
MODEL = {"model": "llama-tiny", "model.hidden_size": 256, "model.num_layers": 8, "model.num_attention_heads": 8,
         "model.num_kv_heads": 4, "model.ffn_hidden_size": 768, "model.vocab_size": 8192,
         "model.max_position_embeddings": 256}
SP = {"parallel.sequence_parallel": "true"}
LAYOUTS: dict[str, dict] = {
    "dp4": {},
    "dp4 zero1": {"parallel.zero": 1},
    "dp4 zero3": {"parallel.zero": 3},
    "dp2 tp2": {"parallel.tp": 2, **SP},
    "dp2 tp2 zero2": {"parallel.tp": 2, "parallel.zero": 2, **SP},
    "tp4": {"parallel.tp": 4, **SP},
    "dp2 pp2": {"parallel.pp": 2},
    "pp4": {"parallel.pp": 4},
    "tp2 pp2": {"parallel.tp": 2, "parallel.pp": 2, **SP},
    "dp2 pp2 zero1": {"parallel.pp": 2, "parallel.zero": 1},
}


def _worker(overrides: list[str], run_dir: str) -> dict | None:
    from mpformer.testing.train import train

    train([*overrides, f"hydra.run.dir={run_dir}"])
    run = Path(run_dir)
    if not (run / "metrics.jsonl").exists():
        return None  # ranks other than 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {"times": [r["step_time_s"] for r in rows], "predicted": rows[0]["predicted_step_time_s"],
            "plan": json.loads((run / "autoconfig.json").read_text())}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: Pearson correlation of the ranks (ties share their mean rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="runs per layout, in alternating order")
    ap.add_argument("--profile", action="store_true", help="re-measure the local-cpu profile before each round")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if not PROFILE.exists():
        args.profile = True
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = _make_data(Path(tmp), 8192)
        base = {**MODEL, "data.paths": f"[{data}]", "train.seq_length": 256, "train.steps": args.steps,
                "train.global_batch_size": 16, "train.micro_batch_size": 1, "train.device": "cpu",
                "train.threads": 1, "optim.warmup_steps": 0, "logging.progress": "false", "cluster": "local-cpu"}
        names = [*args.layouts, "auto"]
        cases = {n: {**base, **LAYOUTS[n]} for n in args.layouts}
        # parallel=auto as a user runs it: the search picks the layout and the micro-batch size.
        cases["auto"] = {k: v for k, v in base.items() if k != "train.micro_batch_size"} | {"parallel": "auto"}
        for r in range(args.rounds):
            if args.profile:  # this machine's speed drifts: each round is predicted from its own profile
                subprocess.run([sys.executable, "-m", "mpformer.autoconfig.profile", "--out", str(PROFILE)], check=True)
            for name in names if r % 2 == 0 else names[::-1]:
                over = [f"{k}={v}" for k, v in cases[name].items()]
                out = run_distributed(_worker, 4, args=(over, f"{tmp}/{name.replace(' ', '_')}_{r}"), timeout=1800)[0]
                runs.setdefault(name, []).append(out)
                print(f"  {name}: {statistics.median(out['times'][1:]):.3f} s/step measured, "
                      f"{out['predicted']:.3f} predicted", flush=True)
    auto_plan = runs["auto"][0]["plan"]
    rows, payload, pred, meas = [], [], [], []
    for name in names:
        m = statistics.median([t for run in runs[name] for t in run["times"][1:]])
        p = statistics.median(run["predicted"] for run in runs[name])
        pred.append(p)
        meas.append(m)
        payload.append({"layout": name, "plan": runs[name][0]["plan"]["plan"], "predicted_s": p, "measured_s": m,
                        "error": p / m - 1})
    fastest = min(meas)
    for item in payload:
        item["vs_fastest"] = item["measured_s"] / fastest
        plan = item["plan"]
        desc = f"dp{plan['dp']} tp{plan['tp']} pp{plan['pp']} z{plan['zero']} mbs{plan['micro_batch_size']}" + (
            f" {plan['schedule']}" + (f" v{plan['vpp']}" if plan["vpp"] > 1 else "") if plan["pp"] > 1 else "")
        times = [statistics.median(run["times"][1:]) for run in runs[item["layout"]]]
        item["measured_per_round_s"] = times
        spread = f"{min(times):.2f}-{max(times):.2f}" if len(times) > 1 else "-"
        rows.append([item["layout"], desc, item["predicted_s"], item["measured_s"], spread,
                     f"{100 * item['error']:+.0f}%", item["vs_fastest"]])
    rho = spearman(pred, meas)
    mae = statistics.median(abs(p / m - 1) for p, m in zip(pred, meas))
    regret = meas[names.index("auto")] / fastest - 1
    print(f"Llama h=256 L=8 (10.5M parameters), 4 gloo ranks x 1 thread on {environment()['cpu_count']} cores, fp32, "
          f"16 x 256 tokens per step; {args.steps} steps per run, median of the steps after the first")
    print(format_table(["layout", "plan", "predicted s", "measured s", "rounds s", "error", "vs fastest"], rows))
    print(f"Spearman rho {rho:.3f} | median |error| {100 * mae:.1f}% | search picked "
          f"{rows[-1][1]}: regret {100 * regret:+.1f}% vs the fastest measured | "
          f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, {"args": vars(args), "environment": environment(), "results": payload,
                               "spearman": rho, "median_abs_error": mae, "regret": regret, "auto_plan": auto_plan,
                               "profile": json.loads(PROFILE.read_text())["cluster"]})


if __name__ == "__main__":
    main()
