"""ZeRO stage 3's parameters: each unit gathered just before it is used and freed right after.

Units are the engine's stage-3 buckets: every transformer layer is one, and the root (embedding,
positions, final norm, LM head) another. A unit's parameters are views into its ``param_buf``, whose
storage exists only while the unit is gathered (FSDP's storage trick: ``resize_(0)`` frees it, the
views stay valid and see the data again once it is re-grown and all-gathered from the shards).

    forward   root: gather it, prefetch layer 0;   layer i: wait for it, prefetch layer i+1, run,
              free it (unless its backward has begun: activation recompute runs forward again)
    backward  a hook on each unit's output fires when its gradient arrives: gather the unit (and
              prefetch the one before it); once its gradients are in, the engine reduce-scatters them
              and ``release`` frees the unit
    step      nothing is gathered until the next forward sees the updated shards

Per micro-batch that is Psi all-gathered in forward, Psi again in backward and Psi reduce-scattered:
the 3 Psi of docs/formulas.md. Not with pipeline parallelism (validate() says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mpformer.parallel.comm import Comm

if TYPE_CHECKING:
    from mpformer.optim.bucket import Bucket


class UnitGather:
    def __init__(self, units: Sequence[Bucket], comm: Comm) -> None:
        self.units, self.comm = list(units), comm
        n = len(self.units)
        self.gathered, self.backward_pending = [True] * n, [False] * n
        self.gathering: list[dist.Work | None] = [None] * n
        for k in range(n):
            self.free(k)
        for k, u in enumerate(self.units):
            assert u.module is not None
            u.module.register_forward_pre_hook(lambda m, a, k=k: self._pre_forward(k))
            u.module.register_forward_hook(lambda m, a, out, k=k: self._post_forward(k, out))

    def gather(self, k: int, async_op: bool = False) -> None:
        if self.gathered[k] or self.gathering[k] is not None:
            if not async_op:
                self.wait(k)
            return
        u = self.units[k]
        u.param_buf.untyped_storage().resize_(u.param_buf.numel() * u.param_buf.element_size())
        self.gathering[k] = self.comm.all_gather_into(u.param_buf, u.param_shard, async_op=True)
        if self.gathering[k] is None:
            self.gathered[k] = True
        elif not async_op:
            self.wait(k)

    def wait(self, k: int) -> None:
        work = self.gathering[k]
        if work is not None:
            work.wait()
            self.gathering[k] = None
        self.gathered[k] = True

    def free(self, k: int) -> None:
        self.wait(k)
        self.units[k].param_buf.untyped_storage().resize_(0)
        self.gathered[k] = False

    def release(self, k: int) -> None:
        """Unit ``k``'s backward is done (its gradients are being reduced): free it."""
        self.backward_pending[k] = False
        self.free(k)

    def reset(self) -> None:
        """End of the step: nothing stays gathered, the next forward must see the updated weights."""
        for k in range(len(self.units)):
            self.backward_pending[k] = False
            if self.gathered[k] or self.gathering[k] is not None:
                self.free(k)

    def _pre_forward(self, k: int) -> None:
        self.gather(k)
        # The next layer's parameters arrive while this one computes; not when this forward is the
        # recompute inside this unit's backward (the next layer's backward is already done).
        if k + 1 < len(self.units) and not self.backward_pending[k]:
            self.gather(k + 1, async_op=True)

    def _post_forward(self, k: int, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, k=k: self._pre_backward(k, g))
        if not self.backward_pending[k]:
            self.free(k)

    def _pre_backward(self, k: int, grad: torch.Tensor) -> torch.Tensor:
        self.backward_pending[k] = True
        self.gather(k)
        if k > 1:  # layer k-1 is next in backward (the root, unit 0, is gathered by its own hook)
            self.gather(k - 1, async_op=True)
        return grad
