"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018; Megatron's DynamicGradScaler).

fp16 gradients underflow below 6e-8; multiplying the loss by ``scale`` lifts them into range.
After backward the fp32 main gradients are divided by the scale and checked: if any element on
any rank is inf or nan, the step is skipped (no update, gradients dropped) and the scale is
multiplied by ``backoff``; after ``window`` consecutive good steps it is multiplied by ``growth``.
The state (scale, good steps, skipped count) goes into checkpoints, so a resumed run continues
with the same scale.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    scale: float = 2.0**16
    window: int = 1000
    min_scale: float = 1.0
    growth: float = 2.0
    backoff: float = 0.5
    good_steps: int = 0
    skipped: int = 0

    def update(self, found_inf: bool) -> bool:
        """Record a step's outcome; returns True when the step must be skipped."""
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.good_steps = 0
            self.skipped += 1
            return True
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= self.growth
            self.good_steps = 0
        return False

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
