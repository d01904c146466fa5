"""What periodic checkpoints cost a training run: no saving, foreground saves, background saves.

Runs the pretrain CLI (one process, one torch thread, so a background writer has the other core; or
``--ranks N`` under torchrun) on random tokens, the same run three ways, in alternating rounds:

    none         checkpoint.save_interval=0 (only the final save, after the timed steps)
    foreground   checkpoint.save_interval=N: training waits while each checkpoint is written
    background   the same with checkpoint.async=true: staged to host memory, written by a thread

and prints the training time per step (metrics.jsonl's ``elapsed_s`` at the last step, over the
steps after the first, so saves and their stalls are inside it) with its ratio to ``none`` of the
same round, and the checkpoint size. The issue's target: background within 10% of none.

    python benchmarks/bench_checkpoint.py [--interval 5] [--steps 31] [--rounds 3] [--json out.json]
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
from bench_exposed_comm import random_data
from common import environment, format_table, write_json

ROOT = Path(__file__).resolve().parents[1]
MODES = {"none": [], "foreground": ["checkpoint.async=false"], "background": ["checkpoint.async=true"]}


def run(mode: str, args, data: Path, work: Path, tag: str) -> dict:
    run_dir, ck = work / f"{mode}-{tag}", work / f"ck-{mode}-{tag}"
    interval = args.interval if mode != "none" else 0
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}"]
                              if args.ranks > 1 else [])
    cmd += ["pretrain/pretrain_gpt.py", "model=llama-tiny", f"model.hidden_size={args.hidden}",
            f"model.num_layers={args.layers}", "model.ffn_hidden_size=" + str(64 * -(-8 * args.hidden // 192)),
            f"model.vocab_size={args.vocab}", f"data.paths=[{data}]", f"train.steps={args.steps}",
            f"train.seq_length={args.seq}", f"train.global_batch_size={args.batch * args.ranks}",
            f"train.micro_batch_size={args.batch}", "train.device=cpu", "train.threads=1", "logging.progress=false",
            f"checkpoint.save_interval={interval}", f"checkpoint.save_dir={ck}", f"hydra.run.dir={run_dir}",
            *MODES[mode]]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        raise SystemExit(f"error: the {mode} run failed:\n{res.stderr[-3000:]}")
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step = (m[-1]["elapsed_s"] - m[0]["elapsed_s"]) / (len(m) - 1)  # the first step warms up
    saved = sorted(ck.glob("step_*"))
    size = sum(f.stat().st_size for f in saved[-1].rglob("*") if f.is_file()) if saved else 0
    return {"mode": mode, "per_step_s": per_step, "saves": len(saved) - 1, "ckpt_bytes": size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=int, default=5, help="steps between saves")
    p.add_argument("--steps", type=int, default=31)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    env = environment()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        random_data(work / "tokens", args.vocab)
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            got = {mode: run(mode, args, work / "tokens", work, str(r)) for mode in order}
            for mode in MODES:
                rows.append({**got[mode], "round": r, "ratio": got[mode]["per_step_s"] / got["none"]["per_step_s"]})
    print(f"cpu: {env['cpu_model']} ({env['cpu_capability']}) | torch {env['torch']} | llama h={args.hidden} "
          f"L={args.layers} v={args.vocab} | {args.ranks} rank(s), 1 thread each | save every {args.interval} of "
          f"{args.steps} steps")
    table = []
    for mode in MODES:
        mine = [x for x in rows if x["mode"] == mode]
        ratios = [x["ratio"] for x in mine]
        table.append([mode, len(mine), 1e3 * statistics.median(x["per_step_s"] for x in mine),
                      statistics.median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}", mine[0]["saves"],
                      mine[0]["ckpt_bytes"] / 2**20])
    # The rounds' range: on a shared 2-core machine one run's step time moves by several percent by itself.
    print(format_table(["mode", "rounds", "ms / step", "ratio to none", "rounds' range", "saves timed",
                        "checkpoint MiB"], table))
    if args.json:
        write_json(args.json, {"benchmark": "checkpoint", "env": env, "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
