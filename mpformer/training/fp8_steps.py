"""fp8 delayed scaling's part of a training step (issue 35): its amax histories agreed over the data
ranks after each step's backward, and a step's records taken back when that step does not count.

Delayed scaling moves state in forward and backward (each cast records its amax, layers/fp8.py), so a
step that runs again or is dropped would leave its records behind, and the next scales would differ from
a run in which it ran once. The three cases mirror the routers' selection biases (router_report.py):

    begin(k)   before step k's forward; a second run of k (train.overlap_validation reruns a step's
               micro-batches on settled parameters) first puts the histories back as they were before
               its first run
    undo(k)    step k skipped (train.on_nan=skip): the histories as before it, as if it never ran
    forget()   after a rollback: the checkpoint's histories are loaded, its steps run again from there

The buffers are read from the modules at each call: a checkpoint load replaces the tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

BUFFERS = ("fp8_amax_history", "fp8_scale")


class DelayedSteps:
    """The delayed-scaling modules of ``model`` (dense linears and routed experts alike: those holding
    ``fp8_amax_history``); ``sync``: the data-parallel agreement (training/build.py), None on one rank."""

    def __init__(self, model: nn.Module, sync: Callable[[], None] | None) -> None:
        self.modules = [m for m in model.modules() if isinstance(getattr(m, BUFFERS[0], None), torch.Tensor)]
        self.sync_fn = sync
        self.before: dict[int, list[torch.Tensor]] = {}  # step -> every buffer as before its first run

    def begin(self, step: int) -> None:
        if step in self.before:
            self._restore(step)
        self.before = {k: v for k, v in self.before.items() if k >= step - 2}  # what an overlap may still undo
        self.before[step] = [getattr(m, b).clone() for m in self.modules for b in BUFFERS]

    def sync(self) -> None:
        """After the step's last cast: the next step's scales agree on every rank."""
        if self.sync_fn is not None:
            self.sync_fn()

    def undo(self, step: int) -> None:
        if step in self.before:
            self._restore(step)

    def forget(self) -> None:
        self.before.clear()

    def _restore(self, step: int) -> None:
        saved = iter(self.before[step])
        with torch.no_grad():
            for m in self.modules:
                for b in BUFFERS:
                    getattr(m, b).copy_(next(saved))
        self.before = {k: v for k, v in self.before.items() if k < step}  # later steps run again from here
