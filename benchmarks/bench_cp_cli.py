"""Context parallelism and document masks through the pretrain CLI, as a user runs them (fp32, CPU).

    python benchmarks/bench_cp_cli.py [--seq 8192] [--steps 7] [--json F]      # ~2 min on 2 cores

A 2-layer h=256 Llama (the demo model's width, model=llama-tiny with model.num_layers=2) on the demo
corpus (built on first use), micro-batch 1 of ``--seq`` tokens, every run on the machine's two cores
either way: cp=1 is one process of two threads, cp=2 two processes of one thread. Each run trains
``--steps`` steps; the step time is the median of metrics.jsonl's step_time_s over the steps after
the first (warm-up), as a ratio to the cp=1 run without document masks:

    cp=1                 torch's SDPA over the causal sequence
    cp=2 ring / allgather / ulysses
    cp=1 documents       data.document_mask=true: the blocks of each document (core/attention_plan.py)
    cp=2 ring documents

Losses are printed beside: a cp run's must equal cp=1's (the parity tests check it to 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

ROOT = Path(__file__).resolve().parents[1]
RUNS = [("cp=1", 1, []), ("cp=2 ring", 2, ["parallel.cp=2", "parallel.cp_kind=ring"]),
        ("cp=2 allgather", 2, ["parallel.cp=2", "parallel.cp_kind=allgather"]),
        ("cp=2 ulysses", 2, ["parallel.cp=2", "parallel.cp_kind=ulysses"]),
        ("cp=1 documents", 1, ["data.document_mask=true"]),
        ("cp=2 ring documents", 2, ["parallel.cp=2", "parallel.cp_kind=ring", "data.document_mask=true"])]


def demo_data(path: Path) -> Path:
    if not (path / "stdlib_text_document.idx").exists():
        subprocess.run([sys.executable, "-m", "mpformer.data.demo_corpus", "--out", str(path)], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
    return path


def run(name: str, ranks: int, extra: list[str], a: argparse.Namespace, data: Path, tmp: Path) -> dict:
    run_dir = tmp / name.replace(" ", "_").replace("=", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(ROOT / "pretrain" / "pretrain_gpt.py"), "model=llama-tiny", f"model.num_layers={a.layers}",
           f"model.max_position_embeddings={a.seq}", "data=demo", f"train.seq_length={a.seq}",
           "train.micro_batch_size=1", "train.global_batch_size=1", f"train.steps={a.steps}", "train.device=cpu",
           f"train.threads={2 // ranks}", "logging.interval=1", "logging.progress=false",
           "logging.wandb.mode=disabled", "checkpoint.enabled=false", f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "MPFORMER_DEMO_DIR": str(data), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(2 // ranks)}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{name}: the run failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows]
    return {"name": name, "ranks": ranks, "overrides": extra, "step_times_s": times,
            "median_s": statistics.median(times[1:]), "losses": [r["loss"] for r in rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7, help="steps per run; the first is left out of the median")
    ap.add_argument("--data", type=Path, default=ROOT / "demo_data")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    env = environment()
    print(f"CPU: {env['cpu_model']} ({env['cpu_capability']}), {env['cpu_count']} cores, torch {env['torch']}; "
          f"Llama L={a.layers} h=256, {a.seq} tokens a step, fp32, {a.steps - 1} timed steps a run")
    data = demo_data(a.data)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(name, ranks, extra, a, data, Path(tmp)) for name, ranks, extra in RUNS]
    base = results[0]["median_s"]
    rows = [[r["name"], f"{r['ranks']} x {2 // r['ranks']}", f"{r['median_s']:.2f}", f"{r['median_s'] / base:.2f}",
             " ".join(f"{x:.4f}" for x in r["losses"][:3])] for r in results]
    print(format_table(["run", "ranks x threads", "step s (median)", "vs cp=1", "first losses"], rows))
    if a.json:
        write_json(a.json, {"args": {k: str(v) for k, v in vars(a).items()}, "environment": env, "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
