"""Placeholder: replaced by the dispatchers (branch h-dispatch)."""

from __future__ import annotations

from typing import Protocol

import torch


class TokenDispatcher(Protocol):
    def dispatch(self, x_th: torch.Tensor, expert_tk: torch.Tensor) -> tuple[torch.Tensor, list[int]]: ...

    def combine(self, y_mh: torch.Tensor) -> torch.Tensor: ...


class LocalDispatcher:
    def __init__(self, num_experts: int) -> None:
        self.e = num_experts

    def dispatch(self, x_th: torch.Tensor, expert_tk: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        k = expert_tk.shape[1]
        flat = expert_tk.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.e).tolist()
        return x_th[self.order // k], counts

    def combine(self, y_mh: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(y_mh)
        out[self.order] = y_mh
        return out
