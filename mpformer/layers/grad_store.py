"""The zero-bubble schedules' weight-gradient store (see layers/linear.py's docstring for the split).

Its own module so that both linear paths (layers/linear.py's bf16 one and layers/fp8_linear.py's float8
one, which linear.py dispatches to) can defer into it without importing each other; ZeRO-3's gradient
sink (``GradSink``, see layers/linear.py) lives here for the same reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

import torch


class WeightGradStore:
    """Weight-gradient GEMMs deferred from BI to BW, per (micro-batch, chunk) key."""

    def __init__(self) -> None:
        self.capturing: list[Callable[[], list[torch.Tensor]]] | None = None
        self.pending: dict[Hashable, list[Callable[[], list[torch.Tensor]]]] = {}

    @contextlib.contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Backward passes run inside queue their weight gradients under ``key``."""
        assert self.capturing is None and key not in self.pending, f"weight gradients of {key} already captured"
        self.capturing = []
        try:
            yield
            self.pending[key] = self.capturing
        finally:
            self.capturing = None

    def run(self, key: Hashable, on_accumulated: Callable[[torch.Tensor], None] | None = None) -> None:
        """The weight gradients queued under ``key``, accumulated into ``.grad``; ``on_accumulated(p)``
        then runs for each parameter, as autograd's post-accumulate-grad hooks would have (the
        gradient engine's buffers)."""
        with torch.no_grad():  # outside autograd's backward: the GEMMs must not be recorded
            for job in self.pending.pop(key):
                for p in job():
                    if on_accumulated is not None:
                        on_accumulated(p)

    def clear(self) -> None:
        self.pending.clear()


def accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """``g`` added into ``p.grad`` (set when there is none), in the parameter's dtype."""
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


class GradSink(Protocol):
    """Where a parameter's gradient goes instead of ``.grad`` (ZeRO-3's unit buffers, optim/engine.py)."""

    def grad_buffer(self, p: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like ``p`` (in its dtype) to add ``p``'s gradient into."""
        ...

    def grad_arrived(self, p: torch.Tensor) -> None:
        """``p``'s gradient of this backward is in its buffer."""
        ...


_SINK = "_mpformer_grad_sink"


def set_grad_sink(p: torch.Tensor, sink: GradSink | None) -> None:
    """Linear layers add ``p``'s gradient into ``sink`` instead of handing it to autograd (None: autograd's).
    Only for a parameter that one ``linear`` call per backward reads whole (a projection's weight or bias)."""
    setattr(p, _SINK, sink)


def grad_sink(p: torch.Tensor | None) -> GradSink | None:
    return getattr(p, _SINK, None) if p is not None else None
