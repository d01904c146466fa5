"""What a linear layer needs to run its GEMMs in float8 (train.precision=fp8, issue 35): a mixin shared by
the one-device ``Linear`` (layers/linear.py) and the tensor-parallel ``ColumnParallelLinear`` and
``RowParallelLinear`` (layers/parallel.py), so that the three carry the same state, the same checkpointed
buffers and the same forward into layers/fp8_linear.py.

A layer is switched on by models/fp8.py (``enable_fp8``), which also tells it which groups split its
operands (``Fp8Shards``: context parallelism's tokens, the layer's own tp split, sequence parallelism).

Delayed scaling under full recompute: a recomputed forward must cast x and W exactly as the first
forward did (else the tensors saved for backward no longer match the ones used), but the first forward
has already moved the scales by recording its amaxes. As Transformer Engine does, the first forward
stashes the scales it used and the recompute replays them, recording nothing (``recompute_contexts``:
a checkpoint ``context_fn`` for one block, or for the routed experts alone under selective recompute).
Micro-batches recompute in the order they ran forward on a chunk in every schedule, so each layer's stash
is a FIFO queue. ``DelayedReplay`` is that part alone, shared with the routed experts (layers/moe.py).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from mpformer.layers.fp8 import DelayedScalingState, Float8Recipe
from mpformer.layers.fp8_linear import ONE, Fp8Shards, fp8_linear
from mpformer.layers.grad_store import WeightGradStore, grad_sink
from mpformer.parallel.comm import Comm
from mpformer.parallel.device import autocast_dtype, no_autocast


class DelayedReplay(nn.Module):
    """A module whose delayed-scaling casts stash their forward scales in a recomputed region's first
    forward and replay them in its recompute (module docstring): ``fp8_mode`` is set by
    ``recompute_contexts``, ``fp8_stash`` is the module's FIFO of scales."""

    fp8: Float8Recipe | None = None
    fp8_mode: str | None = None  # delayed scaling inside a recomputed region: "stash" (first forward) | "replay"
    fp8_stash: collections.deque[torch.Tensor]

    def fp8_queues(self) -> tuple[collections.deque[torch.Tensor] | None, collections.deque[torch.Tensor] | None]:
        """(stash, replay): the deque where this forward's scales go, the one they come from (None: neither)."""
        return (self.fp8_stash if self.fp8_mode == "stash" else None,
                self.fp8_stash if self.fp8_mode == "replay" else None)


class Float8Layer(DelayedReplay):
    """A linear layer (``weight`` [N, K], ``bias``, ``store``) that may run in float8: ``fp8`` is its
    recipe once enabled (None: its own bf16/fp32 path), ``fp8_shards`` how its operands are split."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    store: WeightGradStore | None
    fp8_shards: Fp8Shards = ONE

    def fp8_split(self, tokens: tuple[Comm, ...]) -> Fp8Shards:
        """How this layer's operands are split, given the groups splitting the tokens (context
        parallelism). A one-device layer holds whole x, W and dY rows of its tokens."""
        return Fp8Shards(tokens=tokens)

    def enable_fp8(self, recipe: Float8Recipe, tokens: tuple[Comm, ...] = ()) -> None:
        """Float8 GEMMs from now on. Delayed scaling keeps its amax history [3, H] and scales [3] as this
        module's buffers ``fp8_amax_history`` and ``fp8_scale`` (fp32; saved by the run's checkpoints
        through Transformer.canonical_buffers, so a resume continues with the same scales). The amaxes are
        all-reduced over the shards, so every tensor-parallel rank holds the same history."""
        self.fp8, self.fp8_shards = recipe, self.fp8_split(tokens)
        if recipe.name == "delayed":
            state = DelayedScalingState(recipe, device=self.weight.device)
            self.register_buffer("fp8_amax_history", state.amax_history)
            self.register_buffer("fp8_scale", state.scales)
            self.fp8_stash: collections.deque[torch.Tensor] = collections.deque()

    def reset_buffers(self, device: torch.device | str) -> None:
        """Delayed scaling's state re-created on ``device`` (models/init.py materialise_buffers): no amax
        seen yet, every scale 1."""
        if self.fp8 is not None and self.fp8.name == "delayed":
            state = DelayedScalingState(self.fp8, device=device)
            self.fp8_amax_history, self.fp8_scale = state.amax_history, state.scales

    def fp8_state(self) -> DelayedScalingState | None:
        """A view of the buffers as the numerics' state object, made per call: a checkpoint load or a
        ``.to()`` may have replaced the buffer tensors, and the state must update the ones saved."""
        if self.fp8 is None or self.fp8.name != "delayed":
            return None
        state = DelayedScalingState.__new__(DelayedScalingState)
        state.recipe, state.amax_history, state.scales = self.fp8, self.fp8_amax_history, self.fp8_scale
        state.stash, state.replay = self.fp8_queues()
        return state

    def fp8_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight^T (+ ``bias``) in float8; under sequence parallelism x is this rank's shard."""
        assert self.fp8 is not None
        want = autocast_dtype(x) or (x.dtype if x.dtype == torch.float32 else torch.bfloat16)
        out = gemm_out_dtype(self.fp8, want)
        sink = grad_sink(self.weight)
        with no_autocast(x):  # the casts and scales are the recipe's, not autocast's
            y = fp8_linear(x, self.weight, self.fp8, self.fp8_state(), bias, out, self.store, self.fp8_shards, sink)
        return y if y.dtype == want else y.to(want)


def gemm_out_dtype(recipe: Float8Recipe, want: torch.dtype) -> torch.dtype:
    """What a float8 GEMM writes when ``want`` is asked for: CUDA's rowwise-scaled kernel writes bf16 only
    (an fp32 caller outside autocast gets it cast up), the tensorwise one bf16 or fp32."""
    return torch.bfloat16 if recipe.name == "rowwise" else want


def recompute_contexts(block: nn.Module) -> Callable[[], tuple[contextlib.AbstractContextManager, ...]] | None:
    """A torch.utils.checkpoint ``context_fn`` for ``block``'s delayed-scaling float8 layers and experts (the
    module docstring): its first forward stashes their scales, its recompute replays them. None when it has
    none."""
    layers = [m for m in block.modules() if isinstance(m, DelayedReplay) and m.fp8 is not None
              and m.fp8.name == "delayed"]
    if not layers:
        return None

    @contextlib.contextmanager
    def mode(name: str) -> Iterator[None]:
        for m in layers:
            m.fp8_mode = name
        try:
            yield
        finally:
            for m in layers:
                m.fp8_mode = None

    return lambda: (mode("stash"), mode("replay"))
