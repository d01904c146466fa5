"""Run the repository's scripts as a user would, for end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], *, timeout: float = 120, torchrun: int | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` from the repository root (under torchrun with N CPU ranks if asked);
    one thread per rank so that several ranks share this machine's cores without thrashing."""
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd + args, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


def run_clis(cases: list[list[str]], *, timeout: float = 120,
             jobs: int = 2) -> list[tuple[subprocess.CompletedProcess, float]]:
    """``run_cli`` over many argument lists, ``jobs`` at a time (each process has one thread, so two
    share a 2-core machine without slowing each other); each result with its own wall time in seconds."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    def one(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        res = run_cli(args, timeout=timeout)
        return res, time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, cases))
