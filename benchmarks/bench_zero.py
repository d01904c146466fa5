"""ZeRO stages: model-state memory and peak memory per rank, and step time, against stage 0.

    python benchmarks/bench_zero.py [--json F] [--quick]

A ~100M-parameter Llama (h=768, 12 layers, ffn 2048, 12/4 heads, vocab 8192) trains on 4 gloo
ranks (dp=4) through the real trainer, fp32, once per ZeRO stage 0-3, the stages run in the order
0 1 2 3 3 2 1 0 (two rounds, so that machine drift hits every stage alike). Per stage and rank:

* model-state bytes counted from the tensors the optimizer holds (memory.json), next to
  docs/formulas.md's ZeRO table for fp32 (w = g = 4, no separate masters, k = 8 for Adam's m and v);
* resident memory of each rank's (fresh) process above what it held before the model was built:
  when training starts (the model state, plus allocator slack), at its peak during the training
  steps (adds activations and the transient full-size gradient/parameter buffers; VmHWM reset after
  set-up), and at its peak during set-up (every rank builds the full fp32 model before sharding);
* step time: median over the timed steps of both rounds, as a ratio to stage 0's.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

from mpformer.parallel.spawn import run_distributed

STAGES = [0, 1, 2, 3]


def _vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _make_data(root: Path, vocab: int) -> str:
    import numpy as np

    from mpformer.data.indexed import IndexedDatasetBuilder

    prefix = root / "random_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(400):
        builder.add_document(np.append(rng.integers(1, vocab, size=int(rng.integers(200, 600))), 0))
    builder.finalize()
    return str(prefix)


def _worker(args: argparse.Namespace, data: str, run_dir: str, zero: int) -> dict:
    """One stage in fresh processes: the peak is this run's, not an earlier run's kept heap."""
    import json

    from mpformer.testing.train import overrides, train

    model = {"model": "llama-tiny", "model.hidden_size": args.hidden, "model.num_layers": args.layers,
             "model.num_attention_heads": 12, "model.num_kv_heads": 4, "model.ffn_hidden_size": args.ffn,
             "model.vocab_size": args.vocab, "model.max_position_embeddings": args.seq}
    base = {**model, "data.paths": f"[{data}]", "train.seq_length": args.seq, "train.steps": args.steps,
            "train.global_batch_size": 4 * args.micro_batch, "train.micro_batch_size": args.micro_batch,
            "train.device": "cpu", "optim.warmup_steps": 0, "logging.progress": False, "train.threads": 1}
    import mpformer.training.trainer as trainer_module

    marks: dict[str, int] = {"before": _vm("VmRSS")}
    report = trainer_module.memory_report

    def report_then_mark(*args, **kwargs) -> None:  # instrumentation: the peak of the training steps alone
        report(*args, **kwargs)
        gc.collect()
        marks["setup_peak"] = _vm("VmHWM")
        marks["start"] = _vm("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak) to the current RSS

    trainer_module.memory_report = report_then_mark  # what Trainer.fit calls once set-up is done
    train(overrides(base, Path(run_dir), **{"parallel.zero": zero}))
    out = {"peak_rss": _vm("VmHWM"), "rss_before": marks["before"], "rss_start": marks["start"],
           "setup_peak": marks["setup_peak"]}
    run = Path(run_dir)
    if (run / "memory.json").exists():  # rank 0 writes the run's files
        out["memory"] = json.loads((run / "memory.json").read_text())["per_rank"]
        out["times"] = [json.loads(x)["step_time_s"] for x in (run / "metrics.jsonl").read_text().splitlines()][1:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a 4-layer h=256 model, one round")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.ffn = 384, 4, 1024
    from mpformer.core.model_config import ModelConfig
    from mpformer.optim.memory import zero_formula_bytes

    psi = ModelConfig(arch="llama", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=12,
                      num_kv_heads=4, ffn_hidden_size=args.ffn, vocab_size=args.vocab).num_params()
    # glibc raises its mmap threshold after large frees and then keeps freed memory resident; a fixed
    # threshold makes every tensor buffer its own mapping, so resident memory follows live tensors.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    t0 = time.perf_counter()
    runs: dict[int, list[list[dict]]] = {z: [] for z in STAGES}
    with tempfile.TemporaryDirectory() as tmp:
        data = _make_data(Path(tmp), args.vocab)
        order = STAGES if args.quick else STAGES + STAGES[::-1]
        for k, zero in enumerate(order):
            runs[zero].append(run_distributed(_worker, 4, args=(args, data, f"{tmp}/z{zero}_{k}", zero),
                                              timeout=3600))
    rows, payload = [], []
    times = {z: [t for ranks in runs[z] for t in ranks[0]["times"]] for z in STAGES}
    base_time = statistics.median(times[0])
    for zero in STAGES:
        counted = max(m["total"] for ranks in runs[zero] for m in ranks[0]["memory"])
        formula = zero_formula_bytes(zero, psi, 4, w=4, g=4, m=0, k=8)
        ranks = [r for rs in runs[zero] for r in rs]
        held = max(r["rss_start"] - r["rss_before"] for r in ranks)
        peak = max(r["peak_rss"] - r["rss_before"] for r in ranks)
        setup = max(r["setup_peak"] - r["rss_before"] for r in ranks)
        step = statistics.median(times[zero])
        rows.append([zero, formula / 2**20, counted / 2**20, counted / formula, held / 2**20, peak / 2**20,
                     setup / 2**20, 1e3 * step, step / base_time])
        payload.append({"zero": zero, "formula_bytes": formula, "counted_bytes": counted, "rss_held_bytes": held,
                        "peak_training_bytes": peak, "peak_setup_bytes": setup, "step_time_s": step,
                        "step_time_ratio_vs_zero0": step / base_time})
    print(f"Llama h={args.hidden} L={args.layers} ffn={args.ffn} vocab={args.vocab}: {psi / 1e6:.1f}M parameters, "
          f"dp=4 gloo ranks x 1 thread, fp32, {args.micro_batch}x{args.seq} tokens per rank per step")
    print("memory columns are per rank (the largest), above the process's resident memory before the model "
          "was built")
    print(format_table(["zero", "formula MiB", "counted MiB", "counted/formula", "held at start MiB",
                        "peak in steps MiB", "peak in setup MiB", "step ms", "step / zero 0"], rows))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, {"args": vars(args), "environment": environment(), "psi": psi, "results": payload})


if __name__ == "__main__":
    main()
