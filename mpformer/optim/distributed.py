"""The trainer's one handle on gradients and the optimizer step, whatever the ZeRO stage.

    zero=0 fp32       ReplicatedOptimizer: DataParallel's bucketed all-reduce + the optimizer on full tensors
    zero=0-2, 16-bit  ZeroOptimizer (zero.py): fp32 main gradients and masters; 1-2 shard them
    zero=3            Zero3Optimizer (zero3.py): parameters sharded too, gathered per layer

Both offer the same calls in the order the trainer makes them each step:
``zero_grad, no_sync (earlier micro-batches), start (a pipeline stage after its last backward),
finish, main_grad (the tied embedding's sync), sync_tp, clip, step``, plus checkpoint state by
canonical name and slice (``state_shards`` / ``load_state``) and ``memory`` for the report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import nn

from mpformer.checkpoint.io import OPTIM_PREFIX, load_tensors, model_state, optimizer_state, set_optimizer_step
from mpformer.core.config import OptimConfig
from mpformer.core.shards import Shard
from mpformer.optim.builder import make_optimizer, param_groups
from mpformer.optim.clip import clip_grad_norm
from mpformer.optim.memory import model_state_bytes
from mpformer.optim.zero import ZeroOptimizer
from mpformer.optim.zero3 import Zero3Optimizer
from mpformer.parallel.comm import Comm
from mpformer.parallel.data_parallel import DataParallel
from mpformer.parallel.tensor_parallel import GradSpec, sync_tp_grads


class DistributedOptimizer(Protocol):
    optimizer: torch.optim.Optimizer

    def zero_grad(self) -> None: ...
    def no_sync(self) -> contextlib.AbstractContextManager: ...
    def start(self) -> None: ...
    def finish(self) -> None: ...
    def main_grad(self, p: nn.Parameter) -> torch.Tensor | None: ...
    def grad_ready(self, p: torch.Tensor) -> None: ...
    def skip_on_save(self, p: nn.Parameter) -> None: ...
    def sync_tp(self, specs: Sequence[GradSpec]) -> None: ...
    def clip(self, specs: Sequence[GradSpec], max_norm: float, tp: Comm | None, pp: Comm | None) -> float: ...
    def step(self) -> None: ...
    def unscale(self, inv_scale: float, tp: Comm | None, pp: Comm | None) -> bool: ...
    def weight_shards(self, model: nn.Module) -> dict[str, Shard]: ...
    def load_weights(self, ckpt_dir: str, model: nn.Module) -> None: ...
    def state_shards(self, model: nn.Module) -> dict[str, Shard]: ...
    def load_state(self, ckpt_dir: str, model: nn.Module) -> None: ...
    def memory(self) -> dict[str, int]: ...


class ReplicatedOptimizer:
    """ZeRO stage 0: full gradients all-reduced over dp, the wrapped optimizer on full tensors."""

    def __init__(self, model: nn.Module, comm: Comm, optimizer: torch.optim.Optimizer, bucket_mb: float) -> None:
        self.model, self.optimizer = model, optimizer
        self.dp = DataParallel(model, comm, bucket_mb=bucket_mb)

    def zero_grad(self) -> None:
        self.dp.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.dp.no_sync():
            yield

    def start(self) -> None:
        self.dp.start()

    def finish(self) -> None:
        self.dp.finish()

    def main_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        return p.grad

    def grad_ready(self, p: torch.Tensor) -> None:
        self.dp._on_grad_ready(p)  # the gradient is already in its bucket view; this only counts it

    def skip_on_save(self, p: nn.Parameter) -> None:
        """Replicated state writes identical chunks everywhere (DCP deduplicates): nothing to skip."""

    def sync_tp(self, specs: Sequence[GradSpec]) -> None:
        sync_tp_grads(list(specs))

    def clip(self, specs: Sequence[GradSpec], max_norm: float, tp: Comm | None, pp: Comm | None) -> float:
        return clip_grad_norm(list(specs), max_norm, tp, pp)

    def step(self) -> None:
        self.optimizer.step()

    def weight_shards(self, model: nn.Module) -> dict[str, Shard]:
        return model_state(model)

    def load_weights(self, ckpt_dir: str, model: nn.Module) -> None:
        load_tensors(ckpt_dir, model_state(model))

    def unscale(self, inv_scale: float, tp: Comm | None, pp: Comm | None) -> bool:
        raise AssertionError("fp32 parameters need no loss scaling")

    def state_shards(self, model: nn.Module) -> dict[str, Shard]:
        return optimizer_state(model, self.optimizer)

    def load_state(self, ckpt_dir: str, model: nn.Module) -> None:
        targets = optimizer_state(model, self.optimizer)
        load_tensors(ckpt_dir, targets)
        set_optimizer_step(self.optimizer, targets[OPTIM_PREFIX + "step"].local)

    def memory(self) -> dict[str, int]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [b.buffer for b in self.dp.buckets] or [p.grad for p in params if p.grad is not None]
        return model_state_bytes(params, grads, [], self.optimizer)


def build_distributed_optimizer(model: nn.Module, dp: Comm, zero: int, cfg: OptimConfig, device_kind: str,
                                bucket_mb: float, param_dtype: torch.dtype = torch.float32) -> DistributedOptimizer:
    """``param_dtype`` 16-bit: the model's parameters are cast to it and fp32 masters kept (any stage)."""
    groups = param_groups(model, cfg.weight_decay)
    make = lambda g: make_optimizer(g, cfg, device_kind)
    if zero == 3:
        return Zero3Optimizer(model, dp, groups=groups, make_optimizer=make, param_dtype=param_dtype)
    if zero == 0 and param_dtype == torch.float32:
        return ReplicatedOptimizer(model, dp, make(groups), bucket_mb)
    return ZeroOptimizer(model, dp, stage=zero, groups=groups, bucket_mb=bucket_mb, make_optimizer=make,
                         param_dtype=param_dtype)
