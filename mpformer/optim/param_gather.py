"""ZeRO-1/2's parameter all-gather after the step, overlapped with the next forward.

At stages 1-2 each rank updates only its shard of every bucket, and the full parameters are
all-gathered after the step. Waiting for all of them there leaves the gather exposed; Megatron's
``--overlap-param-gather`` instead lets each layer wait only for its own buckets when its forward
begins, so the gathers of later layers run behind the compute of earlier ones:

    step()            every bucket's all-gather posted, in the order forward needs them (buckets are
                      packed last parameter first, so the first layers' are the last buckets); the
                      buckets holding parameters outside the blocks (embedding, positions, final norm,
                      head, a tied copy: read without their module being called) waited at once
    block pre-hook    waits for the buckets holding that block's parameters (nothing left: a no-op)
    wait()            everything, before anything else reads or writes the parameters (checkpoints)

A model without ``layers`` (a bare module), or none (the engine without overlap_param_gather), gets
no hooks: everything is waited in step().
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpformer.parallel.comm import Comm

if TYPE_CHECKING:
    from mpformer.optim.bucket import Bucket


class ParamGather:
    def __init__(self, buckets: Sequence[Bucket], comms: Sequence[Comm], model: nn.Module | None) -> None:
        """``comms``: each bucket's group (its view's); ``model=None``: no overlap, every gather waited in
        ``launch`` (the engine's default)."""
        self.buckets, self.comms = list(buckets), list(comms)
        self.pending: dict[int, tuple[object, torch.Tensor]] = {}  # bucket -> (work, its input kept alive)
        where = {id(p): b.index for b in self.buckets for p in b.params}
        in_blocks: set[int] = set()
        for layer in getattr(model, "layers", None) or []:
            mine = sorted({where[id(p)] for p in layer.parameters() if id(p) in where})
            in_blocks |= {id(p) for p in layer.parameters()}
            layer.register_forward_pre_hook(lambda _m, _a, ks=tuple(mine): self.wait(ks))
        self.root = sorted({k for pid, k in where.items() if pid not in in_blocks})

    def launch(self) -> None:
        """Post every bucket's gather (in place: the shard is a view of the bucket, comm.py copies it where
        the collective needs that); wait for the buckets that hold parameters outside the blocks."""
        self.wait()
        for b in reversed(self.buckets):
            src = b.param_shard
            self.pending[b.index] = (self.comms[b.index].all_gather_into(b.param_buf, src, async_op=True), src)
        self.wait(self.root)

    def wait(self, indices: Iterable[int] | None = None) -> None:
        if not self.pending:
            return
        for k in list(self.pending) if indices is None else indices:
            work, _ = self.pending.pop(k, (None, None))
            if work is not None:
                work.wait()
