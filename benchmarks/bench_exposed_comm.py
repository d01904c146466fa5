"""Communication the trainer does not hide, per layout: exposed_comm_s from metrics.jsonl.

Runs the pretrain CLI under torchrun (gloo, one thread per rank) for each layout on random tokens and
prints, over the steps after the first ``--skip``: the median step time, the median exposed
communication (host time blocked in collectives and in waits on asynchronous ones, comm.py) with its
share of the step, and the kinds that make up most of it.

    python benchmarks/bench_exposed_comm.py [--ranks 4] [--layouts dp2xpp2 dp2xtp2 ...] [--json out.json]

A layout is written as ``dpAxtpBxppC`` (any order, missing degrees are 1; ``sp`` adds sequence
parallelism, ``zN`` the ZeRO stage); the product must equal ``--ranks``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

ROOT = Path(__file__).resolve().parents[1]


def overrides_of(layout: str) -> tuple[list[str], dict[str, int]]:
    out, degrees = [], {"dp": 1, "tp": 1, "pp": 1}
    for part in layout.split("x"):
        m = re.fullmatch(r"(dp|tp|pp)(\d+)|sp|z(\d)", part)
        if m is None:
            raise SystemExit(f"error: layout part {part!r} of {layout!r}; valid: dpN, tpN, ppN, sp, zN")
        if m.group(1):
            degrees[m.group(1)] = int(m.group(2))
        elif part == "sp":
            out.append("parallel.sequence_parallel=true")
        else:
            out.append(f"parallel.zero={m.group(3)}")
    return [f"parallel.{k}={v}" for k, v in degrees.items()] + out, degrees


def random_data(prefix: Path, vocab: int) -> None:
    from mpformer.data.indexed import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(400):
        builder.add_document(np.append(rng.integers(1, vocab, size=int(rng.integers(200, 600))), 0))
    builder.finalize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layouts", nargs="+", default=["dp4", "dp2xpp2", "dp2xtp2", "dp2xtp2xsp"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    env, rows = environment(), []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "random_text_document"
        random_data(prefix, args.vocab)
        for layout in args.layouts:
            extra, deg = overrides_of(layout)
            n = deg["dp"] * deg["tp"] * deg["pp"]
            if n != args.ranks:
                raise SystemExit(f"error: layout {layout} is {n} ranks, not --ranks {args.ranks}")
            run_dir = Path(tmp) / layout
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
                   str(ROOT / "pretrain" / "pretrain_gpt.py"), "model=tiny-llama", f"model.hidden_size={args.hidden}",
                   f"model.num_layers={args.layers}", "model.num_attention_heads=8", "model.num_kv_heads=4",
                   f"model.ffn_hidden_size={64 * -(-8 * args.hidden // 192)}", f"model.vocab_size={args.vocab}",
                   f"model.max_position_embeddings={args.seq}", f"data.paths=[{prefix}]",
                   f"train.seq_length={args.seq}", f"train.global_batch_size={args.global_batch}",
                   f"train.micro_batch_size={args.micro_batch}", f"train.steps={args.steps}",
                   f"train.precision={args.precision}", "train.device=cpu", "logging.progress=false",
                   f"hydra.run.dir={run_dir}", f"checkpoint.save_dir={tmp}/ck_{layout}", *extra]
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
            if res.returncode != 0:
                raise SystemExit(f"error: layout {layout} failed:\n{res.stderr[-3000:]}")
            ms = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][args.skip:]
            step = statistics.median(m["step_time_s"] for m in ms)
            exposed = statistics.median(m["exposed_comm_s"] for m in ms)
            kinds: dict[str, float] = {}
            for m in ms:
                for k, v in m["exposed_comm_s_by_kind"].items():
                    kinds[k] = kinds.get(k, 0.0) + v / len(ms)
            top = sorted(kinds.items(), key=lambda kv: -kv[1])[:3]
            rows.append({"layout": layout, "overrides": extra, "steps": len(ms), "step_ms": 1e3 * step,
                         "exposed_comm_ms": 1e3 * exposed, "exposed_share": exposed / step,
                         "top_kinds_ms": {k: 1e3 * v for k, v in top},
                         "comm_mb_per_step": statistics.median(m["comm_bytes"] for m in ms) / 2**20})
    print(f"model: llama L={args.layers} h={args.hidden} vocab {args.vocab} | global batch {args.global_batch} x "
          f"{args.seq}, micro-batch {args.micro_batch} | {args.ranks} gloo ranks, 1 thread each | {args.precision} | "
          f"cpu: {env['cpu_model']} ({env['cpu_capability']})")
    print(format_table(["layout", "steps", "step ms", "exposed comm ms", "share of step", "MiB moved/step",
                        "largest exposed kinds (ms)"],
                       [[r["layout"], r["steps"], r["step_ms"], r["exposed_comm_ms"], r["exposed_share"],
                         r["comm_mb_per_step"], ", ".join(f"{k} {v:.1f}" for k, v in r["top_kinds_ms"].items())]
                        for r in rows]))
    if args.json:
        write_json(args.json, {"benchmark": "exposed_comm", "env": env, "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
