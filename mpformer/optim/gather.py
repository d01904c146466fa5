"""ZeRO stage 3's parameters: each unit gathered just before it is used and freed right after.

Units are the engine's stage-3 buckets (units.py): the embedding (token and position
embeddings), the head (final norm, LM head) and each transformer layer's parts (Block.parts(): the
attention's norm and qkv projection, its output projection, the MLP's norm and up projection, its down
projection), consecutive parts of a layer merged into units of at most ``train.zero3_unit_numel``
elements (a small layer is one unit). A unit's parameters are views into its ``param_buf``, whose
storage exists only while the unit is gathered (FSDP's storage trick: ``resize_(0)`` frees it, the
views stay valid and see the data again once it is re-grown and all-gathered). What is gathered is
this rank's fp32 master shard cast to the parameter dtype (or, for fp32 parameters, the shard itself):
no 16-bit copy of the parameters is kept between uses. A unit of float8 layers' weights (train.precision=
fp8) is cast to float8 instead, with scales from amaxes reduced over the shards, and gathered as bytes
into a buffer of its own (fp8_gather.py); its bf16 buffer is never gathered.

Regions are where forward reads units, in forward order, one per unit: a layer's unit entered at its
first module's forward pre-hook and left at its last module's forward hook (a whole-layer unit: the
layer's own hooks), the embedding (Transformer.embed_tokens) and the head (Transformer.head_output, a
tied head also reading the embedding's unit) through the model's ``region_hooks``. The next region "in
use order" is r + 1 in forward; in backward it is r - 1, except that a fully recomputed layer runs its
forward again first, from its first region, inside its backward.

    forward    region r: gather its units (prefetched), prefetch region r+1's, run, free them
    backward   a hook on region r's output fires when its gradient arrives: region r+1's backward is
               over, free its units; gather r's (prefetched) and prefetch the next in use order.
               The embedding's backward reads no weights (an embedding's gradient is a scatter of the
               output gradient into rows), so it is not gathered there. Once a unit's gradients are all
               in, the engine reduce-scatters them and ``release`` frees it.
    recompute  a hook on a fully recomputed layer's output (its backward begins: its forward runs again
               first) prefetches its first region; the recomputed forward gathers and frees region by
               region as forward does, its last region stays for its backward and the one before it,
               the next in use order, stays too if within the prefetch budget. A split layer's units
               are so gathered three times per micro-batch (forward, recompute, backward; its last unit
               and, within the budget, the one before it twice), a whole-layer unit twice, as without
               recompute.
    step       nothing is gathered until the next forward sees the updated shards

A prefetch happens only when the units it would gather hold at most ``prefetch_numel`` elements (else
they are gathered when used). So at most the units of two regions are gathered at any time: the one in
use and the next in use order, if small enough (the memory model counts them: runtimes.py
``parts_gathered``, walked by autoconfig/step_memory.py). Per micro-batch that is Psi all-gathered in
forward, Psi less the embedding in backward (a tied head gathers the embedding again in both), each
recomputed split layer again less what stays, and Psi reduce-scattered (docs/formulas.md counts the
collectives). Not with pipeline parallelism (validate() says so).
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
    from mpformer.optim.fp8_gather import Fp8Unit


@dataclass(frozen=True)
class Region:
    """A part of forward that reads ``units``: a layer's unit (hooked on its ``first`` and ``last``
    modules), or a part the model announces through its ``region_hooks`` (``name``; modules None).
    ``layer``: the layer's position in the model (its recompute mode), ``start``: its first region."""

    name: str
    units: tuple[int, ...]
    first: nn.Module | None = None
    last: nn.Module | None = None
    backward_reads: bool = True  # its backward needs its weights (not an embedding's)
    layer: int | None = None
    start: int | None = None


class UnitGather:
    def __init__(self, units: Sequence[Bucket], comms: Sequence[Comm], regions: Sequence[Region], model: nn.Module,
                 compute_dtype: torch.dtype, prefetch_numel: float = float("inf"),
                 fp8: Sequence[Fp8Unit | None] | None = None) -> None:
        """``comms``: each unit's group (its view's, engine.py); ``fp8``: per unit, its float8 gather where
        its weights are gathered in float8 (fp8_gather.py)."""
        self.units, self.comms, self.regions, self.dtype = list(units), list(comms), list(regions), compute_dtype
        self.fp8 = list(fp8) if fp8 is not None else [None] * len(self.units)
        self.model, self.prefetch_numel = model, prefetch_numel
        n = len(self.units)
        self.gathered = [True] * n
        self.gathering: list[dist.Work | None] = [None] * n
        self.pending = [False] * len(self.regions)  # region r's backward has begun and is not over
        self.recomputing: int | None = None  # the layer whose forward runs again inside its backward
        self.kept: int | None = None  # the last region of that forward: its backward is next
        self.by_name = {r.name: k for k, r in enumerate(self.regions) if r.first is None}
        self.ends = {r: self._ends_layer(r) for r in range(len(self.regions))}
        for k in range(n):
            self.free(k)
        layers = getattr(model, "layers", None) or []
        for i, layer in enumerate(layers):  # before the regions' hooks: a layer's backward begins first
            layer.register_forward_hook(lambda m, a, out, i=i: self._layer_out(i, out))
        for r, region in enumerate(self.regions):
            if region.first is not None:
                region.first.register_forward_pre_hook(lambda m, a, r=r: self._enter(r))
                region.last.register_forward_hook(lambda m, a, out, r=r: self._leave(r, out))
        model.region_hooks = self  # enter(name) / leave(name, out) for the named regions

    def _ends_layer(self, r: int) -> bool:
        layer = self.regions[r].layer
        return layer is not None and (r + 1 == len(self.regions) or self.regions[r + 1].layer != layer)

    # ---- the units ----------------------------------------------------------------------------
    def gather(self, k: int, async_op: bool = False) -> None:
        f = self.fp8[k]
        if f is not None and f.stale():  # cast in a backward with the scales of a forward now over
            self.free(k)
        if self.gathered[k] or self.gathering[k] is not None:
            if not async_op:
                self.wait(k)
            return
        u = self.units[k]
        if f is not None:  # float8 bytes with their scales; the bf16 buffer stays unallocated
            buf, src = f.buf, f.cast_shard()
        else:
            buf = u.param_buf
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            # 16-bit parameters: the fp32 masters cast here (kept alive by the work until it is waited for)
            src = u.param_shard if u.masters is None else u.masters.to(self.dtype)
        self.gathering[k] = self.comms[k].all_gather_into(buf, src, async_op=True)
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
        if self.fp8[k] is not None:
            self.fp8[k].free()
        self.gathered[k] = False

    def live(self) -> list[int]:
        """The units gathered or arriving."""
        return [k for k in range(len(self.units)) if self.gathered[k] or self.gathering[k] is not None]

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
        self.recomputing = self.kept = None
        for k in self.live():
            self.free(k)

    # ---- use order ------------------------------------------------------------------------------
    def _units(self, r: int, but: int | None = None) -> list[int]:
        """Region r's units, less those region ``but`` reads (kept: prefetched or in use there)."""
        if not 0 <= r < len(self.regions):
            return []
        keep = set(self.regions[but].units) if but is not None and 0 <= but < len(self.regions) else set()
        return [k for k in self.regions[r].units if k not in keep]

    def _full_recompute(self, layer: int) -> bool:
        mode = getattr(self.model, "recompute_mode", None)
        return mode is not None and mode(layer) == "full"

    def _next_back(self, r: int) -> int:
        """The region used after region r's backward: r - 1, or the first region of r - 1's layer when
        that layer runs its forward again first; -1 for none (or one whose backward reads nothing)."""
        q = r - 1
        if q < 0:
            return -1
        region = self.regions[q]
        if self.ends[q] and self._full_recompute(region.layer):
            return region.start
        return q if region.backward_reads else -1

    def _fits(self, units: list[int]) -> bool:
        return sum(self.units[k].layout.used for k in units) <= self.prefetch_numel

    def _prefetch(self, r: int) -> None:
        """Region r's units, asynchronously, if those not yet gathered fit the prefetch budget."""
        todo = [k for k in self._units(r) if not (self.gathered[k] or self.gathering[k] is not None)]
        if todo and self._fits(todo):
            for k in todo:
                self.gather(k, async_op=True)

    # ---- the regions ----------------------------------------------------------------------------
    def enter(self, name: str) -> None:
        self._enter(self.by_name[name])

    def leave(self, name: str, out: Any) -> None:
        self._leave(self.by_name[name], out)

    def _recompute_ends(self, r: int) -> bool:
        """Region r is the last of a layer whose forward runs again now, inside its backward."""
        return self.ends.get(r, False) and self.recomputing == self.regions[r].layer

    def _enter(self, r: int) -> None:
        for k in self.regions[r].units:
            self.gather(k)
        if self._recompute_ends(r):
            # Its backward comes next: its units stay, and the next in use order arrives meanwhile. Known
            # here, not when it is left: torch's checkpoint stops recomputing once the last saved tensor is
            # back (set_checkpoint_early_stop), before this region's forward hook would run.
            self.recomputing, self.kept = None, r
            self._prefetch(self._next_back(r))
        elif not self.pending[r]:  # the next region's parameters arrive while this one computes
            self._prefetch(r + 1)

    def _leave(self, r: int, out: Any) -> None:
        if self.pending[r] or self.kept == r:  # a forward run again inside r's backward: its units stay
            return
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, r=r: self._before_backward(r, g))
        keep = set(self._units(r + 1))
        if self._recompute_ends(r + 1) and self._next_back(r + 1) == r and self._fits(self._units(r)):
            keep |= set(self._units(r))  # recomputing: r's backward follows r+1's; it counts as prefetched
        for k in self._units(r):
            if k not in keep:
                self.free(k)

    def _layer_out(self, layer: int, out: Any) -> None:
        if self._full_recompute(layer) and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, i=layer: self._layer_backward(i, g))

    def _layer_backward(self, layer: int, grad: torch.Tensor) -> torch.Tensor:
        """A fully recomputed layer's backward begins: its forward runs again first, from its first region
        (and may begin before its last region's backward hook fires: in a dropout's backward)."""
        self.recomputing = layer
        mine = [r for r, region in enumerate(self.regions) if region.layer == layer]
        self._backward_over(mine[-1] + 1, but=mine[-1])
        self._prefetch(mine[0])
        return grad

    def _backward_over(self, r: int, but: int) -> None:
        """Region r has finished its backward: its units go (a tied head's embedding too, whose gradients
        are not all in before the embedding's backward), but those region ``but`` reads."""
        if r < len(self.regions):
            self.pending[r] = False
            for k in self._units(r, but=but):
                self.free(k)

    def _before_backward(self, r: int, grad: torch.Tensor) -> torch.Tensor:
        self._backward_over(r + 1, but=r)  # the region after this one has finished its backward
        self.pending[r] = True
        if self._recompute_ends(r):
            return grad  # the recompute, still to run, gathers this region (_enter) and prefetches the next
        self.kept = None
        if self.regions[r].backward_reads:
            for k in self.regions[r].units:
                self.gather(k)
        self._prefetch(self._next_back(r))
        return grad
