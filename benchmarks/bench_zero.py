"""ZeRO stages and tp=4: model-state memory, set-up and training peaks per rank, and step time.

    python benchmarks/bench_zero.py [--json F] [--quick] [--only "zero 3,tp4"] [--baseline DIR]

A ~100M-parameter Llama (h=768, 12 layers, ffn 2048, 12/4 heads, vocab 8192) trains on 4 gloo
ranks through the real trainer, fp32: dp=4 once per ZeRO stage 0-3, and tp=4 (dp=1, zero 0). The
layouts run in the order given, then reversed (two rounds, so that machine drift hits every one
alike). Per layout and rank:

* model-state bytes counted from the tensors the optimizer holds (memory.json), next to
  docs/formulas.md's ZeRO table for fp32 (w = g = 4, no separate masters, k = 8 for Adam's m and v;
  tp=4: the stage-0 figure over 4);
* set-up peak of live tensor bytes, from the start of build_run (training/build.py) until training starts
  (optimizer state created): every allocation and free of c10's CPU allocator, as torch.profiler's
  memory profiling reports them (``profile_memory``), summed in order, and its maximum. It counts
  every tensor byte the set-up allocates, touched or not, and nothing else (no interpreter, no gloo
  buffers); allocations on threads the profiler does not follow (gloo's workers) are missed. Shown
  as a ratio to the rank's model-state bytes (the issue's target: at most 1.3), and with
  ``--baseline DIR`` next to the same ratio measured on another checkout (e.g. the commit before
  meta-device initialisation);
* resident memory of each rank's (fresh) process above what it held before the model was built:
  when training starts, at its peak during the training steps (VmHWM reset after set-up) and during
  set-up (this one also counts imports, process groups and the data index);
* step time: median over the timed steps of both rounds, as a ratio to dp=4 zero 0's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

from mpformer.parallel.spawn import run_distributed

LAYOUTS = {"zero 0": {"parallel.zero": 0}, "zero 1": {"parallel.zero": 1}, "zero 2": {"parallel.zero": 2},
           "zero 3": {"parallel.zero": 3}, "tp4": {"parallel.zero": 0, "parallel.tp": 4}}


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


def _peak_tensor_bytes(prof) -> int:
    """The largest sum of live CPU tensor bytes allocated inside the profiled window."""
    from torch.autograd import DeviceType

    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):  # stable: one call's alloc before its free
        live += e.nbytes()  # negative for a free (of a block allocated inside the window)
        peak = max(peak, live)
    return peak


def _worker(args: argparse.Namespace, data: str, run_dir: str, layout: dict) -> dict:
    """One layout in fresh processes: the peaks are this run's, not an earlier run's kept heap."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from mpformer.testing.train import overrides, train

    model = {"model": "llama-tiny", "model.hidden_size": args.hidden, "model.num_layers": args.layers,
             "model.num_attention_heads": 12, "model.num_kv_heads": 4, "model.ffn_hidden_size": args.ffn,
             "model.vocab_size": args.vocab, "model.max_position_embeddings": args.seq}
    base = {**model, "data.paths": f"[{data}]", "train.seq_length": args.seq, "train.steps": args.steps,
            "train.global_batch_size": 4 * args.micro_batch, "train.micro_batch_size": args.micro_batch,
            "train.device": "cpu", "optim.warmup_steps": 0, "logging.progress": False, "train.threads": 1}
    import mpformer.training.build as build_module
    import mpformer.training.trainer as trainer_module

    marks: dict[str, int] = {"before": _vm("VmRSS")}
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    report, build = trainer_module.memory_report, build_module.build_run

    def build_profiled(*a, **kw):  # instrumentation: set-up starts with the run's parts
        prof.start()
        return build(*a, **kw)

    def report_then_mark(*a, **kw) -> None:  # ... and ends once the model state is complete
        report(*a, **kw)  # creates the optimizer state the first step would
        prof.stop()
        marks["setup_tensors"] = _peak_tensor_bytes(prof)
        gc.collect()
        marks["setup_peak"] = _vm("VmHWM")
        marks["start"] = _vm("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak) to the current RSS

    build_module.build_run, trainer_module.memory_report = build_profiled, report_then_mark
    train(overrides(base, Path(run_dir), **layout))
    out = {"rank": dist.get_rank(), "peak_rss": _vm("VmHWM"), "rss_before": marks["before"],
           "rss_start": marks["start"], "setup_peak": marks["setup_peak"], "setup_tensors": marks["setup_tensors"]}
    run = Path(run_dir)
    if (run / "memory.json").exists():  # rank 0 writes the run's files
        out["memory"] = json.loads((run / "memory.json").read_text())["per_rank"]
        out["times"] = [json.loads(x)["step_time_s"] for x in (run / "metrics.jsonl").read_text().splitlines()][1:]
    return out


def _baseline(args: argparse.Namespace, names: list[str]) -> dict[str, float]:
    """The set-up ratios of the same layouts measured with another checkout's mpformer (a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, __file__, "--json", f"{tmp}/b.json", "--only", ",".join(names)]
        for key in ("hidden", "layers", "ffn", "vocab", "seq", "micro_batch", "steps", "rounds"):
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        env = {**os.environ, "PYTHONPATH": str(Path(args.baseline).resolve())}
        subprocess.run(argv, env=env, check=True, stdout=sys.stderr)
        results = json.loads(Path(f"{tmp}/b.json").read_text())["results"]
    return {r["layout"]: r["setup_ratio"] for r in results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="1: each layout once; 2: forwards, then reversed")
    ap.add_argument("--only", help=f"comma-separated layouts (default all: {', '.join(LAYOUTS)})")
    ap.add_argument("--quick", action="store_true", help="a 4-layer h=384 model, one round")
    ap.add_argument("--baseline", help="a checkout (its root) whose set-up ratios to print alongside")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.ffn, args.rounds = 384, 4, 1024, 1
    names = args.only.split(",") if args.only else list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"--only {unknown}; valid: {', '.join(LAYOUTS)}")
    from mpformer.core.model_config import ModelConfig
    from mpformer.optim.memory import zero_formula_bytes

    psi = ModelConfig(arch="llama", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=12,
                      num_kv_heads=4, ffn_hidden_size=args.ffn, vocab_size=args.vocab).num_params()
    before = _baseline(args, names) if args.baseline else {}
    # glibc raises its mmap threshold after large frees and then keeps freed memory resident; a fixed
    # threshold makes every tensor buffer its own mapping, so resident memory follows live tensors.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    t0 = time.perf_counter()
    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        data = _make_data(Path(tmp), args.vocab)
        order = names if args.rounds == 1 else names + names[::-1]
        for k, name in enumerate(order):
            runs[name].append(run_distributed(_worker, 4, args=(args, data, f"{tmp}/{k}", LAYOUTS[name]),
                                              timeout=3600))
    times = {n: [t for ranks in runs[n] for t in ranks[0]["times"]] for n in names}
    base_time = statistics.median(times["zero 0"]) if times.get("zero 0") else None
    rows, payload = [], []
    for name in names:
        fields = LAYOUTS[name]
        tp = fields.get("parallel.tp", 1)
        counted = max(m["total"] for ranks in runs[name] for m in ranks[0]["memory"])
        formula = zero_formula_bytes(fields["parallel.zero"], psi / tp, 4 // tp, w=4, g=4, m=0, k=8)
        ranks = [r for rs in runs[name] for r in rs]
        held = max(r["rss_start"] - r["rss_before"] for r in ranks)
        peak = max(r["peak_rss"] - r["rss_before"] for r in ranks)
        setup = max(r["setup_peak"] - r["rss_before"] for r in ranks)
        tensors = max(r["setup_tensors"] for r in ranks)
        ratio = max(r["setup_tensors"] / rs[0]["memory"][r["rank"]]["total"] for rs in runs[name] for r in rs)
        step = statistics.median(times[name]) if times[name] else float("nan")  # the first step is not timed
        vs = step / base_time if base_time else float("nan")
        rows.append([name, formula / 2**20, counted / 2**20, counted / formula, held / 2**20, peak / 2**20,
                     setup / 2**20, tensors / 2**20, ratio, *([before[name]] if before else []), 1e3 * step, vs])
        payload.append({"layout": name, "overrides": fields, "formula_bytes": formula, "counted_bytes": counted,
                        "rss_held_bytes": held, "peak_training_bytes": peak, "peak_setup_rss_bytes": setup,
                        "peak_setup_tensor_bytes": tensors, "setup_ratio": ratio,
                        **({"setup_ratio_baseline": before[name]} if before else {}), "step_time_s": step,
                        "step_time_ratio_vs_zero0": vs})
    print(f"Llama h={args.hidden} L={args.layers} ffn={args.ffn} vocab={args.vocab}: {psi / 1e6:.1f}M parameters, "
          f"4 gloo ranks x 1 thread, fp32, {args.micro_batch}x{args.seq} tokens per dp rank per step")
    print("memory columns are per rank (the largest); RSS columns above the process's resident memory before the "
          "model was built; setup/state: the set-up tensor peak over the rank's model-state bytes (the largest rank)")
    print(format_table(["layout", "formula MiB", "counted MiB", "counted/formula", "held at start MiB",
                        "peak in steps MiB", "setup RSS MiB", "setup tensors MiB", "setup/state",
                        *(["setup/state before"] if before else []), "step ms", "step / zero 0"], rows))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, {"args": vars(args), "environment": environment(), "psi": psi, "results": payload})


if __name__ == "__main__":
    main()
