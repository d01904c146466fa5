"""The trainer's one handle on gradients and the optimizer step, whatever the ZeRO stage.

    zero=0   ReplicatedOptimizer: DataParallel's bucketed all-reduce + the optimizer on full tensors
    zero=1,2 ZeroOptimizer (zero.py): reduce-scatter into shards, step the shard, all-gather

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

from mpformer.checkpoint.io import OPTIM_PREFIX, load_tensors, optimizer_state, set_optimizer_step
from mpformer.checkpoint.shards import Shard
from mpformer.optim.builder import make_optimizer, param_groups
from mpformer.optim.clip import clip_grad_norm
from mpformer.optim.memory import model_state_bytes
from mpformer.optim.zero import ZeroOptimizer
from mpformer.optim.zero_state import load_zero_state, zero_optimizer_state
from mpformer.parallel.comm import Comm
from mpformer.parallel.data_parallel import DataParallel
from mpformer.parallel.tensor_parallel import GradSpec, sync_tp_grads
from mpformer.training.config import OptimConfig


class DistributedOptimizer(Protocol):
    optimizer: torch.optim.Optimizer

    def zero_grad(self) -> None: ...
    def no_sync(self) -> contextlib.AbstractContextManager: ...
    def start(self) -> None: ...
    def finish(self) -> None: ...
    def main_grad(self, p: nn.Parameter) -> torch.Tensor | None: ...
    def sync_tp(self, specs: Sequence[GradSpec]) -> None: ...
    def clip(self, specs: Sequence[GradSpec], max_norm: float, tp: Comm | None, pp: Comm | None) -> float: ...
    def step(self) -> None: ...
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

    def sync_tp(self, specs: Sequence[GradSpec]) -> None:
        sync_tp_grads(list(specs))

    def clip(self, specs: Sequence[GradSpec], max_norm: float, tp: Comm | None, pp: Comm | None) -> float:
        return clip_grad_norm(list(specs), max_norm, tp, pp)

    def step(self) -> None:
        self.optimizer.step()

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


class ShardedOptimizer(ZeroOptimizer):
    """ZeRO stages 1 and 2 (zero.py) with the trainer-facing calls of ``DistributedOptimizer``."""

    def main_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        k, slot = self._where[id(p)]
        buf = self.buckets[k].grad_buf
        return None if buf is None else buf[slot.start:slot.end].view_as(p)

    def state_shards(self, model: nn.Module) -> dict[str, Shard]:
        return zero_optimizer_state(model, self)

    def load_state(self, ckpt_dir: str, model: nn.Module) -> None:
        load_zero_state(ckpt_dir, model, self)

    def memory(self) -> dict[str, int]:
        masters = [s.master for s in self.shards] if self.param_dtype != torch.float32 else []
        grads = [b.grad_shard for b in self.buckets] + [b.grad_buf for b in self.buckets if b.grad_buf is not None]
        return model_state_bytes([b.param_buf for b in self.buckets], grads, masters, self.optimizer)


def build_distributed_optimizer(model: nn.Module, dp: Comm, zero: int, cfg: OptimConfig, device_kind: str,
                                bucket_mb: float) -> DistributedOptimizer:
    groups = param_groups(model, cfg.weight_decay)
    if zero == 0:
        return ReplicatedOptimizer(model, dp, make_optimizer(groups, cfg, device_kind), bucket_mb)
    return ShardedOptimizer(model, dp, stage=zero, groups=groups, bucket_mb=bucket_mb,
                            make_optimizer=lambda g: make_optimizer(g, cfg, device_kind))
