"""Over what a rank's gradients are made final (built by training/build.py, read by engine.py): the
groups they are reduced over, by mesh view, the tp and pp groups of the norm, the tensor-parallel
specs, a tied copy shared by two pipeline stages, and fp16's loss scaler."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mpformer.optim.loss_scale import LossScaler
from mpformer.parallel.comm import Comm
from mpformer.parallel.tensor_parallel import GradSpec


@dataclass(frozen=True)
class TiedCopy:
    """A weight held by two pipeline stages (a tied embedding): its gradients are summed over ``comm``
    before the data-parallel reduction; only the ``owner`` counts it in the norm and saves it."""

    param: nn.Parameter
    comm: Comm
    owner: bool


@dataclass(frozen=True)
class ViewGroup:
    """The group one mesh view's gradients reduce over and ZeRO shards them on, and the divisor that
    makes their sum a mean (how many data replicas it holds); ``across``: the ranks that hold the
    view's *other* parameters (the experts of the other ep ranks), over which the norm's part and the
    overflow flag are summed too (None: every rank of a replica holds all of them)."""

    comm: Comm
    replicas: int
    across: Comm | None = None


@dataclass(frozen=True)
class Reduction:
    """Over what gradients are made final: the data-parallel group (data x context parallel: the cp
    ranks of a replica hold partial sums of its gradient), the tp and pp groups of the norm, the
    tensor-parallel specs, a tied copy, fp16's loss scaler; ``replicas``: how many data replicas
    the group holds (dp; None: the group's size), the divisor that makes the sum a mean. ``dp`` is
    the "data" view's group; a parameter whose spec names another view (GradSpec.reduce_over) reduces
    over ``views[name]``, and ZeRO shards it there: its buckets hold no parameter of another view."""

    dp: Comm
    tp: Comm | None = None
    pp: Comm | None = None
    specs: Sequence[GradSpec] = ()
    tied: TiedCopy | None = None
    scaler: LossScaler | None = None
    reduce_dtype: torch.dtype = torch.float32
    replicas: int | None = None
    views: Mapping[str, ViewGroup] = field(default_factory=dict)

    def view(self, name: str) -> ViewGroup:
        if name == "data":
            return ViewGroup(self.dp, self.replicas or self.dp.size)
        if name not in self.views:
            raise KeyError(f"gradient view {name!r} has no group in this reduction; valid: data, "
                           f"{', '.join(self.views) or '(no other)'}")
        return self.views[name]
