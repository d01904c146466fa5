"""The LM head's loss, fused and chunked (layers/fused_cross_entropy.py) vs logits then cross entropy.

One process, the head alone: hidden ``[n, h]`` (n = batch x seq tokens, 10% of labels -100) through a
``[v, h]`` weight to the mean loss, then backward (the hidden's gradient and the weight's). The
unfused candidate is the model's old path: ``linear`` (with its CPU bf16 backward) and
``F.cross_entropy(logits.float())``. bf16 is autocast around the forward with fp32 weights, as the
trainer runs it. Memory is read from torch's allocator events (the profiler's memory records: every
allocation and free on the CPU, in order), relative to the inputs already alive:

    kept after forward   bytes the forward leaves alive (what backward holds on to: activations)
    peak fwd+bwd         the highest point of the running sum over forward and backward (transients)

Times are medians over rounds that alternate the candidates' order (common.interleave), one
forward + backward each, as wall time and as the process's CPU time (with ``--threads 1`` the CPU
time is the compute itself, what a shared, oversubscribed machine still measures fairly); a
profiled run measures the memory, outside the timing. ``|loss diff|`` and ``grad rel diff`` (the
largest |difference| over the largest |element|, dX and dW) are against the unfused candidate.

    python benchmarks/bench_cross_entropy.py [--tokens 2048 --hidden 512 --vocab 32000]
        [--chunks 256 512 1024 2048 4096] [--precision fp32 bf16] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, interleave, median, quartiles, write_json

from mpformer.layers.fused_cross_entropy import fused_linear_cross_entropy
from mpformer.layers.linear import linear

MB = 2**20


def _inputs(n: int, h: int, v: int) -> tuple[torch.Tensor, torch.nn.Parameter, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).requires_grad_()
    w = torch.nn.Parameter(torch.randn(v, h, generator=g) * 0.02)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.1] = -100
    return x, w, labels


def _candidate(chunk: int | None, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
               bf16: bool) -> Callable[[], torch.Tensor]:
    """Forward of the mean loss (chunk None: unfused); autocast bf16 around it when asked."""
    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            if chunk is None:
                return F.cross_entropy(linear(x, w).float(), labels, ignore_index=-100)
            return fused_linear_cross_entropy(x, w, labels, chunk=chunk) / (labels != -100).sum()
    return forward


def _step(forward: Callable[[], torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x.grad = w.grad = None
    loss = forward()
    loss.backward()
    return loss.detach()


def _timed(forward: Callable[[], torch.Tensor], x: torch.Tensor, w: torch.Tensor,
           cpu_log: list[float]) -> Callable[[], list[float]]:
    """One timed forward + backward: returns its wall time, appends its process CPU time to ``cpu_log``."""
    def unit() -> list[float]:
        t0, c0 = time.perf_counter(), time.process_time()
        _step(forward, x, w)
        cpu_log.append(time.process_time() - c0)
        return [time.perf_counter() - t0]
    return unit


def _alloc_events(fn: Callable[[], object]) -> tuple[object, list[int]]:
    """``fn()`` under the profiler: its result and every allocation (+bytes) and free (-bytes), in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    return result, [b for _, b in events]


def _peak(deltas: list[int], start: int = 0) -> tuple[int, int]:
    """(highest running sum, final sum) of ``deltas`` from ``start``."""
    live = peak = start
    for d in deltas:
        live += d
        peak = max(peak, live)
    return peak, live


def _memory(forward: Callable[[], torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """(kept after forward, peak over forward + backward), bytes over the live inputs."""
    x.grad = w.grad = None
    loss, fwd = _alloc_events(forward)
    fwd_peak, kept = _peak(fwd)
    _, bwd = _alloc_events(loss.backward)
    bwd_peak, _ = _peak(bwd, kept)
    return float(kept), float(max(fwd_peak, bwd_peak))


def run(a: argparse.Namespace) -> dict:
    x, w, labels = _inputs(a.tokens, a.hidden, a.vocab)
    out: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                 "environment": environment(), "results": []}
    for precision in a.precision:
        bf16 = precision == "bf16"
        names = {"unfused": None, **{f"fused c={c}": c for c in a.chunks}}
        fwd = {name: _candidate(c, x, w, labels, bf16) for name, c in names.items()}
        ref_loss, losses = _step(fwd["unfused"], x, w), {}
        ref_grads = (x.grad.clone(), w.grad.clone())
        errs = {}
        for name in names:  # warm-up, and the gradients against the unfused path
            losses[name] = _step(fwd[name], x, w).item()
            errs[name] = max((g - r).abs().max().item() / r.abs().max().item()
                             for g, r in zip((x.grad, w.grad), ref_grads))
        mem = {name: _memory(fwd[name], x, w) for name in names}

        cpu: dict[str, list[float]] = {name: [] for name in names}
        times = interleave({name: _timed(fwd[name], x, w, cpu[name]) for name in names}, a.rounds)
        base_t, base_cpu, (_, base_peak) = median(times["unfused"]), median(cpu["unfused"]), mem["unfused"]
        rows = []
        for name in names:
            t, c, (kept, peak) = median(times[name]), median(cpu[name]), mem[name]
            q1, q3 = quartiles(times[name])
            rows.append([name, precision, f"{kept / MB:.1f}", f"{peak / MB:.1f}", f"{base_peak / peak:.2f}",
                         f"{t * 1e3:.0f}", f"{q1 * 1e3:.0f}-{q3 * 1e3:.0f}", f"{base_t / t:.2f}", f"{c * 1e3:.0f}",
                         f"{base_cpu / c:.2f}", f"{abs(losses[name] - ref_loss.item()):.1e}", f"{errs[name]:.1e}"])
            out["results"].append({"candidate": name, "chunk": names[name], "precision": precision,
                                   "kept_after_forward_bytes": kept, "peak_bytes": peak, "time_s": times[name],
                                   "cpu_time_s": cpu[name], "loss": losses[name],
                                   "max_rel_grad_diff_vs_unfused": errs[name]})
        print(f"\nhead: {a.tokens} tokens x hidden {a.hidden} -> vocab {a.vocab}, {precision}; forward + backward; "
              f"memory over the live inputs (x {x.numel() * 4 / MB:.1f} MiB, W {w.numel() * 4 / MB:.1f} MiB fp32)")
        print(format_table(["candidate", "dtype", "kept after fwd MiB", "peak fwd+bwd MiB", "peak: unfused / this",
                            "wall ms", "wall ms q1-q3", "wall: unfused / this", "cpu ms", "cpu: unfused / this",
                            "|loss diff|", "grad rel diff"], rows))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="batch x seq (default 4 x 512)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = run(a)
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
