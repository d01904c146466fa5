"""Optimizers by name, with Megatron's parameter groups (no weight decay on biases and norm
weights), and the gradient engine that wraps them for a ZeRO stage.

The engine (engine.py) hands the optimizer 1-D shards of the parameters at ZeRO stages 1-3 and for
16-bit masters, which gives the same update only when the update of each element depends on that
element alone (``config.ELEMENTWISE_OPTIMIZERS``). Adafactor keeps row and column statistics of
whole matrices, so it runs at stage 0 with fp32 parameters only, where it steps them whole.
"""

from __future__ import annotations

import torch
from torch import nn

from mpformer.core.config import OptimConfig
from mpformer.models.init import ModelInit
from mpformer.optim.engine import GradEngine, Reduction
from mpformer.optim.units import ZERO3_DEFAULTS, Zero3Settings
from mpformer.parallel.device import DeviceLike


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


def make_optimizer(groups: list[dict], cfg: OptimConfig, device_kind: str = "cpu") -> torch.optim.Optimizer:
    """``cfg.name`` over ``groups`` (fused AdamW/Adam where the device has the kernel: cpu, cuda)."""
    fused = cfg.fused if cfg.fused is not None else device_kind in ("cpu", "cuda")
    if cfg.name in ("adamw", "adam"):
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        return cls(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def build_engine(model: nn.Module, red: Reduction, zero: int, cfg: OptimConfig, device_kind: str,
                 bucket_mb: float, param_dtype: torch.dtype = torch.float32, init: ModelInit | None = None,
                 device: DeviceLike = None, overlap_param_gather: bool = False,
                 zero3: Zero3Settings = ZERO3_DEFAULTS) -> GradEngine:
    """The gradient engine for ZeRO stage ``zero``; a 16-bit ``param_dtype`` casts the model's
    parameters to it and keeps fp32 masters (any stage). ``init``: a meta-built model's parameters
    are allocated on ``device`` and filled from it (only what this rank keeps). ``zero3``: stage 3's
    unit, prefetch and reduction bounds."""
    return GradEngine(model, red, stage=zero, groups=param_groups(model, cfg.weight_decay),
                      make_optimizer=lambda g: make_optimizer(g, cfg, device_kind), param_dtype=param_dtype,
                      bucket_mb=bucket_mb, init=init, device=device, overlap_param_gather=overlap_param_gather,
                      zero3=zero3)
