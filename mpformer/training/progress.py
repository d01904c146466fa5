"""Where a run stands, as a checkpoint keeps it: optimizer steps taken, samples consumed (the data
position: the sampler is a pure function of it), the wandb run it logs to, and the data it reads
(a resume must continue the same sample stream; preflight checks it)."""

from __future__ import annotations

from typing import Any

from mpformer.core.config import Config


class Progress:
    def __init__(self) -> None:
        self.step = 0
        self.consumed_samples = 0
        self.wandb_run_id: str | None = None

    def advance(self, samples: int) -> None:
        """One optimizer step of ``samples`` samples."""
        self.step += 1
        self.consumed_samples += samples

    def adopt_wandb(self, run_id: str | None) -> None:
        self.wandb_run_id = run_id

    def state(self, cfg: Config) -> dict[str, Any]:
        t = cfg.train
        return {"step": self.step, "consumed_samples": self.consumed_samples, "wandb_run_id": self.wandb_run_id,
                "data": {"paths": list(cfg.data.paths), "weights": cfg.data.weights, "seq_length": t.seq_length,
                         "global_batch_size": t.global_batch_size, "seed": t.seed}}

    def load(self, state: dict[str, Any]) -> None:
        self.step, self.consumed_samples = state["step"], state["consumed_samples"]
        self.wandb_run_id = state.get("wandb_run_id")
