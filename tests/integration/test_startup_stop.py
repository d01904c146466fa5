"""SIGTERM during start-up (data, checkpoint load, process groups, compile, the first step) ends the run at
once with one line and no checkpoint; after the first step it waits for the step boundary and saves
(test_preemption.py). A start-up is made slow by a driver that patches one of its phases: the main thread
stuck in a C wait that ignores signals (as a collective waiting for a lost rank is), or a first step that
takes long (as compile makes it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpformer.testing.cli import REPO

MARK = "test: start-up is slow here"
LINE = "SIGTERM during start-up (before the first training step finished): stopped at once, nothing to save"
# Phases made slow, each announcing itself on stdout first (then the test sends SIGTERM).
SLOW = {
    # the main thread in a C wait that ignores signals, the GIL released (as in a collective waiting for a
    # rank that is gone): a mutex locked twice. Only the wakeup thread can end the process.
    "build": ("import ctypes\nimport mpformer.training.build as m\nreal = m.build_run\n"
              "def slow(*a, **k):\n    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER\n"
              "    lock = ctypes.CDLL(None).pthread_mutex_lock\n    lock(mutex)\n    print(MARK, flush=True)\n"
              "    lock(mutex)\n    return real(*a, **k)\n"
              "m.build_run = slow\n"),
    "first step": ("import mpformer.training.trainer as m\nreal = m.Trainer.train_step\n"
                   "def slow(self):\n    print(MARK, flush=True)\n    time.sleep(120)\n    return real(self)\n"
                   "m.Trainer.train_step = slow\n"),
}


def _driver(tmp: Path, phase: str) -> Path:
    path = tmp / "slow_start.py"
    path.write_text(f"import sys, time\nMARK = {MARK!r}\n{SLOW[phase]}\nfrom mpformer.cli.pretrain import main\n"
                    "sys.exit(main(sys.argv[1:]))\n")
    return path


def _args(data: str, run: Path) -> list[str]:
    return ["model=tiny-llama", f"data.paths=[{data}]", "train.seq_length=32", "train.steps=5",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.device=cpu", "logging.progress=false",
            f"hydra.run.dir={run}", f"checkpoint.save_dir={run / 'ck'}"]


def _start(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for_mark(proc: subprocess.Popen, marks: int = 1, timeout: float = 120) -> None:
    deadline, seen = time.monotonic() + timeout, 0
    while seen < marks:
        line = proc.stdout.readline()
        assert line, f"the run ended before its slow start-up: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "the slow start-up was not reached in time"
        seen += MARK in line


def _stop(proc: subprocess.Popen, pid: int) -> tuple[float, str]:
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return time.monotonic() - t0, err


@pytest.mark.parametrize("phase", list(SLOW))
def test_sigterm_during_startup_ends_at_once_in_one_line(tiny_data, tmp_path, phase):
    run = tmp_path / "run"
    proc = _start([sys.executable, str(_driver(tmp_path, phase)), *_args(tiny_data, run)])
    _wait_for_mark(proc)
    took, err = _stop(proc, proc.pid)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert took < 10, f"took {took:.1f} s"
    assert [x for x in err.splitlines() if x.strip()] == [LINE], err[-3000:]
    assert not (run / "ck").exists(), "no checkpoint"
    metrics = run / "metrics.jsonl"
    assert not metrics.is_file() or not metrics.read_text().strip(), "no step logged"


@pytest.mark.slow
@pytest.mark.parametrize("signalled", ["agent", "one worker"])
def test_torchrun_ranks_all_stop_during_startup(tiny_data, tmp_path, signalled):
    """torchrun forwards the signal to every worker, each stuck in the C wait (as a rank inside a collective
    would be): each ends at once with its line. One worker signalled alone: it ends, and torchrun stops the
    other (with SIGTERM: the same line). Nothing is saved."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(_driver(tmp_path, "build")), *_args(tiny_data, run), "parallel.dp=2"]
    proc = _start(cmd)
    _wait_for_mark(proc, marks=2)
    pid = proc.pid
    if signalled == "one worker":
        pid = int(subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "slow_start"], capture_output=True,
                                 text=True).stdout.split()[-1])
    took, err = _stop(proc, pid)
    assert proc.returncode != 0, err[-3000:]
    assert took < 10, f"took {took:.1f} s"
    # (torchrun's agent prints its own traceback of the signal it got; the workers print one line each)
    assert all(f"rank {r}: {LINE}" in err for r in (0, 1)), err[-3000:]
    assert not (run / "ck").exists()
