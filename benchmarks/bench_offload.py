"""Activation offload on one pipeline rank: its activation peak and step time with offload none, auto, all.

    python benchmarks/bench_offload.py [--device auto] [--pp 4] [--microbatches 8] [--json F]

One process runs rank 0 of a ``--pp``-stage 1F1B pipeline (the rank that holds the most micro-batches
in flight: p) through the real PipelineEngine; its neighbours are a stand-in P2P that answers every
receive with a random tensor of the boundary's shape at once, so the rank computes back to back as a
rank whose messages are always in time. Per mode, after one untimed step, the median of ``--steps``:

* step time, and its ratio to offload=none (where the copies hide behind the compute, near 1);
* activation peak during the step above the bytes held before it (parameters, gradients), in
  micro-batches of none's (whose peak holds min(p, m) of them): on CUDA the allocator's
  ``max_memory_allocated``; on CPU, whose allocator keeps no count, parallel/memory_meter.py's
  StorageMeter over one more step (it slows the ops it sees, so that step is not timed). On a CPU the
  copies to "host" run on HostCopies' thread into memory the meter does not count, as pinned host
  memory is not device memory: the figure is the device memory the engine's offload leaves in use.

On CPU the copies can only overlap the compute if they have a core of their own (a GPU's copy engines
are their own hardware): ``--threads`` (default: every core but one on CPU) sets the compute's
intra-op threads for every mode alike.

The issue's target (17): at p = 4, all holds at most 1.5 micro-batches and costs at most 10% where the
copies overlap. benchmarks/gpu_check.sh runs this on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.pipeline_plan import stage_plan
from mpformer.models.parallelize import build_model
from mpformer.parallel.device import Device, HostCopies, resolve_device
from mpformer.parallel.memory_meter import PeakMemory
from mpformer.pipeline.engine import PipelineEngine
from mpformer.pipeline.offload import ActivationOffload, offload_units
from mpformer.pipeline.schedules import build_schedule
from mpformer.testing.loopback import LoopbackP2P

MODES = (("none", 1), ("auto", 1), ("all", 1))


def run(args: argparse.Namespace, device: Device) -> list[dict]:
    cfg = ModelConfig(arch="llama", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      num_kv_heads=args.heads // 2, ffn_hidden_size=args.hidden * 11 // 4, vocab_size=args.vocab)
    dtype = torch.bfloat16 if device.kind == "cuda" else torch.float32
    layout = ParallelLayout(dp=1, pp=args.pp)
    plan = stage_plan(cfg, layout, 0, args.seq)
    schedule = build_schedule("1f1b", args.pp, args.microbatches)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.microbatches):
        tok = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device.torch_device)
        batches.append((tok[:, :-1], tok[:, 1:]))
    out = []
    for mode, keep in MODES:
        model = build_model(cfg, tp=None, device=device.torch_device, seed=1, stage=plan).to(dtype)
        units = offload_units(schedule.actions[0], mode, keep)
        offload = ActivationOffload(HostCopies(device), model, units) if mode != "none" else None
        p2p = LoopbackP2P((args.seq, args.batch, args.hidden), dtype, device.torch_device)
        engine = PipelineEngine(model, plan, schedule, p2p, offload=offload)
        times = []
        for step in range(args.steps + 1):  # the first untimed
            model.zero_grad(set_to_none=False)
            device.synchronize()
            t0 = time.perf_counter()
            engine.run(batches)
            device.synchronize()
            if step:
                times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=False)
        with PeakMemory(device) as peak:
            engine.run(batches)
        moved = offload.moved_bytes if offload is not None else 0
        out.append({"mode": mode if mode != "auto" else f"auto (keep {keep})", "units_moved": len(units),
                    "step_s": statistics.median(times), "activation_peak_bytes": peak.peak, "moved_bytes": moved})
        del engine, model, offload
    base_t = out[0]["step_s"]
    base_peak = out[0]["activation_peak_bytes"]
    held = min(args.pp, args.microbatches)
    for r in out:
        r["step_ratio"] = r["step_s"] / base_t
        r["peak_microbatches"] = r["activation_peak_bytes"] / (base_peak / held)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16, help="of the whole model (rank 0 holds layers / pp)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, help="the compute's intra-op threads (default: on CPU every "
                    "core but one, for the copies; on CUDA torch's default)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    device = resolve_device(args.device)
    if args.threads is None and device.kind == "cpu":
        args.threads = max(1, (os.cpu_count() or 2) - 1)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    env = environment()
    print(f"cpu: {env['cpu_model']} ({env['cpu_capability']}) | device: {device.name()} | torch {env['torch']}")
    print(f"rank 0 of pp={args.pp} 1f1b, {args.microbatches} micro-batches of {args.batch}x{args.seq}, Llama "
          f"h={args.hidden} {args.layers // args.pp} layers on the rank, {torch.get_num_threads()} compute threads")
    rows = run(args, device)

    def mib(x: float) -> str:
        return f"{x / 2**20:.0f}"

    print(format_table(["offload", "units moved", "step ms", "step / none", "activation peak MiB",
                        "peak (micro-batches)", "moved MiB"],
                       [[r["mode"], r["units_moved"], 1e3 * r["step_s"], r["step_ratio"],
                         mib(r["activation_peak_bytes"]),
                         f"{r['peak_microbatches']:.2f}",
                         mib(r["moved_bytes"])] for r in rows]))
    if args.json:
        write_json(args.json, {"args": vars(args), "environment": env, "device": device.name(), "results": rows})


if __name__ == "__main__":
    main()
