"""Learning-rate schedule: linear warmup, then cosine / linear decay to min_lr, or constant.

A pure function of the step, so a resumed run needs no scheduler state to continue exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int  # the step at which decay reaches min_lr (usually train.steps)
    decay: str = "cosine"  # cosine | linear | constant

    def __call__(self, step: int) -> float:
        """Learning rate for the update that ends step ``step + 1`` (``step`` counts from 0)."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.decay == "linear":
            coeff = 1.0 - progress
        elif self.decay == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            raise ValueError(f"unknown decay {self.decay!r}; valid: cosine, linear, constant")
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
