"""The auto-configurator's cost model against this machine, out of sample: predicted and measured step
time of layouts of families the profile does not calibrate on.

    python benchmarks/bench_autoconfig.py [--json F] [--profile] [--steps 6] [--rounds 1] [--in-sample]
    python benchmarks/bench_autoconfig.py --repredict F.json   # a saved run, predicted by this code

A small Llama (h=256, 8 layers, 8/4 heads, ffn 768, vocab 8192; 10.5M parameters) trains on 4 gloo
ranks through pretrain's own entry point, fp32, 16 x 256 tokens per step, once per layout of
``LAYOUTS`` plus the layout ``parallel=auto`` picks. Each run names ``cluster=local-cpu``, so the
trainer logs the cost model's prediction (from the measured profile,
configs/cluster/local-cpu-profile.json; ``--profile`` re-measures it before every round, as it does
when the file is missing) next to the measured step time in metrics.jsonl; the benchmark reads both.

Out of sample: the profile calibrates on its own reference model in ``reference_layouts(4)``
(profile_ranks.py); no layout of ``LAYOUTS`` has the (dp, tp, pp, cp, vpp, schedule, zero) of one of
them (checked before anything runs: the benchmark stops if one does). ``--in-sample`` adds
``IN_SAMPLE``, this model in the calibration layouts, reported apart. The parallel=auto row counts
as out of sample unless the search picked a calibration layout.

Columns: predicted seconds per step as the trainer logged it (median over the rounds), measured
seconds per step (median over the steps after the first, over the rounds), the range of the rounds'
medians, the error, the measured time as a ratio to the fastest measured layout. Below: Spearman's
rank correlation of predicted and measured times, the median absolute error, and the regret of the
search (the measured time of the layout it picked over the fastest measured), over all rounds and,
in brackets, their range over the rounds taken one at a time. The search may pick differently from
one round's profile to the next: all its picks are listed.
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

from mpformer.autoconfig.profile_ranks import calibration_identities, layout_identity, reference_layouts
from mpformer.parallel.spawn import run_distributed

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "configs" / "cluster" / "local-cpu-profile.json"
WORLD = 4
MODEL = {"model": "llama-tiny", "model.hidden_size": 256, "model.num_layers": 8, "model.num_attention_heads": 8,
         "model.num_kv_heads": 4, "model.ffn_hidden_size": 768, "model.vocab_size": 8192,
         "model.max_position_embeddings": 256}
GLOBAL_BATCH, SEQ = 16, 256
SP = {"sequence_parallel": True}
# Scored layouts (ParallelLayout fields; dp: what the 4 ranks leave): families the profile does not run.
LAYOUTS: dict[str, dict] = {
    "dp4": {},
    "dp4 zero3": {"zero": 3},
    "dp2 tp2 zero3": {"tp": 2, "zero": 3, **SP},
    "tp4": {"tp": 4, **SP},
    "tp2 pp2": {"tp": 2, "pp": 2, **SP},
    "pp4 interleaved v2": {"pp": 4, "vpp": 2, "schedule": "interleaved"},
    "dp2 pp2 interleaved v2": {"pp": 2, "vpp": 2, "schedule": "interleaved"},
    "pp4 zb-h2": {"pp": 4, "schedule": "zb-h2"},
    "dp2 pp2 zb-h1": {"pp": 2, "schedule": "zb-h1"},
    "dp2 cp2 ring": {"cp": 2},
    "dp2 cp2 ulysses": {"cp": 2, "cp_kind": "ulysses"},
    "tp2 cp2 ring": {"tp": 2, "cp": 2, **SP},
}
# This model in the profile's calibration layouts (--in-sample): its in-sample error, reported apart.
IN_SAMPLE: dict[str, dict] = {name: fields | (SP if fields.get("tp", 1) > 1 else {})
                              for name, fields in reference_layouts(WORLD).items()}


def check_out_of_sample(layouts: dict[str, dict], world: int = WORLD) -> dict[str, str]:
    """{scored layout: the calibration layout it equals} for every collision (empty: disjoint)."""
    calibrated = calibration_identities(world)
    return {name: calibrated[layout_identity(f, world)] for name, f in layouts.items()
            if layout_identity(f, world) in calibrated}


def overrides(fields: dict) -> dict[str, str]:
    return {f"parallel.{k}": str(v).lower() if isinstance(v, bool) else str(v) for k, v in fields.items()}


def _worker(overrides: list[str], run_dir: str) -> dict | None:
    from mpformer.testing.train import train

    train([*overrides, f"hydra.run.dir={run_dir}"])
    run = Path(run_dir)
    if not (run / "metrics.jsonl").exists():
        return None  # ranks other than 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {"times": [r["step_time_s"] for r in rows], "predicted": rows[0]["predicted_step_time_s"],
            "plan": json.loads((run / "autoconfig.json").read_text())}


def _run(overrides: list[str], run_dir: str) -> dict:
    """One run on WORLD ranks; a run that dies (a rank's process aborting in gloo's teardown, seen once
    in ~80 runs) is run once more in a fresh directory, and said so."""
    for attempt in range(2):
        try:
            return run_distributed(_worker, WORLD, args=(overrides, f"{run_dir}_{attempt}"), timeout=1800)[0]
        except RuntimeError as e:
            if attempt:
                raise
            print(f"  run failed, once more: {str(e).splitlines()[0]}", flush=True)
    raise AssertionError("unreachable")


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


def plan_fields(plan: dict) -> dict:
    """The ParallelLayout fields of a logged plan."""
    return {k: v for k, v in plan.items() if k != "micro_batch_size"}


def describe(plan: dict) -> str:
    out = f"dp{plan['dp']} tp{plan['tp']} pp{plan['pp']}"
    out += f" cp{plan['cp']} {plan['cp_kind']}" if plan.get("cp", 1) > 1 else ""
    out += f" z{plan['zero']} mbs{plan['micro_batch_size']}"
    if plan["pp"] > 1:
        out += f" {plan['schedule']}" + (f" v{plan['vpp']}" if plan["vpp"] > 1 else "")
    return out


def repredict(runs: dict[str, list[dict]], profiles: list[dict]) -> None:
    """Replace each run's logged prediction by this code's, from the profile of its round."""
    from dataclasses import replace

    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.memory import Workload
    from mpformer.autoconfig.search import evaluate_plan
    from mpformer.core.layout import ParallelLayout, validate
    from mpformer.core.model_config import ModelConfig

    m = ModelConfig(arch="llama", **{k.split(".")[1]: v for k, v in MODEL.items() if k.startswith("model.")})
    for round_, prof in enumerate(profiles):
        c = replace(load_cluster("local-cpu"), devices_per_node=WORLD, nodes=1, measured=prof)
        for runs_ in runs.values():
            run = runs_[round_]
            plan = run["plan"]["plan"]
            lay = validate(ParallelLayout(**plan_fields(plan)), m, WORLD)
            w = Workload(GLOBAL_BATCH, plan["micro_batch_size"], SEQ, "fp32")
            run["predicted"] = evaluate_plan(m, lay, w, c, "cpu").time.iteration_s


def metrics(pred: list[float], meas: list[float]) -> tuple[float, float]:
    return spearman(pred, meas), statistics.median(abs(p / m - 1) for p, m in zip(pred, meas))


def _summary(label: str, items: list[dict], rounds: int) -> dict:
    rho, mae = metrics([i["predicted_s"] for i in items], [i["measured_s"] for i in items])
    per = [metrics([i["predicted_per_round_s"][r] for i in items], [i["measured_per_round_s"][r] for i in items])
           for r in range(rounds)]
    print(f"{label} ({len(items)} layouts): Spearman rho {rho:.3f} [{min(a for a, _ in per):.3f}-"
          f"{max(a for a, _ in per):.3f}] | median |error| {100 * mae:.1f}% "
          f"[{100 * min(b for _, b in per):.1f}-{100 * max(b for _, b in per):.1f}%]")
    return {"layouts": len(items), "spearman": rho, "median_abs_error": mae,
            "per_round": [{"spearman": a, "median_abs_error": b} for a, b in per]}


def report(runs: dict[str, list[dict]], in_sample: set[str], head: str, elapsed: float) -> dict:
    """Print the table and the metrics (out of sample, and in sample when there are such rows)."""
    rounds = min(len(r) for r in runs.values())
    names = list(runs)
    autos = [run["plan"]["plan"] for run in runs["auto"]]
    auto_calibrated = any(check_out_of_sample({"auto": plan_fields(a)}) for a in autos)
    if auto_calibrated:
        in_sample = in_sample | {"auto"}
    payload, rows = [], []
    for name in names:
        payload.append({"layout": name, "plan": runs[name][0]["plan"]["plan"], "out_of_sample": name not in in_sample,
                        "predicted_s": statistics.median(run["predicted"] for run in runs[name]),
                        "measured_s": statistics.median(t for run in runs[name] for t in run["times"][1:]),
                        "predicted_per_round_s": [run["predicted"] for run in runs[name]],
                        "measured_per_round_s": [statistics.median(run["times"][1:]) for run in runs[name]]})
    fastest = min(item["measured_s"] for item in payload)
    for item in payload:
        item["error"], item["vs_fastest"] = item["predicted_s"] / item["measured_s"] - 1, item["measured_s"] / fastest
        t = item["measured_per_round_s"]
        plans = dict.fromkeys(describe(run["plan"]["plan"]) for run in runs[item["layout"]])
        rows.append([item["layout"] + ("" if item["out_of_sample"] else " (in sample)"), " / ".join(plans),
                     item["predicted_s"], item["measured_s"], f"{min(t):.2f}-{max(t):.2f}" if len(t) > 1 else "-",
                     f"{100 * item['error']:+.0f}%", item["vs_fastest"]])
    print(head)
    print(format_table(["layout", "plan", "predicted s", "measured s", "rounds s", "error", "vs fastest"], rows))
    out: dict = {"results": payload}
    for label, keep in (("out of sample", True), ("in sample", False)):
        items = [i for i in payload if i["out_of_sample"] == keep]
        if len(items) >= 3:
            out[label.replace(" ", "_")] = _summary(label, items, rounds)
    auto = payload[names.index("auto")]
    regret = auto["measured_s"] / fastest - 1
    per_regret = [auto["measured_per_round_s"][r] / min(i["measured_per_round_s"][r] for i in payload) - 1
                  for r in range(rounds)]
    out |= {"regret": regret, "regret_per_round": per_regret, "auto_plans": autos,
            "auto_is_calibration_layout": auto_calibrated}
    print(f"search picked {' / '.join(dict.fromkeys(describe(a) for a in autos))}"
          + (" (a calibration layout)" if auto_calibrated else "")
          + f": regret {100 * regret:+.1f}% [{100 * min(per_regret):+.1f} to {100 * max(per_regret):+.1f}%] "
          f"vs the fastest measured | total {elapsed:.0f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="runs per layout, in alternating order")
    ap.add_argument("--profile", action="store_true", help="re-measure the local-cpu profile before each round")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--in-sample", action="store_true", help="also run this model in the calibration layouts")
    ap.add_argument("--repredict", help="a JSON this benchmark wrote: its measurements, predicted by this code")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    collisions = check_out_of_sample(LAYOUTS)
    if collisions:
        raise SystemExit("scored layouts equal calibration layouts (not out of sample): "
                         + ", ".join(f"{a} = {b}" for a, b in collisions.items()))
    print("calibration layouts (the profile's reference model; excluded from scoring): "
          + ", ".join(reference_layouts(WORLD)))
    if args.repredict:
        saved = json.loads(Path(args.repredict).read_text())
        runs, profiles = saved["runs"], saved["profiles"]
        repredict(runs, profiles)
        in_sample = {i["layout"] for i in saved["results"] if not i["out_of_sample"] and i["layout"] != "auto"}
        head = f"{args.repredict}: measured then, predicted now"
        out = report(runs, in_sample, head, time.perf_counter() - t0)
        if args.json:
            write_json(args.json, {**saved, **out, "repredicted": True})
        return
    if not PROFILE.exists():
        args.profile = True
    scored = {n: LAYOUTS[n] for n in args.layouts} | (IN_SAMPLE if args.in_sample else {})
    runs: dict[str, list[dict]] = {}
    profiles: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = _make_data(Path(tmp), 8192)
        base = {**MODEL, "data.paths": f"[{data}]", "train.seq_length": SEQ, "train.steps": args.steps,
                "train.global_batch_size": GLOBAL_BATCH, "train.micro_batch_size": 1, "train.device": "cpu",
                "train.threads": 1, "optim.warmup_steps": 0, "logging.progress": "false", "cluster": "local-cpu"}
        names = [*scored, "auto"]
        cases = {n: {**base, **overrides(f)} for n, f in scored.items()}
        # parallel=auto as a user runs it: the search picks the layout and the micro-batch size.
        cases["auto"] = {k: v for k, v in base.items() if k != "train.micro_batch_size"} | {"parallel": "auto"}
        for r in range(args.rounds):
            if args.profile:  # this machine's speed drifts: each round is predicted from its own profile
                subprocess.run([sys.executable, "-m", "mpformer.autoconfig.profile", "--out", str(PROFILE)], check=True)
            profiles.append(json.loads(PROFILE.read_text()))
            for name in names if r % 2 == 0 else names[::-1]:
                over = [f"{k}={v}" for k, v in cases[name].items()]
                out = _run(over, f"{tmp}/{name.replace(' ', '_')}_{r}")
                runs.setdefault(name, []).append(out)
                print(f"  {name}: {statistics.median(out['times'][1:]):.3f} s/step measured, "
                      f"{out['predicted']:.3f} predicted", flush=True)
    head = (f"Llama h=256 L=8 (10.5M parameters), {WORLD} gloo ranks x 1 thread on {environment()['cpu_count']} "
            f"cores ({environment()['cpu_model']}), fp32, {GLOBAL_BATCH} x {SEQ} tokens per step; {args.steps} steps "
            "per run, median of the steps after the first")
    out = report({n: runs[n] for n in names}, set(IN_SAMPLE) if args.in_sample else set(), head,
                 time.perf_counter() - t0)
    if args.json:
        write_json(args.json, {"args": vars(args), "environment": environment(), **out,
                               "calibration_layouts": reference_layouts(WORLD), "runs": runs, "profiles": profiles})


if __name__ == "__main__":
    main()
