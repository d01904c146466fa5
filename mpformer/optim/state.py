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

from typing import TYPE_CHECKING

import torch

from mpformer.checkpoint.io import MODEL_PREFIX, OPTIM_PREFIX, init_optimizer_state, load_tensors, model_state
from mpformer.checkpoint.rows import chunks, state_chunks
from mpformer.core.shards import Shard

if TYPE_CHECKING:
    from mpformer.optim.engine import GradEngine, ShardParam


class EngineState:
    def __init__(self, engine: GradEngine) -> None:
        self.e = engine
        # 16-bit parameters round the masters, and stage 3 holds no whole parameters: the masters are
        # the weights then; otherwise the parameters themselves are.
        self.masters_are_weights = engine.param_dtype != torch.float32 or engine.stage == 3

    def _saved(self, saving: bool) -> list[ShardParam]:
        return [s for s in self.e.shards if not (saving and id(s.param) in self.e.not_mine)]

    def weight_shards(self, saving: bool = True) -> dict[str, Shard]:
        if not self.masters_are_weights:
            return model_state(self.e.model)
        out: dict[str, Shard] = {}
        for s in self._saved(saving):
            out.update(chunks(self.e.canonical, s.piece, s.master.detach(), MODEL_PREFIX))
        return out

    def load_weights(self, ckpt_dir: str) -> None:
        """Stored ``model.*`` into the masters (fp32, exact) and the parameters (cast)."""
        if self.masters_are_weights:
            load_tensors(ckpt_dir, self.weight_shards(saving=False))
        if self.e.stage < 3:
            load_tensors(ckpt_dir, model_state(self.e.model))
        self.e.write_back()

    def state_shards(self, saving: bool = True) -> dict[str, Shard]:
        opt = self.e.optimizer
        init_optimizer_state(opt)
        out, _ = state_chunks(self.e.canonical, [(s.piece, s.master) for s in self._saved(saving)], opt, OPTIM_PREFIX)
        out[OPTIM_PREFIX + "step"] = Shard.full(torch.tensor([float(self.e.steps_taken)]))
        return out

    def load_state(self, ckpt_dir: str) -> int:
        """The optimizer's state from the checkpoint; returns the optimizer steps taken."""
        targets = self.state_shards(saving=False)
        load_tensors(ckpt_dir, targets)
        steps = int(targets[OPTIM_PREFIX + "step"].local.reshape(-1)[0])
        for s in self.e.shards:
            st = self.e.optimizer.state[s.master]
            if "step" in st:
                st["step"].fill_(float(steps))
        return steps
