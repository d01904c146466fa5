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
        counts = torch.bincount(flat, minlength=self.e + 1)[:self.e].tolist()
        self.order = torch.argsort(flat, stable=True)[:sum(counts)]  # id E: dropped
        self.slots = flat.numel()
        return x_th[self.order // k], counts

    def combine(self, y_mh: torch.Tensor) -> torch.Tensor:
        out = y_mh.new_zeros(self.slots, y_mh.shape[1])
        out[self.order] = y_mh
        return out


class AllToAllDispatcher(LocalDispatcher):  # placeholder until branch h-dispatch lands
    def __init__(self, comm, num_experts: int) -> None:
        raise NotImplementedError


class AllGatherDispatcher(LocalDispatcher):  # placeholder until branch h-dispatch lands
    def __init__(self, comm, num_experts: int) -> None:
        raise NotImplementedError
