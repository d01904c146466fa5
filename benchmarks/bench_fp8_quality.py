"""FP8 training quality: float8 linears against bf16 from the same initialisation, on the demo corpus (CPU).

    python benchmarks/bench_fp8_quality.py [--steps 300] [--batch 8] [--seq 128] [--window 10]
                                           [--recipes tensorwise,rowwise,delayed] [--data demo_data]
                                           [--json F] [--png F] [--from-json F] [--control fp32]
                                           [--rerun RECIPE]
                                           # ~45-80 min on one core of a 2-core AMD EPYC

configs/model/llama-25m.yaml (a 25.2M-parameter Llama: 12 layers, h=384, 6 heads, 2 KV heads, SwiGLU 1024,
8k vocabulary, every linear dimension a multiple of 16) trains ``--steps`` steps through the pretrain CLI
with the demo's optimizer and schedule shape (experiment=demo: AdamW, cosine to a tenth) at lr 6e-4 with 50
warm-up steps (``--extra``'s default, SETTING: at the demo's own lr 2e-3 / 20 warm-up steps bf16 spikes at
the end of warm-up and an fp32 run with no float8 is itself 1.30% from bf16 by the mean gap, a floor above
the bound; ``--extra optim.lr=2e-3 optim.warmup_steps=20`` runs it), ``--batch`` x ``--seq`` tokens a
step, once per run: ``train.precision=bf16`` (the baseline), then ``train.precision=fp8`` with each
``train.fp8.recipe``. Every run has the same seed, hence the same initial
weights (the model is built and initialised before its linears are switched to float8) and the same batches.

Metrics of each fp8 run against bf16 (loss = the per-step training loss, metrics.jsonl):
    final loss   the mean of the last ``--window`` steps' losses (one step's loss is noisy); the last step's
                 loss is reported beside it
    final gap    |final_fp8 - final_bf16| / final_bf16                           must hold: <= 1.5%
    mean gap     the mean over all steps of |loss_fp8 - loss_bf16| / loss_bf16   must hold: <= 1%
    max gap      the largest per-step relative gap, and its step
Must hold (issue 35, "Training quality"): both bounds for every recipe.

Nothing is timed for the figures (float8 GEMMs on a CPU are emulated, ~2x a bf16 step here): the runs go one
after the other with one thread each, and their wall times are recorded only to size the benchmark.
``--from-json`` redraws the table and the PNG from a written JSON without training; with ``--control P`` it
first trains one more run at ``train.precision=P`` (fp32, or bf16 again) with the JSON's settings and adds it
under ``controls``, measured against the same bf16 curve by the same metrics: how far a run that differs from
the baseline only in its rounding, not in float8, lands by these metrics (a floor for the targets, no bound).
``--from-json F --rerun R`` trains recipe R again with F's settings against F's bf16 curve (after a change to
that recipe) and keeps R's replaced figures under ``superseded``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "llama-25m"
FINAL_BOUND = 0.015  # |final loss gap| / bf16's final loss
MEAN_BOUND = 0.01  # mean over the curve of the per-step relative gap
RECIPES = ("tensorwise", "rowwise", "delayed")
SETTING = ["optim.lr=6e-4", "optim.warmup_steps=50"]  # where an fp32 control lies within both bounds


def demo_data(path: Path) -> Path:
    if not (path / "stdlib_text_document.idx").exists():
        subprocess.run([sys.executable, "-m", "mpformer.data.demo_corpus", "--out", str(path)], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
    return path


def run_overrides(a: argparse.Namespace, recipe: str | None) -> list[str]:
    """The Hydra overrides of one run: the bf16 baseline (``recipe`` None) or fp8 with ``recipe``."""
    precision = ["train.precision=bf16"] if recipe is None else ["train.precision=fp8", f"train.fp8.recipe={recipe}"]
    return ["experiment=demo", f"model={MODEL}", f"train.steps={a.steps}", f"train.global_batch_size={a.batch}",
            f"train.micro_batch_size={a.batch}", f"train.seq_length={a.seq}", *precision, *a.extra]


def train(name: str, overrides: list[str], data: Path, run_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "pretrain" / "pretrain_gpt.py"), *overrides, "train.threads=1", "logging.interval=1",
           "logging.progress=false", "logging.wandb.mode=disabled", "checkpoint.enabled=false",
           "checkpoint.save_interval=0", "checkpoint.keep=0", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "MPFORMER_DEMO_DIR": str(data), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{name}: the run failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    if steps != list(range(1, len(rows) + 1)):
        raise SystemExit(f"{name}: metrics.jsonl's steps are not 1..N (logging.interval=1 expected)")
    step_times = sorted(r["step_time_s"] for r in rows[1:])
    out = {"name": name, "overrides": overrides, "wall_s": round(time.monotonic() - t0, 1),
           "median_step_s": step_times[len(step_times) // 2] if step_times else None,
           "loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]}
    print(f"  {name}: {len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} "
          f"({out['wall_s']:.0f} s, {out['median_step_s']:.2f} s/step)", flush=True)
    return out


def compare(base: list[float], other: list[float], window: int) -> dict[str, Any]:
    """The metrics of the module docstring for one fp8 curve against the bf16 curve (same steps)."""
    if len(base) != len(other) or len(base) < window:
        raise ValueError(f"curves of {len(base)} and {len(other)} steps, window {window}")
    rel = [(o - b) / b for b, o in zip(base, other)]  # signed: > 0 where fp8's loss is higher
    f_base, f_other = sum(base[-window:]) / window, sum(other[-window:]) / window
    worst = max(range(len(rel)), key=lambda i: abs(rel[i]))
    final_gap = (f_other - f_base) / f_base
    mean_gap = sum(abs(r) for r in rel) / len(rel)
    return {"final_loss": f_other, "last_loss": other[-1], "final_gap": final_gap,
            "last_gap": (other[-1] - base[-1]) / base[-1], "mean_gap": mean_gap,
            "mean_signed_gap": sum(rel) / len(rel), "max_gap": abs(rel[worst]), "max_gap_step": worst + 1,
            # the curve after warm-up and the first fast fall, where a drift would show
            "mean_gap_after_50": sum(abs(r) for r in rel[50:]) / max(1, len(rel) - 50),
            "pass_final": abs(final_gap) <= FINAL_BOUND, "pass_mean": mean_gap <= MEAN_BOUND}


def report(payload: dict[str, Any]) -> None:
    """Print the table of a result (fresh or read back) and draw its PNG."""
    runs, window = payload["runs"], payload["window"]
    base = runs["bf16"]["loss"]
    f_base = sum(base[-window:]) / window
    headers = ["run", "recipe", f"final (last {window})", "last step", "final / bf16", "final gap", "mean gap",
               "max gap (step)", "s/step", "pass"]
    rows: list[list[Any]] = [["bf16", "-", f"{f_base:.4f}", f"{base[-1]:.4f}", "1.0000", "-", "-", "-",
                              f"{runs['bf16']['median_step_s']:.2f}", "-"]]
    for recipe, m in payload["metrics"].items():
        ok = m["pass_final"] and m["pass_mean"]
        rows.append([f"fp8 {recipe}", recipe, f"{m['final_loss']:.4f}", f"{m['last_loss']:.4f}",
                     f"{m['final_loss'] / f_base:.4f}", f"{100 * m['final_gap']:+.2f}%", f"{100 * m['mean_gap']:.2f}%",
                     f"{100 * m['max_gap']:.2f}% ({m['max_gap_step']})", f"{runs[recipe]['median_step_s']:.2f}",
                     "yes" if ok else "NO"])
    for prec, m in payload.get("controls", {}).items():
        rows.append([f"{prec} (control)", "-", f"{m['final_loss']:.4f}", f"{m['last_loss']:.4f}",
                     f"{m['final_loss'] / f_base:.4f}", f"{100 * m['final_gap']:+.2f}%", f"{100 * m['mean_gap']:.2f}%",
                     f"{100 * m['max_gap']:.2f}% ({m['max_gap_step']})",
                     f"{payload['control_runs'][prec]['median_step_s']:.2f}", "-"])
    print(f"\n{payload['steps']} steps of {payload['batch']} x {payload['seq']} tokens, {MODEL} "
          f"({payload['params'] / 1e6:.1f}M parameters); bounds: final gap <= {100 * FINAL_BOUND}%, "
          f"mean gap <= {100 * MEAN_BOUND}%")
    print(format_table(headers, rows))
    plot(payload, Path(payload["png"]))


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    runs = payload["runs"]
    base = runs["bf16"]["loss"]
    steps = range(1, len(base) + 1)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for name, run in runs.items():
        label = name if name == "bf16" else f"fp8 {name}"
        ax1.plot(steps, run["loss"], lw=1.0 if name != "bf16" else 1.6, label=label,
                 color="black" if name == "bf16" else None, alpha=0.85)
    for prec, run in payload.get("control_runs", {}).items():
        ax1.plot(steps, run["loss"], lw=1.0, ls="--", color="grey", label=f"{prec} (control)")
    ax1.set_ylabel("training loss")
    ax1.set_yscale("log")
    ax1.legend()
    ax1.set_title(f"{MODEL} ({payload['params'] / 1e6:.1f}M), demo corpus, {payload['batch']}x{payload['seq']} "
                  f"tokens/step: fp8 against bf16, same initialisation")
    for recipe in payload["metrics"]:
        rel = [100 * (o - b) / b for b, o in zip(base, runs[recipe]["loss"])]
        ax2.plot(steps, rel, lw=0.9, label=f"fp8 {recipe}")
    for prec, run in payload.get("control_runs", {}).items():
        rel = [100 * (o - b) / b for b, o in zip(base, run["loss"])]
        ax2.plot(steps, rel, lw=0.9, ls="--", color="grey", label=f"{prec} (control)")
    for y in (-100 * MEAN_BOUND, 100 * MEAN_BOUND):
        ax2.axhline(y, color="grey", ls="--", lw=0.8)
    ax2.axhline(0, color="black", lw=0.6)
    ax2.set_ylabel("(loss_fp8 - loss_bf16) / loss_bf16, %")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def train_again(payload: dict[str, Any], name: str, recipe: str | None, data: Path, precision: str | None = None
                ) -> dict[str, Any]:
    """One more run with a written result's settings: fp8 ``recipe``, or (``recipe`` None) ``precision``;
    its environment (commit, command, CPU) recorded with it."""
    ns = argparse.Namespace(steps=payload["steps"], batch=payload["batch"], seq=payload["seq"],
                            extra=payload.get("extra", []))
    overrides = run_overrides(ns, recipe)
    if precision is not None:
        overrides = [*(o for o in overrides if not o.startswith("train.precision=")), f"train.precision={precision}"]
    with tempfile.TemporaryDirectory() as tmp:
        run = train(name, overrides, demo_data(data), Path(tmp) / "run")
    env = environment()
    run["environment"] = {k: env[k] for k in ("commit", "command", "cpu_model", "torch")}
    return run


def add_control(payload: dict[str, Any], precision: str, data: Path, path: Path) -> None:
    """Train the control run at ``precision`` with the result's settings and write it into ``path``."""
    run = train_again(payload, f"{precision} (control)", None, data, precision)
    payload.setdefault("control_runs", {})[precision] = run
    payload.setdefault("controls", {})[precision] = compare(payload["runs"]["bf16"]["loss"], run["loss"],
                                                            payload["window"])
    write_json(path, payload)
    print(f"wrote {path}")


def rerun_recipe(payload: dict[str, Any], recipe: str, data: Path, path: Path) -> None:
    """Train fp8 ``recipe`` again with the result's settings and replace its run and metrics in ``path``
    (measured against the same bf16 curve; the replaced figures are kept under ``superseded``)."""
    run = train_again(payload, recipe, recipe, data)
    if recipe in payload["metrics"]:
        old = payload["runs"][recipe].get("environment", payload["environment"]).get("commit")
        payload.setdefault("superseded", {})[recipe] = {"commit": old, **payload["metrics"][recipe]}
    payload["runs"][recipe] = run
    payload["metrics"][recipe] = compare(payload["runs"]["bf16"]["loss"], run["loss"], payload["window"])
    write_json(path, payload)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="sequences a step (one micro-batch)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--window", type=int, default=10, help="the final loss is the mean of the last N steps")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--extra", nargs="*", default=SETTING,
                    help=f"Hydra overrides for every run (default: {' '.join(SETTING)}; more: train.seed=2)")
    ap.add_argument("--data", type=Path, default=ROOT / "demo_data")
    ap.add_argument("--json", type=Path, default=RESULTS / "fp8_quality.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "fp8_quality.png")
    ap.add_argument("--from-json", type=Path, help="redraw the table and PNG of this JSON; no training")
    ap.add_argument("--control", choices=("fp32", "bf16"), help="with --from-json: add a control run (docstring)")
    ap.add_argument("--rerun", choices=RECIPES, help="with --from-json: train this recipe again against its bf16")
    a = ap.parse_args(argv)
    if a.from_json:
        payload = json.loads(a.from_json.read_text())
        if a.control:
            add_control(payload, a.control, a.data, a.from_json)
        if a.rerun:
            rerun_recipe(payload, a.rerun, a.data, a.from_json)
        report({**payload, "png": str(a.png)})
        return 0
    if a.control or a.rerun:
        raise SystemExit("error: --control and --rerun add a run to an existing result: give --from-json F")
    recipes = [s.strip() for s in a.recipes.split(",") if s.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        raise SystemExit(f"error: --recipes={a.recipes!r}; valid: a comma-separated subset of {', '.join(RECIPES)}")
    if not 1 <= a.window <= a.steps:
        raise SystemExit(f"error: --window={a.window} must be in [1, --steps={a.steps}]")
    import yaml

    from mpformer.core.config import ModelConfig

    model_cfg = yaml.safe_load((ROOT / "configs" / "model" / f"{MODEL}.yaml").read_text())
    params = ModelConfig(**model_cfg).num_params()
    env = environment()
    print(f"CPU: {env['cpu_model']} ({env['cpu_capability']}), torch {env['torch']}; {MODEL}: {params:,} parameters; "
          f"{a.steps} steps of {a.batch} x {a.seq} tokens; bf16, then fp8 {', '.join(recipes)}", flush=True)
    data = demo_data(a.data)
    png = a.png.relative_to(ROOT) if a.png.is_relative_to(ROOT) else a.png
    payload: dict[str, Any] = {
        "benchmark": "fp8_quality", "model": MODEL, "model_config": model_cfg, "params": params, "steps": a.steps,
        "batch": a.batch, "seq": a.seq, "window": a.window, "extra": a.extra,
        "bounds": {"final_gap": FINAL_BOUND, "mean_gap": MEAN_BOUND},
        "definitions": {"final_loss": f"mean of the last {a.window} steps' training losses",
                        "final_gap": "(final_fp8 - final_bf16) / final_bf16, |.| <= bound",
                        "mean_gap": "mean over steps of |loss_fp8 - loss_bf16| / loss_bf16, <= bound"},
        "metrics": {}, "runs": {}, "environment": env, "png": str(png)}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["bf16", *recipes]:
            run = train(name, run_overrides(a, None if name == "bf16" else name), data, Path(tmp) / name)
            payload["runs"][name] = run
            if name != "bf16":
                payload["metrics"][name] = compare(payload["runs"]["bf16"]["loss"], run["loss"], a.window)
            # after every run, so that a run cut short (a timeout) leaves the finished ones on disk
            payload["complete"] = name == recipes[-1]
            write_json(a.json, payload)
    metrics = payload["metrics"]
    print(f"wrote {a.json}")
    report({**payload, "png": str(a.png)})
    return 0 if all(m["pass_final"] and m["pass_mean"] for m in metrics.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
