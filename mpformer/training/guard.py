"""Step-level reliability: preemption by SIGTERM, and steps whose loss or gradient is not finite.

Start-up (until this process's first step has finished) is startup.py's: SIGTERM ends it at once.

Preemption. Once the first step has finished, SIGTERM waits for a step boundary. Schedulers send
SIGTERM before they kill a job, and torchrun forwards it to every worker. The handler only sets a
flag; the ranks agree on it (ranks may get the signal in different steps, and a checkpoint is
collective) in the step check, the one all-reduce that ends every step (training/overlap.py; under
train.overlap_validation that check completes during the next step, so the run stops a step later),
then the trainer saves and the run ends with exit code 0, as a stop_at does
(Megatron's --exit-signal-handler does the same). A second SIGTERM is not caught: the default action,
termination, runs at once.

Bad steps (``train.on_nan``): a loss or gradient norm that is not finite, or, with
``train.spike_factor=K``, a gradient norm above K times the median of the last SPIKE_WINDOW good
steps' (a spike; the window is kept in checkpoints, so a resume judges as the uninterrupted run
would). The global loss (all-reduced) and the global gradient norm are the same on every rank, so
every rank takes the same decision without another collective:

    halt      raise RunHalted: exit 3 with one line naming the step and its sample range, and how to
              resume past it (checkpoint.load=auto data.skip_ranges=[[start,end]])
    skip      the update is not applied (the weights and optimizer state stay as they were); the step
              still consumes its samples and counts, and ``skipped_steps`` in metrics.jsonl counts it
    rollback  reload the newest checkpoint in save_dir and add the step's samples to the skip ranges,
              so the replay trains past them (training/progress.py); at most MAX_ROLLBACKS per process,
              then halt (a loss that diverges wherever the data is, is not a bad batch)

A step that fp16's loss scaler already skipped (an inf in the scaled gradients) is the scaler's
business and is not checked here.
"""

from __future__ import annotations

import math
import signal
import statistics
import threading

import torch
import torch.distributed as dist

MAX_ROLLBACKS = 3
SPIKE_WINDOW = 50  # grad norms of the last good steps that train.spike_factor compares against
SPIKE_MIN_HISTORY = 10  # fewer than this (the start of a run): no spike verdict yet


def finite(loss: float, grad_norm: float) -> bool:
    return math.isfinite(loss) and math.isfinite(grad_norm)


def bad_step(loss: float, grad_norm: float, recent: list[float], spike_factor: float) -> str | None:
    """Why this step must not update the weights (None: it is fine): a loss or grad norm that is not
    finite, or (``spike_factor`` > 0) a grad norm above that multiple of the recent median."""
    if not finite(loss, grad_norm):
        return "not finite"
    if spike_factor > 0 and len(recent) >= SPIKE_MIN_HISTORY:
        med = statistics.median(recent)
        if grad_norm > spike_factor * med:
            return (f"grad norm above train.spike_factor={spike_factor:g} x the median {med:.4g} of the last "
                    f"{len(recent)} steps")
    return None


class Preemption:
    """The SIGTERM flag (agreed over the world in the step check, training/overlap.py)."""

    def __init__(self) -> None:
        self.requested, self._previous, self.installed = False, None, False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self.installed = True

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        self.installed = False

    def _on_signal(self, signum: int, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM terminates at once


def agree(flag: bool, device: torch.device, *, any_rank: bool) -> bool:
    """Collective over the world: ``flag`` on any rank (``any_rank``) or on every rank, one 1-element all-reduce."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if any_rank else dist.ReduceOp.MIN)
    return bool(t.item())


def halt_message(step: int, loss: float, grad_norm: float, start: int, end: int, why: str) -> str:
    return (f"step {step}: loss {loss} / grad norm {grad_norm}: {why}; the run stops. Its samples "
            f"were [{start}, {end}); to go on past them: checkpoint.load=auto data.skip_ranges=[[{start},{end}]] "
            f"(or train.on_nan=skip|rollback)")
