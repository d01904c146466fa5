"""train.on_nan: a step whose loss is not finite is skipped, halts the run, or rolls it back.

The trainer runs in this process (one rank, no torchrun) with a NaN injected into the loss of the
step that reads sample position POISON; its backward then makes every gradient NaN too. The
oracle is a run that never sees those samples (data.skip_ranges): with a constant learning rate,
no dropout and Adam's step count unchanged by a skipped update, every later step of the
guarded run must equal that run's, bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mpformer.cli.compose import compose_config
from mpformer.cli.pretrain import main, run_pretraining
from mpformer.core.errors import EXIT_HALTED
from mpformer.training.step import Stepper

GBS = 4
POISON_STEP = 5  # 1-based: the step whose samples start at position (POISON_STEP - 1) * GBS
POISON = (POISON_STEP - 1) * GBS


def _args(data: str, run_dir: Path, *extra: str) -> list[str]:
    return ["model=tiny-llama", f"data.paths=[{data}]", "train.seq_length=32", "train.steps=8",
            f"train.global_batch_size={GBS}", "train.micro_batch_size=2", "optim.lr=3e-3", "optim.decay=constant",
            "train.device=cpu", "train.threads=1", "data.prefetch=0", "logging.progress=false",
            f"hydra.run.dir={run_dir}", *extra]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def poisoned(monkeypatch):
    """The loss of the step reading sample POISON is multiplied by NaN; yields the positions it hit."""
    hits: list[int] = []
    original = Stepper.forward_backward

    def forward_backward(self, batches):
        if self.progress.consumed_samples != POISON:
            return original(self, batches)
        hits.append(self.progress.consumed_samples)
        model = self.model
        plain = model.forward
        model.forward = lambda *a, **k: plain(*a, **k) * float("nan")
        try:
            return original(self, batches)
        finally:
            model.forward = plain

    monkeypatch.setattr(Stepper, "forward_backward", forward_backward)
    return hits


@pytest.fixture(scope="module")
def oracle(tiny_data, tmp_path_factory) -> list[dict]:
    """The same run with the poisoned step's samples never read: one step fewer."""
    run = tmp_path_factory.mktemp("oracle")
    run_pretraining(compose_config(_args(tiny_data, run, f"data.skip_ranges=[[{POISON},{POISON + GBS}]]",
                                         "train.steps=7")))
    return _metrics(run)


def test_skip_leaves_the_weights_and_continues(tiny_data, tmp_path, poisoned, oracle):
    run_pretraining(compose_config(_args(tiny_data, tmp_path, "train.on_nan=skip")))
    m = _metrics(tmp_path)
    assert poisoned == [POISON]
    assert [r["step"] for r in m] == list(range(1, 9))
    bad = m[POISON_STEP - 1]
    assert bad.get("skipped") == 1 and bad["skipped_steps"] == 1 and not math.isfinite(bad["loss"])
    assert m[-1]["skipped_steps"] == 1
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(m) if i != POISON_STEP - 1)
    # Before: the same steps; after: the oracle's, one step later (the skipped update changed nothing).
    assert [r["loss"] for r in m[:POISON_STEP - 1]] == [r["loss"] for r in oracle[:POISON_STEP - 1]]
    assert [r["loss"] for r in m[POISON_STEP:]] == [r["loss"] for r in oracle[POISON_STEP - 1:]]


def test_halt_exits_3_in_one_line(tiny_data, tmp_path, poisoned, capsys):
    with pytest.raises(SystemExit) as e:
        main(_args(tiny_data, tmp_path, "train.on_nan=halt"))
    assert e.value.code == EXIT_HALTED
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("error: step 5: loss nan"), err
    assert f"data.skip_ranges=[[{POISON},{POISON + GBS}]]" in err[0]
    assert len(_metrics(tmp_path)) == POISON_STEP - 1  # nothing logged for the bad step


def test_rollback_reloads_and_skips_the_samples(tiny_data, tmp_path, poisoned, oracle):
    run_pretraining(compose_config(_args(tiny_data, tmp_path, "train.on_nan=rollback",
                                         "checkpoint.save_interval=3")))
    m = _metrics(tmp_path)
    assert poisoned == [POISON]
    # Steps 1-4 ran, step 5 failed and rolled back to step 3's checkpoint; steps 4-8 ran past the samples.
    assert [r["step"] for r in m] == [1, 2, 3, 4, 4, 5, 6, 7, 8]
    assert [r["loss"] for r in m[:4]] == [r["loss"] for r in oracle[:4]]
    assert [r["loss"] for r in m[4:]] == [r["loss"] for r in oracle[3:]] + [m[-1]["loss"]]
    manifest = json.loads((tmp_path / "checkpoints" / "step_0000008" / "manifest.json").read_text())
    assert manifest["trainer"]["skip_ranges"] == [[POISON, POISON + GBS]] and manifest["trainer"]["rollbacks"] == 1


def test_rollback_without_a_checkpoint_halts(tiny_data, tmp_path, poisoned, capsys):
    with pytest.raises(SystemExit) as e:
        main(_args(tiny_data, tmp_path, "train.on_nan=rollback"))
    assert e.value.code == EXIT_HALTED
    assert "found no checkpoint" in capsys.readouterr().err


def test_a_grad_norm_spike_is_a_bad_step_too(tiny_data, tmp_path, monkeypatch):
    """train.spike_factor: a step whose loss (so gradient) is scaled by 1000 is skipped like a NaN one."""
    step, gbs = 12, GBS
    position = (step - 1) * gbs
    original = Stepper.forward_backward

    def forward_backward(self, batches):
        if self.progress.consumed_samples != position:
            return original(self, batches)
        plain = self.model.forward
        self.model.forward = lambda *a, **k: plain(*a, **k) * 1000.0
        try:
            return original(self, batches)
        finally:
            self.model.forward = plain

    common = ("train.steps=14", "optim.clip_grad=0")
    run_pretraining(compose_config(_args(tiny_data, tmp_path / "oracle", *common, "train.steps=13",
                                         f"data.skip_ranges=[[{position},{position + gbs}]]")))
    monkeypatch.setattr(Stepper, "forward_backward", forward_backward)
    run_pretraining(compose_config(_args(tiny_data, tmp_path / "run", *common, "train.on_nan=skip",
                                         "train.spike_factor=20")))
    m, oracle = _metrics(tmp_path / "run"), _metrics(tmp_path / "oracle")
    assert [r.get("skipped", 0) for r in m] == [0] * (step - 1) + [1, 0, 0]
    assert math.isfinite(m[step - 1]["loss"])  # finite, but a spike
    assert [r["loss"] for r in m[:step - 1]] == [r["loss"] for r in oracle[:step - 1]]
    assert [r["loss"] for r in m[step:]] == [r["loss"] for r in oracle[step - 1:]]
