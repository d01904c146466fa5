"""Where a run stands, as a checkpoint keeps it: optimizer steps taken, samples consumed (the data
position: the sampler is a pure function of it), the wandb run it logs to, and the data it reads
(a resume must continue the same sample stream; preflight checks it).

Skip ranges ``[start, end)`` of the sample stream are never trained on: when the position reaches
a start it jumps to the end. They come from ``data.skip_ranges`` and from rollbacks (a step whose
loss was not finite, training/guard.py), and are kept in the checkpoint, so a later resume skips
them too. Steps whose update was skipped (``train.on_nan=skip``) and rollbacks are counted."""

from __future__ import annotations

import uuid
from typing import Any

from mpformer.core.config import Config


class Progress:
    def __init__(self, skip_ranges: list[list[int]] | None = None) -> None:
        self.step = 0
        self.consumed_samples = 0
        self.wandb_run_id: str | None = None
        self.run_id = uuid.uuid4().hex  # a fresh run's; a resume takes the checkpoint's (keep prunes only its own)
        self.skip_ranges: list[tuple[int, int]] = []
        self.skipped_steps = 0  # updates not applied (a non-finite loss or grad norm under on_nan=skip)
        self.rollbacks = 0
        self.recent_grad_norms: list[float] = []  # of the last good steps (train.spike_factor)
        for a, b in skip_ranges or []:
            self.add_skip(a, b)

    def advance(self, samples: int) -> None:
        """One optimizer step of ``samples`` samples."""
        self.step += 1
        self.consumed_samples += samples

    def add_skip(self, start: int, end: int) -> None:
        if (start, end) not in self.skip_ranges:
            self.skip_ranges = sorted([*self.skip_ranges, (int(start), int(end))])

    def position(self) -> int:
        """The data position of the next step: ``consumed_samples`` moved past every skip range it is in."""
        moved = True
        while moved:
            moved = False
            for a, b in self.skip_ranges:
                if a <= self.consumed_samples < b:
                    self.consumed_samples, moved = b, True
        return self.consumed_samples

    def adopt_wandb(self, run_id: str | None) -> None:
        self.wandb_run_id = run_id

    def state(self, cfg: Config) -> dict[str, Any]:
        t = cfg.train
        return {"step": self.step, "consumed_samples": self.consumed_samples, "wandb_run_id": self.wandb_run_id,
                "run_id": self.run_id,
                "skip_ranges": [list(r) for r in self.skip_ranges], "skipped_steps": self.skipped_steps,
                "rollbacks": self.rollbacks, "recent_grad_norms": list(self.recent_grad_norms),
                "data": {"paths": list(cfg.data.paths), "weights": cfg.data.weights, "seq_length": t.seq_length,
                         "global_batch_size": t.global_batch_size, "seed": t.seed}}

    def load(self, state: dict[str, Any]) -> None:
        """The saved position and counters; the saved skip ranges join the ones this run was given."""
        self.step, self.consumed_samples = state["step"], state["consumed_samples"]
        self.wandb_run_id = state.get("wandb_run_id")
        self.run_id = state.get("run_id") or self.run_id
        self.skipped_steps, self.rollbacks = state.get("skipped_steps", 0), state.get("rollbacks", 0)
        self.recent_grad_norms = list(state.get("recent_grad_norms", []))
        for a, b in state.get("skip_ranges", []):
            self.add_skip(a, b)
