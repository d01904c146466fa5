"""Rank-0 reporting: metrics.jsonl, a console progress bar (or plain lines), and wandb.

wandb is imported only when its mode is not "disabled"; its run id is kept in checkpoints so a
resumed job continues the same wandb run.
"""

from __future__ import annotations

import json
import math
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any

from mpformer.core.config import WandbConfig


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    """Writes one JSON object per logged step; shows progress. A no-op on ranks other than 0."""

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, start_step: int, interval: int,
                 progress: bool, wandb_cfg: WandbConfig, wandb_run_id: str | None, config: dict[str, Any]):
        self.enabled = enabled
        self.total, self.interval = total_steps, interval
        self.wandb_run_id = wandb_run_id
        self._wandb = None
        self._bar = None
        self._file = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if wandb_cfg.mode != "disabled":
            self._wandb = self._init_wandb(run_dir, wandb_cfg, config)

    def _init_wandb(self, run_dir: Path, cfg: WandbConfig, config: dict[str, Any]):
        import wandb  # lazy: only runs that log to wandb pay for the import

        if self.wandb_run_id is None:  # ours, not wandb's helper: that one moved between wandb releases
            self.wandb_run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        return wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name, id=self.wandb_run_id,
                          resume="allow", mode=cfg.mode, dir=str(run_dir), config=config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                                  refresh=False)
        if step % self.interval and step != self.total and "val_loss" not in metrics:
            return
        record = {"step": step, **metrics}
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._bar is None:
            eta = metrics.get("eta_s", float("nan"))
            print(f"step {step}/{self.total} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.3g} | "
                  f"grad_norm {metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:.0f} tok/s | "
                  f"{metrics['step_time_s'] * 1000:.0f} ms/step"
                  + (f" (predicted {metrics['predicted_step_time_s'] * 1000:.0f})"
                     if "predicted_step_time_s" in metrics else "")
                  + f" | ETA {_fmt_eta(eta)}"
                  + (f" | val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""), flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


class StepTimer:
    """Wall time per step and an ETA from the mean of the steps timed so far."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: list[float] = []

    def restart(self) -> None:
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t0 = now - self.t0, now
        self.times.append(dt)
        return dt

    def eta(self, remaining_steps: int) -> float:
        recent = self.times[-20:]
        return remaining_steps * sum(recent) / len(recent) if recent else float("nan")
