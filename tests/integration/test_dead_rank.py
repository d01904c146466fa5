"""A rank that dies makes every rank on every node exit within 30 s, naming it (parallel/watchdog.py).

Two torchrun "nodes" of two workers each on localhost (static rendezvous, as a multi-node job
starts), training dp=4; rank 3 (node 1) is SIGKILLed mid-run. Node 0 hears of it only through the
heartbeat store: its ranks must still exit non-zero within 30 s with a line naming rank 3, long
before train.dist_timeout_s, and nothing of the run may be left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mpformer.parallel.spawn import free_port
from mpformer.testing.cli import REPO

DEADLINE_S = 30


def _workers(agent: int) -> dict[int, int]:
    """RANK -> pid of an agent's worker processes."""
    out = {}
    for pid in subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [e[5:] for e in env if e.startswith(b"RANK=")]
        if ranks:
            out[int(ranks[0])] = int(pid)
    return out


def test_sigkill_of_one_rank_stops_every_node(tiny_data, tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    args = ["pretrain/pretrain_gpt.py", "model=tiny-llama", f"data.paths=[{tiny_data}]", "train.seq_length=32",
            "train.steps=100000", "train.global_batch_size=8", "train.micro_batch_size=2", "train.device=cpu",
            "logging.progress=false", f"hydra.run.dir={run_dir}", "train.dist_timeout_s=300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                                f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
                                "--max-restarts=0", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
              for node in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert all(a.poll() is None for a in agents), [a.communicate()[1][-2000:] for a in agents]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        victim = _workers(agents[1].pid)[3]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        outs = []
        for a in agents:
            _, err = a.communicate(timeout=DEADLINE_S + 30)
            outs.append((time.monotonic() - killed, a.returncode, err))
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    for node, (took, code, err) in enumerate(outs):
        assert took < DEADLINE_S, f"node {node} took {took:.1f} s to stop:\n{err[-3000:]}"
        assert code != 0, f"node {node} exited 0"
    named = [line for line in outs[0][2].splitlines() if line.startswith("error: ") and "rank 3 (" in line]
    assert named, f"node 0 did not name rank 3:\n{outs[0][2][-3000:]}"
    assert "stopped beating" in named[0] and "last in step" in named[0], named[0]
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the run still alive: {left}"
