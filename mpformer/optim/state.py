"""The gradient engine's part of a checkpoint: weights and optimizer state by canonical name and slice.

    weights   ``model.*``: the parameters' canonical shards (fp32, stages 0-2), or the fp32 masters
              as chunks (16-bit parameters, or stage 3, whose parameters are not materialised)
    state     ``optim.<key>.*``: the optimizer's per-element tensors as chunks, through the same row
              map as the masters (checkpoint/rows.py; stage 0 is the one-piece case), and
              ``optim.step`` once

A chunk lands exactly where an unsharded run would have put those elements, so any layout and any
stage reads its own slices back. A tied copy that another stage owns is loaded but not saved (its
chunks would overlap the owner's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mpformer.checkpoint.io import MODEL_PREFIX, OPTIM_PREFIX, init_optimizer_state, load_tensors, model_state
from mpformer.checkpoint.rows import CanonicalRows, chunks, state_chunks
from mpformer.core.shards import Shard
from mpformer.optim.bucket import ShardParam


class EngineState:
    """Built by the engine from what a checkpoint reads and fills: the model, this rank's shards (their
    masters are what the optimizer steps), the optimizer, the canonical row map. ``not_mine``: ids of
    tied copies another stage owns (loaded, not saved). ``masters_are_weights``: 16-bit parameters
    round the masters, and stage 3 holds no whole parameters, so the masters are the weights then;
    otherwise the parameters themselves are. Loading fills the masters; casting them back into the
    parameters is the engine's (write_back)."""

    def __init__(self, model: nn.Module, shards: Sequence[ShardParam], optimizer: torch.optim.Optimizer,
                 canonical: Sequence[CanonicalRows], *, stage: int, not_mine: set[int],
                 masters_are_weights: bool) -> None:
        self.model, self.shards, self.optimizer, self.canonical = model, shards, optimizer, canonical
        self.stage, self.not_mine, self.masters_are_weights = stage, not_mine, masters_are_weights

    def _saved(self, saving: bool) -> list[ShardParam]:
        return [s for s in self.shards if not (saving and id(s.param) in self.not_mine)]

    def weight_shards(self, saving: bool = True) -> dict[str, Shard]:
        if not self.masters_are_weights:
            return model_state(self.model)
        out: dict[str, Shard] = {}
        for s in self._saved(saving):
            out.update(chunks(self.canonical, s.piece, s.master.detach(), MODEL_PREFIX))
        return out

    def load_weights(self, ckpt_dir: str) -> None:
        """Stored ``model.*`` into the masters (fp32, exact) and the parameters (the caller then casts
        the masters into 16-bit parameters)."""
        if self.masters_are_weights:
            load_tensors(ckpt_dir, self.weight_shards(saving=False))
        if self.stage < 3:
            load_tensors(ckpt_dir, model_state(self.model))

    def state_shards(self, steps_taken: int, saving: bool = True) -> dict[str, Shard]:
        """The optimizer's state as chunks, and ``steps_taken`` as ``optim.step``."""
        opt = self.optimizer
        init_optimizer_state(opt)
        out, _ = state_chunks(self.canonical, [(s.piece, s.master) for s in self._saved(saving)], opt, OPTIM_PREFIX)
        out[OPTIM_PREFIX + "step"] = Shard.full(torch.tensor([float(steps_taken)]))
        return out

    def load_state(self, ckpt_dir: str) -> int:
        """The optimizer's state from the checkpoint; returns the optimizer steps taken."""
        targets = self.state_shards(0, saving=False)  # the step is read into it
        load_tensors(ckpt_dir, targets)
        steps = int(targets[OPTIM_PREFIX + "step"].local.reshape(-1)[0])
        for s in self.shards:
            st = self.optimizer.state[s.master]
            if "step" in st:
                st["step"].fill_(float(steps))
        return steps
