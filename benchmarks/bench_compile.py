"""train.compile under each parallel layout: step time compiled against eager, on 2 CPU ranks (fp32).

    python benchmarks/bench_compile.py [--steps 8] [--hidden 256 --layers 4 --seq 256] [--json F]   # ~6 min

For tp=2 with sequence parallelism, pp=2 with 1F1B and with ZB-V, ZeRO-3 at dp=2 and cp=2 ring (the
layouts tests/distributed/test_compile.py checks for parity), the same run eager and with every block
compiled (Transformer.compile_layers), each through the trainer on random tokens, one thread per
rank. Step time: the median of metrics.jsonl's step_time_s after the first two steps (compilation and
warm-up), rank 0's; the first step's time is shown apart (it holds the compilation). The losses of
the two runs are compared step by step (the same training within 1e-5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

from mpformer.parallel.spawn import run_distributed

LAYOUTS = {
    "tp=2 + SP": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "pp=2 1F1B": {"parallel.pp": 2, "parallel.schedule": "1f1b"},
    "pp=2 ZB-V": {"parallel.pp": 2, "parallel.schedule": "zb-v", "parallel.vpp": 2},
    "dp=2 ZeRO-3": {"parallel.dp": 2, "parallel.zero": 3},
    "cp=2 ring": {"parallel.cp": 2, "parallel.cp_kind": "ring"},
}


def _data(root: Path, vocab: int) -> str:
    import numpy as np

    from mpformer.data.indexed import IndexedDatasetBuilder

    prefix = root / "random_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, np.int32)
    for _ in range(64):
        builder.add_document(rng.integers(1, vocab, size=4096))
    builder.finalize()
    return str(prefix)


def _worker(a: argparse.Namespace, data: str, root: str) -> dict:
    import json

    import torch

    from mpformer.testing.train import overrides, train

    torch.set_num_threads(1)
    base = {"model": "llama-tiny", "model.num_layers": a.layers, "model.hidden_size": a.hidden,
            "train.seq_length": a.seq, "train.steps": a.steps, "train.global_batch_size": 8,
            "train.micro_batch_size": 2, "train.device": "cpu", "logging.progress": False,
            "checkpoint.enabled": False, "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
            "data.paths": f"[{data}]"}
    out = {}
    for name, kw in LAYOUTS.items():
        for compiled in (False, True):
            run = Path(root) / f"{name.replace(' ', '_').replace('=', '').replace('+', '')}_{compiled}"
            t0 = time.perf_counter()
            train(overrides(base, run, **kw, **{"train.compile": compiled}))
            path = run / "metrics.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
            out[(name, compiled)] = {"wall_s": time.perf_counter() - t0, "losses": [r["loss"] for r in rows],
                                     "step_times_s": [r["step_time_s"] for r in rows]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.steps < 7:
        raise SystemExit("--steps must be at least 7 (two warm-up steps, five timed)")
    env = environment()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res = run_distributed(_worker, 2, args=(a, _data(Path(tmp), 8192), tmp), timeout=3600,
                              env={"OMP_NUM_THREADS": "1"})[0]
    rows, payload = [], []
    for name in LAYOUTS:
        eager, comp = res[(name, False)], res[(name, True)]
        e, c = (statistics.median(x["step_times_s"][2:]) for x in (eager, comp))
        rel = max(abs(x - y) / abs(y) for x, y in zip(comp["losses"], eager["losses"]))
        rows.append([name, f"{e * 1e3:.0f}", f"{c * 1e3:.0f}", f"{e / c:.2f}", f"{comp['step_times_s'][0]:.1f}",
                     f"{rel:.1e}"])
        payload.append({"layout": name, "eager": eager, "compiled": comp, "eager_step_s": e, "compiled_step_s": c,
                        "speedup": e / c, "max_loss_rel_diff": rel})
    print(f"CPU: {env['cpu_model']} ({env['cpu_capability']}), {env['cpu_count']} cores, torch {env['torch']}; "
          f"llama L={a.layers} h={a.hidden}, 8 x {a.seq} tokens a step, fp32, 2 ranks of one thread, "
          f"{a.steps - 2} timed steps")
    print(format_table(["layout", "eager ms", "compiled ms", "speedup", "first compiled step s",
                        "losses: max rel diff"], rows))
    if a.json:
        write_json(a.json, {"args": {k: str(v) for k, v in vars(a).items()}, "environment": env,
                            "layouts": payload})
    return 0


if __name__ == "__main__":
    sys.exit(main())
