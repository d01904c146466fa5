"""A rank's pipeline, assembled one way for training, evaluation and the auto-configurator's profile.

    schedule   build_schedule(layout.schedule, pp, micro-batches, vpp, token slices)
    p2p        P2P over the pp group, messages [boundary positions, micro-batch, hidden] (none at pp=1)
    offload    activations of the units waiting for their backward to host memory (training only)
    engine     PipelineEngine: the schedule's actions run by a dispatch table (engine.py)

The gradient engine takes part only through ``GradHooks`` (what the pipeline tells it), so this
module knows nothing of optim/.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mpformer.core.layout import ParallelLayout
from mpformer.core.pipeline_plan import StagePlan
from mpformer.layers.linear import WeightGradStore
from mpformer.parallel.device import HostCopies
from mpformer.parallel.groups import ProcessGroups
from mpformer.pipeline.engine import PipelineEngine
from mpformer.pipeline.offload import ActivationOffload, offload_units
from mpformer.pipeline.p2p import P2P
from mpformer.pipeline.schedules import build_schedule

Autocast = Callable[[], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class GradHooks:
    """What the pipeline tells the gradient engine: ``grads_done`` after the stage's last backward (its
    data-parallel reduction starts then), ``weight_grad(p)`` after a split backward's BW accumulated
    into ``p.grad`` (what autograd's post-accumulate-grad hooks would have run)."""

    grads_done: Callable[[], None]
    weight_grad: Callable[[torch.Tensor], None]


def build_pipeline(model: nn.Module, plan: StagePlan, layout: ParallelLayout, groups: ProcessGroups, *,
                   micro_batches: int, seq_length: int, micro_batch_size: int, dtype: torch.dtype,
                   store: WeightGradStore | None = None, autocast: Autocast = contextlib.nullcontext,
                   grads: GradHooks | None = None, forward_only: bool = False) -> PipelineEngine:
    """The pipeline engine of this rank's stage (``plan``) for ``micro_batches`` micro-batches of
    ``micro_batch_size`` sequences of ``seq_length`` tokens; ``dtype``: the residual stream's (the
    parameters', 16-bit under bf16/fp16). ``store``: the split backward's WeightGradStore the model was
    built with. ``forward_only`` (evaluation): no offload, and token slices that do not divide the
    sequence run it whole (slicing changes the pipeline's fill, not a forward's result); in training
    the layout's validation guarantees they divide."""
    local = layout.local_positions(seq_length)
    slices = layout.pp_token_slices
    if local % slices:
        assert forward_only, f"{slices} token slices of {local} positions (layout.validate rejects it)"
        slices = 1
    schedule = build_schedule(layout.schedule, layout.pp, micro_batches, layout.vpp, slices=slices)
    device = groups.device.torch_device
    p2p = (P2P(groups.pp, groups.ledger, (local // slices, micro_batch_size, model.cfg.hidden_size), dtype, device)
           if layout.pp > 1 else None)
    offload = None
    if layout.offload != "none" and not forward_only:
        units = offload_units(schedule.actions[plan.rank], layout.offload, layout.offload_keep)
        offload = ActivationOffload(HostCopies(groups.device), model, units)
    hooks = {} if grads is None else {"on_grads_done": grads.grads_done, "on_weight_grad": grads.weight_grad}
    return PipelineEngine(model, plan, schedule, p2p, autocast=autocast, store=store, offload=offload, **hooks)
