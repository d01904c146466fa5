"""Helpers shared by the benchmarks: interleaved timing, matmul peak, table printing, JSON output.

Benchmarks run on shared machines, so candidates are never timed in one long block each: every
round runs each candidate once, in an order that alternates between rounds (A B, B A, A B, ...), and
results are medians over rounds. A background job that starts or stops halfway then slows every
candidate about equally instead of one of them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

# GEMM operand layouts as BLAS sees them: in training, F.linear's forward is x @ W^T ("nt"), its
# input gradient dy @ W ("nn") and its weight gradient dy^T @ x ("tn"). CPU bf16 kernels differ by
# more than 10x between these, so the peak is taken over all three and each is reported.
LAYOUTS = ("nn", "nt", "tn")


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    """25th and 75th percentiles (the spread reported next to a median)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def interleave(candidates: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, list[float]]:
    """Run every candidate once per round, alternating the order between rounds.

    Each callable runs one timed unit (for example k training steps) and returns its sample times;
    the result concatenates them per candidate. Round r runs the candidates forwards when r is even
    and backwards when odd, so neither always runs first (caches, turbo, a neighbour's job).
    """
    names = list(candidates)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            out[name].extend(candidates[name]())
    return out


def _gemm(n: int, layout: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    # .t() of a square contiguous tensor is a strided view: BLAS gets the transposed flag, no copy.
    lhs = a.t() if layout[0] == "t" else a
    rhs = b.t() if layout[1] == "t" else b
    return lambda: torch.mm(lhs, rhs)


def matmul_flops(dtype: torch.dtype, sizes: Sequence[int], *, min_time_s: float = 0.2,
                 max_reps: int = 20) -> dict[str, float]:
    """FLOP/s of square GEMMs, keyed "n{size}_{layout}" (best repetition of each: a peak, not a mean).

    Each shape is repeated until ``min_time_s`` has passed (at least two repetitions after a warm-up)
    so that slow dtypes do not take minutes while fast ones get enough samples.
    """
    out: dict[str, float] = {}
    for n in sizes:
        for layout in LAYOUTS:
            fn = _gemm(n, layout, dtype)
            fn()  # warm-up: oneDNN/MKL pick and cache kernels on first call
            best, spent, reps = float("inf"), 0.0, 0
            while reps < 2 or (spent < min_time_s and reps < max_reps):
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                best, spent, reps = min(best, dt), spent + dt, reps + 1
            out[f"n{n}_{layout}"] = 2.0 * n**3 / best
    return out


def merge_peaks(*runs: dict[str, float]) -> dict[str, float]:
    """Element-wise max of several ``matmul_flops`` results (peaks measured before and after)."""
    keys = runs[0].keys()
    return {k: max(r[k] for r in runs) for k in keys}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, columns right-aligned except the first two."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        return " | ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0.0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def cpu_model() -> str:
    """The CPU's name as the kernel reports it (machines of one kind differ: AVX2-only EPYC, AMX Xeons)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    """The commit the numbers were measured on, "+dirty" when the tree had uncommitted changes (to code:
    results files written beside it do not count)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, threads, the CPU's vector ISA as torch sees it, and where
    they came from (the commit and the command line)."""
    env: dict[str, Any] = {
        "commit": git_commit(),
        "command": " ".join([Path(sys.argv[0]).name if sys.argv else "", *sys.argv[1:]]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": cpu_model(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # benchmarks that do not compare against HF need not have it
        pass
    return env


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, creating parent folders; with the environment (the CPU, the
    commit, the command) added when the payload does not carry it, so every result file names them."""
    if "environment" not in payload and "env" not in payload:
        payload = {**payload, "environment": environment()}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")

