"""ZeRO stage 3's parameters: each unit gathered just before it is used and freed right after.

Units are the engine's stage-3 buckets: the embedding (token and position embeddings), every
transformer layer, and the head (final norm, LM head). A unit's parameters are views into its
``param_buf``, whose storage exists only while the unit is gathered (FSDP's storage trick:
``resize_(0)`` frees it, the views stay valid and see the data again once it is re-grown and
all-gathered). What is gathered is this rank's fp32 master shard cast to the parameter dtype (or,
for fp32 parameters, the shard itself): no 16-bit copy of the parameters is kept between uses.

Regions are where forward reads units, in forward order: the embedding (Transformer.embed_tokens,
through the model's ``region_hooks``), each layer (its module's forward hooks), the head
(Transformer.head_output; a tied head also reads the embedding's unit).

    forward    region r: gather its units (prefetched), prefetch region r+1's, run, free them
               (not while r's backward is pending: full recompute runs r's forward inside it)
    backward   a hook on region r's output fires when its gradient arrives: region r+1's backward
               is over, free its units; gather r's (prefetched) and prefetch r-1's. The embedding's
               backward reads no weights (an embedding's gradient is a scatter of the output
               gradient into rows), so it is not gathered there. Once a unit's gradients are all in,
               the engine reduce-scatters them and ``release`` frees it.
    step       nothing is gathered until the next forward sees the updated shards

So at most two units are gathered at any time: the one in use and the one prefetched (the memory
model, autoconfig/memory.py, counts them). Per micro-batch that is Psi all-gathered in forward,
Psi less the embedding in backward and Psi reduce-scattered (docs/formulas.md's 3 Psi, less the
embedding's backward gather). Not with pipeline parallelism (validate() says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mpformer.parallel.comm import Comm

if TYPE_CHECKING:
    from mpformer.optim.bucket import Bucket


@dataclass(frozen=True)
class Region:
    """A part of forward that reads ``units``: a layer (``module``, hooked through its forward hooks) or
    a part the model announces through its ``region_hooks`` (``name``, module None)."""

    name: str
    units: tuple[int, ...]
    module: nn.Module | None = None
    backward_reads: bool = True  # its backward needs its weights (not an embedding's)


class UnitGather:
    def __init__(self, units: Sequence[Bucket], comm: Comm, regions: Sequence[Region], model: nn.Module,
                 compute_dtype: torch.dtype) -> None:
        self.units, self.comm, self.regions, self.dtype = list(units), comm, list(regions), compute_dtype
        n = len(self.units)
        self.gathered = [True] * n
        self.gathering: list[dist.Work | None] = [None] * n
        self.pending = [False] * len(self.regions)  # region r's backward has begun and is not over
        self.by_name = {r.name: k for k, r in enumerate(self.regions) if r.module is None}
        for k in range(n):
            self.free(k)
        for r, region in enumerate(self.regions):
            if region.module is not None:
                region.module.register_forward_pre_hook(lambda m, a, r=r: self._enter(r))
                region.module.register_forward_hook(lambda m, a, out, r=r: self._leave(r, out))
        model.region_hooks = self  # enter(name) / leave(name, out) for the named regions

    # ---- the units ----------------------------------------------------------------------------
    def gather(self, k: int, async_op: bool = False) -> None:
        if self.gathered[k] or self.gathering[k] is not None:
            if not async_op:
                self.wait(k)
            return
        u = self.units[k]
        u.param_buf.untyped_storage().resize_(u.param_buf.numel() * u.param_buf.element_size())
        # 16-bit parameters: the fp32 masters cast here (kept alive by the work until it is waited for)
        src = u.param_shard if u.masters is None else u.masters.to(self.dtype)
        self.gathering[k] = self.comm.all_gather_into(u.param_buf, src, async_op=True)
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
        """Unit ``k``'s gradients are all in (they are being reduced): free it; the regions that read it
        have finished their backward."""
        for r, region in enumerate(self.regions):
            if k in region.units:
                self.pending[r] = False
        self.free(k)

    def reset(self) -> None:
        """End of the step: nothing stays gathered, the next forward must see the updated weights."""
        self.pending = [False] * len(self.regions)
        for k in range(len(self.units)):
            if self.gathered[k] or self.gathering[k] is not None:
                self.free(k)

    # ---- the regions ----------------------------------------------------------------------------
    def enter(self, name: str) -> None:
        self._enter(self.by_name[name])

    def leave(self, name: str, out: Any) -> None:
        self._leave(self.by_name[name], out)

    def _units(self, r: int, but: int | None = None) -> list[int]:
        """Region r's units, less those region ``but`` reads (kept: prefetched or in use there)."""
        if not 0 <= r < len(self.regions):
            return []
        keep = set(self.regions[but].units) if but is not None and 0 <= but < len(self.regions) else set()
        return [k for k in self.regions[r].units if k not in keep]

    def _enter(self, r: int) -> None:
        for k in self.regions[r].units:
            self.gather(k)
        # The next region's parameters arrive while this one computes; not when this forward is the
        # recompute inside this region's backward (the next region's backward is already done).
        if not self.pending[r]:
            for k in self._units(r + 1):
                self.gather(k, async_op=True)

    def _leave(self, r: int, out: Any) -> None:
        if self.pending[r]:  # a recompute inside the backward: the units stay for it
            return
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, r=r: self._before_backward(r, g))
        for k in self._units(r, but=r + 1):
            self.free(k)

    def _before_backward(self, r: int, grad: torch.Tensor) -> torch.Tensor:
        if r + 1 < len(self.regions):  # the region after this one has finished its backward
            self.pending[r + 1] = False
            for k in self._units(r + 1, but=r):
                self.free(k)
        self.pending[r] = True
        if self.regions[r].backward_reads:
            for k in self.regions[r].units:
                self.gather(k)
        if r > 0 and self.regions[r - 1].backward_reads:
            for k in self._units(r - 1):
                self.gather(k, async_op=True)
        return grad
