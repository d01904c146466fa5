"""Context-parallel attention kernels against one process's SDPA at long sequences (fp32, CPU threads).

    python benchmarks/bench_cp_kernels.py [--seq 16384] [--reps 3] [--json F]     # ~3 min at 16k

One attention layer's forward + backward (heads 8/2 kv, head dim 32 by default: the h=256 model of
bench_context_parallel.py) per rank, one thread per rank, against cp=1's SDPA (one process, one
thread) in the same run, for every cp kind at cp = 2 and 4. Per layout, the slowest rank's median:

    wall s     the rank's elapsed time (with more ranks than cores it also counts the other ranks' turns)
    CPU s      the thread's CPU time: the rank's own work whatever the core count (gloo's waits sleep)
    error      the largest error of the output and of dq, dk, dv (summed over ranks) against SDPA's over
               the whole sequence, over the largest element of each

The cp kernels run the blocks of the attention plan (core/attention_plan.py) on the fused kernel with
its log-sum-exp (context_parallel/fused.py); cp=1 is torch's SDPA on the whole causal sequence.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, median, write_json

from mpformer.parallel.spawn import run_distributed


def _kernel_inputs(seq: int, heads: int, kv: int, d: int):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, seq, d, generator=gen) for n in (heads, kv, kv))
    return q, k, v, torch.randn(1, heads, seq, d, generator=gen)


def _sdpa_worker(seq: int, heads: int, kv: int, d: int, reps: int) -> dict:
    torch.set_num_threads(1)
    q, k, v, g = _kernel_inputs(seq, heads, kv, d)
    wall, cpu = [], []
    for r in range(reps + 1):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        t0, c0 = time.perf_counter(), time.thread_time()
        torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True).backward(g)
        if r:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    return {"wall": wall, "cpu": cpu}


def _kernel_worker(seq: int, heads: int, kv: int, d: int, kind: str, u: int, reps: int) -> dict:
    """One rank's forward + backward of one attention layer at ``seq`` tokens, timed; then its parity
    against SDPA over the whole sequence (computed on each rank: the same tensors everywhere)."""
    from mpformer.context_parallel.context import SeqShard, attention
    from mpformer.core.layout import ParallelLayout
    from mpformer.core.sequence import positions
    from mpformer.models.parallelize import cp_context
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups

    torch.set_num_threads(1)
    cp = int(os.environ["WORLD_SIZE"])
    layout = ParallelLayout(dp=1, cp=cp, cp_kind=kind, cp_ulysses=u)
    ctx = cp_context(layout, ProcessGroups.build(layout, Device("cpu")))
    segs = ctx.segments(seq)
    index = torch.tensor(positions(segs))
    q, k, v, g = _kernel_inputs(seq, heads, kv, d)
    wall, cpu = [], []
    for r in range(reps + 1):
        local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = attention(*local, ctx, SeqShard(seq, segs, index), None, d ** -0.5)
        out.backward(g[:, :, index])
        if r:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    want.backward(g)
    errs = {"out": float((out - want[:, :, index]).abs().max() / want.abs().max())}
    for name, x, r in zip(("dq", "dk", "dv"), local, ref):
        # dk, dv: this rank's share of its own keys' gradients is not the whole, so the ranks' parts
        # are summed first (an all-reduce of the full-length gradients placed at their positions)
        full = torch.zeros_like(r.grad)
        full[:, :, index] = x.grad
        if name != "dq":
            torch.distributed.all_reduce(full)
        errs[name] = float((full[:, :, index] - r.grad[:, :, index]).abs().max() / r.grad.abs().max())
    return {"wall": wall, "cpu": cpu, "errors": errs}


KERNEL_KINDS = [(2, "ring", 1), (2, "allgather", 1), (2, "ulysses", 1), (4, "ring", 1), (4, "allgather", 1),
                (4, "ulysses", 1), (4, "hybrid", 2)]


def _kernels(a: argparse.Namespace, payload: dict) -> None:
    seq, heads, kv, d = a.seq, a.heads, a.kv_heads, a.hidden // a.heads
    base = run_distributed(_sdpa_worker, 1, args=(seq, heads, kv, d, a.reps), timeout=1800)[0]
    b_wall, b_cpu = median(base["wall"]), median(base["cpu"])
    rows = [["cp=1 SDPA", f"{b_wall:.2f}", "1.00", f"{b_cpu:.2f}", "1.00", "-"]]
    payload["kernels"] = {"seq": seq, "heads": heads, "kv_heads": kv, "head_dim": d, "reps": a.reps,
                          "sdpa": base, "kinds": []}
    for cp, kind, u in KERNEL_KINDS:
        r = run_distributed(_kernel_worker, cp, args=(seq, heads, kv, d, kind, u, a.reps), timeout=1800)
        wall, cpu = max(median(x["wall"]) for x in r), max(median(x["cpu"]) for x in r)
        err = max(e for x in r for e in x["errors"].values())
        label = f"cp={cp} {kind}" + (f" u={u}" if kind == "hybrid" else "")
        rows.append([label, f"{wall:.2f}", f"{wall / b_wall:.2f}", f"{cpu:.2f}", f"{cpu / b_cpu:.2f}", f"{err:.1e}"])
        payload["kernels"]["kinds"].append({"cp": cp, "kind": kind, "ulysses": u, "ranks": r})
    print(f"cp kernels, one attention layer forward + backward at {seq} tokens (heads {heads}/{kv}, d {d}, fp32), "
          f"one thread per rank, slowest rank, median of {a.reps}")
    print(format_table(["layout", "wall s", "vs cp=1", "CPU s", "vs cp=1", "max error / max |ref|"], rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    env = environment()
    print(f"CPU: {env['cpu_model']} ({env['cpu_capability']}), {env['cpu_count']} cores, torch {env['torch']}")
    payload: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                     "environment": env}
    _kernels(a, payload)
    if a.json:
        write_json(a.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
