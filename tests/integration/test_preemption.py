"""Preemption and crashes: SIGTERM checkpoints and ends cleanly; SIGKILL at any instant of a save
leaves a checkpoint that ``checkpoint.load=auto`` resumes from exactly.

The oracle is the same run uninterrupted: a resumed run's losses must equal its, bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpformer.checkpoint.manifest import check_files, read_manifest
from mpformer.testing.cli import REPO, run_cli

PRETRAIN = "pretrain/pretrain_gpt.py"
# Long enough that a signal sent at step 3 lands before the run ends, even on a loaded 2-core machine
# (the tiny model's steps take milliseconds; 12 steps once finished before pgrep and kill did).
STEPS = 30


def _args(data: str, run_dir: Path, save_dir: Path, *extra: str) -> list[str]:
    return [PRETRAIN, "model=tiny-llama", "model.hidden_dropout=0.1", f"data.paths=[{data}]", "train.seq_length=32",
            f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2", "optim.lr=3e-3",
            "train.device=cpu", "logging.progress=false", f"hydra.run.dir={run_dir}",
            f"checkpoint.save_dir={save_dir}", *extra]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _start(args: list[str], torchrun: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
                              if torchrun else []) + args
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while len(_metrics(run_dir)) < step:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "the run did not reach its step in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def oracle(tiny_data, tmp_path_factory):
    """The uninterrupted run's metrics, per number of ranks (None: one plain process)."""
    runs: dict[int | None, list[dict]] = {}

    def get(ranks: int | None = None) -> list[dict]:
        if ranks not in runs:
            root = tmp_path_factory.mktemp("full")
            res = run_cli(_args(tiny_data, root / "run", root / "ck"), torchrun=ranks)
            assert res.returncode == 0, res.stderr[-3000:]
            runs[ranks] = _metrics(root / "run")
        return runs[ranks]
    return get


@pytest.fixture
def full(oracle) -> list[dict]:
    return oracle(None)


def test_auto_starts_fresh_then_resumes(tiny_data, tmp_path, full):
    """load=auto with an empty save_dir is a fresh run; with a checkpoint there, a resume."""
    first = run_cli(_args(tiny_data, tmp_path / "a", tmp_path / "ck", "checkpoint.load=auto", "train.stop_at=5"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "no checkpoint in" in first.stdout
    second = run_cli(_args(tiny_data, tmp_path / "b", tmp_path / "ck", "checkpoint.load=auto"))
    assert second.returncode == 0, second.stderr[-3000:]
    got = _metrics(tmp_path / "a") + _metrics(tmp_path / "b")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in full]


@pytest.mark.parametrize("ranks", [None, 2], ids=["1-process", "torchrun-2-ranks-one-signalled"])
def test_sigterm_checkpoints_at_the_next_step_and_resumes_exactly(tiny_data, tmp_path, oracle, ranks):
    run, ck = tmp_path / "run", tmp_path / "ck"
    proc = _start(_args(tiny_data, run, ck), torchrun=ranks)
    _wait_for_step(proc, run, 3)
    if ranks is None:
        proc.send_signal(signal.SIGTERM)
    else:  # one worker only: the ranks must agree to stop at the same step boundary
        worker = int(subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "pretrain_gpt"], capture_output=True,
                                    text=True).stdout.split()[-1])
        os.kill(worker, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    stopped = _metrics(run)
    last = stopped[-1]["step"]
    assert last < STEPS, "the run should have stopped early"
    assert (ck / "latest").read_text().strip() == f"step_{last:07d}"
    assert "SIGTERM: stopping after step" in out
    res = run_cli(_args(tiny_data, tmp_path / "resumed", ck, "checkpoint.load=auto"), torchrun=ranks)
    assert res.returncode == 0, res.stderr[-3000:]
    got = stopped + _metrics(tmp_path / "resumed")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in oracle(ranks)]


def test_sigkill_during_saves_resumes_from_the_newest_complete(tiny_data, tmp_path):
    """10 kills at random instants of a run that saves every step (every other one in the background):
    each kill's successor resumes (checkpoint.load=auto) from the newest complete checkpoint, and is the
    next trial's victim; every resumed step equals the uninterrupted run's, bit for bit."""
    steps, ck = 40, tmp_path / "ck"
    extra = ("checkpoint.save_interval=1", f"train.steps={steps}")
    res = run_cli(_args(tiny_data, tmp_path / "full", tmp_path / "ck_full", f"train.steps={steps}"))
    assert res.returncode == 0, res.stderr[-3000:]
    full = _metrics(tmp_path / "full")
    rng, newest = random.Random(0), 0
    for trial in range(11):
        run = tmp_path / f"run{trial}"
        args = _args(tiny_data, run, ck, *extra, "checkpoint.load=auto", f"checkpoint.async={trial % 2 == 1}")
        if trial == 10:  # the last one runs to the end
            res = run_cli(args)
            assert res.returncode == 0, res.stderr[-3000:]
        else:
            proc = _start(args)
            _wait_for_step(proc, run, 1)
            time.sleep(rng.uniform(0.0, 0.25))  # a few steps and saves: most instants fall inside a save
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        got = _metrics(run)
        assert got and got[0]["step"] == newest + 1, f"trial {trial}: resumed at {got[0]['step']}, newest {newest}"
        assert [m["loss"] for m in got] == [m["loss"] for m in full[newest:newest + len(got)]], f"trial {trial}"
        complete = [p for p in ck.glob("step_*") if (p / "manifest.json").is_file() and p.name[5:].isdigit()]
        newest = max(int(p.name[5:]) for p in complete) if complete else 0
    assert got[-1]["step"] == steps


def test_a_damaged_newest_checkpoint_is_named_and_auto_falls_back(tiny_data, tmp_path, oracle):
    """Under torchrun with 2 ranks, the damaged file rank 1's: the rank that hashes it is not the one that
    wrote it or rank 0, and every rank must take the same decision."""
    ck = tmp_path / "ck"
    res = run_cli(_args(tiny_data, tmp_path / "a", ck, "checkpoint.save_interval=4", "train.stop_at=8"), torchrun=2)
    assert res.returncode == 0, res.stderr[-3000:]
    victim = ck / "step_0000008" / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))
    named = run_cli(_args(tiny_data, tmp_path / "b", ck, f"checkpoint.load={ck / 'step_0000008'}"), torchrun=2)
    err = [x for x in named.stderr.splitlines() if x.strip() and x.startswith("error:")]
    assert named.returncode != 0 and len(err) == 1, named.stderr[-3000:]
    assert victim.name in err[0] and "sha256" in err[0], err[0]
    res = run_cli(_args(tiny_data, tmp_path / "c", ck, "checkpoint.load=auto"), torchrun=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert any(victim.name in x and "falling back to" in x for x in res.stderr.splitlines()), res.stderr[-3000:]
    got = _metrics(tmp_path / "c")
    assert got[0]["step"] == 5 and [m["loss"] for m in got] == [m["loss"] for m in oracle(2)[4:]]


@pytest.mark.parametrize("ranks", [None, 2], ids=["1-process", "torchrun-2-ranks"])
def test_background_saves_are_whole_and_resume_exactly(tiny_data, tmp_path, oracle, ranks):
    """checkpoint.async=true: every periodic save appears complete (manifest, checksums) and resumes exactly."""
    ck = tmp_path / "ck"
    res = run_cli(_args(tiny_data, tmp_path / "a", ck, "checkpoint.async=true", "checkpoint.save_interval=2",
                        "train.stop_at=7"), torchrun=ranks)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(in the background)" in res.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["latest"] + [f"step_{s:07d}" for s in (2, 4, 6, 7)]
    for s in (2, 4, 6):
        check_files(read_manifest(ck / f"step_{s:07d}"), checksums=True)
    res = run_cli(_args(tiny_data, tmp_path / "b", ck, f"checkpoint.load={ck / 'step_0000006'}"), torchrun=ranks)
    assert res.returncode == 0, res.stderr[-3000:]
    got = _metrics(tmp_path / "b")
    assert got[0]["step"] == 7 and [m["loss"] for m in got] == [m["loss"] for m in oracle(ranks)[6:]]


def test_sigterm_with_the_check_overlapping_the_next_step(tiny_data, tmp_path):
    """train.overlap_validation (training/overlap.py): the step in flight when SIGTERM is agreed is settled,
    logged and checkpointed; the stopped and resumed runs give the synchronous run's losses bit for bit
    (with dropout: a step that ran on an undone speculation runs again with the same streams)."""
    clip = "optim.clip_grad=1.4"  # this run's norms: 1.2-1.8, some steps clip (undone, redone), some do not
    overlap = ("train.post_validation=true", "train.overlap_validation=true", clip)
    synchronous = run_cli(_args(tiny_data, tmp_path / "sync", tmp_path / "sync_ck", clip))
    assert synchronous.returncode == 0, synchronous.stderr[-3000:]
    want = _metrics(tmp_path / "sync")
    assert any(m["grad_norm"] > 1.4 for m in want) and any(m["grad_norm"] <= 1.4 for m in want)
    run, ck = tmp_path / "run", tmp_path / "ck"
    proc = _start(_args(tiny_data, run, ck, *overlap))
    _wait_for_step(proc, run, 3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    stopped = _metrics(run)
    last = stopped[-1]["step"]
    assert last < STEPS and (ck / "latest").read_text().strip() == f"step_{last:07d}"
    assert f"SIGTERM: stopping after step {last}" in out
    res = run_cli(_args(tiny_data, tmp_path / "resumed", ck, "checkpoint.load=auto", *overlap))
    assert res.returncode == 0, res.stderr[-3000:]
    got = stopped + _metrics(tmp_path / "resumed")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in want]


def test_sigterm_under_overlap_logs_every_step_it_checkpoints(tiny_data, tmp_path, monkeypatch):
    """Under train.overlap_validation one call can settle two steps (the one in flight, then one settled at
    once for its checkpoint); a stop agreed on the first still logs the second, which the checkpoint holds.
    In process, the signal's flag set deterministically while step 4's forward/backward runs (one check
    later, under overlap, it is agreed): save_interval=4 settles step 4 at once in the same call."""
    from mpformer.cli.compose import compose_config
    from mpformer.cli.pretrain import run_pretraining
    from mpformer.training.step import Stepper

    forward_backward = Stepper.forward_backward

    def flagged(self, batches):
        if self.progress.consumed_samples == 3 * 4:  # step 4's samples (4 a step)
            self.preemption.requested = True
        return forward_backward(self, batches)

    monkeypatch.setattr(Stepper, "forward_backward", flagged)
    run, ck = tmp_path / "run", tmp_path / "ck"
    args = _args(tiny_data, run, ck, "train.post_validation=true", "train.overlap_validation=true",
                 "checkpoint.save_interval=4", "train.threads=1", "data.prefetch=0")[1:]
    run_pretraining(compose_config(args))
    saved = int((ck / "latest").read_text().strip().split("_")[1])
    assert saved < STEPS and [m["step"] for m in _metrics(run)] == list(range(1, saved + 1))
