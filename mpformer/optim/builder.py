"""AdamW with Megatron's parameter groups: no weight decay on biases and norm weights."""

from __future__ import annotations

import torch
from torch import nn

from mpformer.training.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # 1-D tensors are biases and norm gains: decaying them only hurts (Megatron, GPT-3 practice).
        (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_kind: str = "cpu") -> torch.optim.Optimizer:
    """torch.optim.AdamW, fused where the device has a fused kernel (cpu and cuda in torch >= 2.4)."""
    fused = cfg.fused if cfg.fused is not None else device_kind in ("cpu", "cuda")
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                             eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused)
