"""What the ZeRO stages share: shard parameters, one global norm, fp16 unscaling, checkpoint state.

A subclass (zero.py: stages 0-2 of a 16-bit model and 1-2 of any; zero3.py: stage 3) lays the
parameters out in flat buffers and fills ``self.shards``: one ``ShardParam`` per parameter piece
this rank updates, whose ``master`` (fp32) the wrapped optimizer steps and whose ``master.grad`` is
a view into the rank's fp32 gradient shard. Everything below works on those shards only:

    norm      sum of squares of the pieces (tp-replicated blocks weighted 1/replicas), all-reduced
              over dp (the pieces partition every gradient), tp and pp
    unscale   fp16: divide the gradient shards by the loss scale; one inf/nan anywhere -> skip
    weights   16-bit or stage 3: the fp32 masters are the checkpoint's ``model.*`` tensors
    state     the optimizer's per-element tensors as ``optim.<key>.*`` chunks (zero_state.py)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mpformer.checkpoint.io import MODEL_PREFIX, OPTIM_PREFIX, init_optimizer_state, load_tensors, model_state
from mpformer.core.shards import Shard
from mpformer.optim.memory import model_state_bytes
from mpformer.optim.zero_state import ShardParam, canonical_rows, chunks, sharded_state
from mpformer.parallel.comm import Comm
from mpformer.parallel.tensor_parallel import GradSpec


class ShardedBase:
    stage: int
    shards: list[ShardParam]

    def __init__(self, model: nn.Module, comm: Comm, *, stage: int, param_dtype: torch.dtype) -> None:
        self.model, self.comm, self.stage, self.param_dtype = model, comm, stage, param_dtype
        self.sync = True
        self.steps_taken = 0
        self._norm_comm = Comm(comm.group, comm.ledger, tag=comm.tag + "norm.")  # scalars: their own kind
        names = {id(p): n for n, p in model.named_parameters()}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [names[id(p)] for p in self.params]
        self.canonical = canonical_rows(model, self.params)  # before any storage moves or is freed
        self._skip_on_save: set[int] = set()

    def skip_on_save(self, p: nn.Parameter) -> None:
        """Do not write ``p``'s chunks (a copy another rank writes; it is still loaded here)."""
        self._skip_on_save.add(id(p))

    def _saved(self, saving: bool) -> list[ShardParam]:
        return [s for s in self.shards if not (saving and id(s.param) in self._skip_on_save)]

    def _build_optimizer(self, groups: Sequence[dict], make: Callable[[list[dict]], torch.optim.Optimizer]) -> None:
        group_of = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
        inner = []
        for k, g in enumerate(groups):
            opts = {key: v for key, v in g.items() if key != "params"}
            inner.append({**opts, "params": [s.master for s in self.shards if group_of[id(s.param)] == k]})
        self.optimizer = make(inner)

    def grad_shard_buffers(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def weight_buffers(self) -> list[torch.Tensor]:
        raise NotImplementedError

    # ---- norm, clipping, fp16 ------------------------------------------------------------------
    def shard_grads(self, specs: Sequence[GradSpec]) -> list[tuple[torch.Tensor, GradSpec]]:
        """This rank's part of each spec's gradient block (a view into the gradient shard)."""
        by_param: dict[int, list[ShardParam]] = {}
        for s in self.shards:
            by_param.setdefault(id(s.param), []).append(s)
        out = []
        for spec in specs:
            p = spec.param
            row = p.numel() // p.shape[0] if p.dim() > 0 else 1
            lo, hi = (0, p.numel()) if spec.rows is None else (spec.rows[0] * row, spec.rows[1] * row)
            for s in by_param.get(id(p), []):
                a, b = max(lo, s.piece.lo), min(hi, s.piece.hi)
                if a < b:
                    assert s.master.grad is not None
                    out.append((s.master.grad[a - s.piece.lo:b - s.piece.lo], spec))
        return out

    def sync_tp(self, specs: Sequence[GradSpec]) -> None:
        """Sum partial gradients over tp groups on the shards (tp ranks share dp rank and layout)."""
        for g, spec in self.shard_grads([s for s in specs if s.sync is not None]):
            assert spec.sync is not None
            spec.sync.all_reduce(g)

    def _world_reduce(self, t: torch.Tensor, tp: Comm | None, pp: Comm | None,
                      op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        for comm in (self._norm_comm if self.stage > 0 else None, tp, pp):
            if comm is not None and comm.size > 1:
                comm.all_reduce(t, op=op)

    def clip(self, specs: Sequence[GradSpec], max_norm: float, tp: Comm | None, pp: Comm | None) -> float:
        """Global gradient norm before clipping; scales the gradient shards when it exceeds ``max_norm``."""
        total = torch.zeros((), dtype=torch.float32, device=self.grad_shard_buffers()[0].device)
        for g, spec in self.shard_grads([s for s in specs if s.in_norm]):
            total += g.float().pow(2).sum() / spec.replicas
        self._world_reduce(total, tp, pp)
        total = total.sqrt()
        if max_norm > 0:
            coeff = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in self.grad_shard_buffers():
                g.mul_(coeff)
        return float(total)

    def unscale(self, inv_scale: float, tp: Comm | None, pp: Comm | None) -> bool:
        """Divide the gradient shards by the loss scale; True if any rank found an inf or nan."""
        found = torch.zeros((), dtype=torch.float32, device=self.grad_shard_buffers()[0].device)
        for g in self.grad_shard_buffers():
            g.mul_(inv_scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        self._world_reduce(found, tp, pp, op=dist.ReduceOp.MAX)
        return bool(found)

    # ---- checkpoints ---------------------------------------------------------------------------
    def _masters_are_weights(self) -> bool:
        return self.param_dtype != torch.float32 or self.stage == 3

    def weight_shards(self, model: nn.Module, saving: bool = True) -> dict[str, Shard]:
        """``model.*``: the fp32 masters as chunks (16-bit or stage 3), else the parameters themselves."""
        if not self._masters_are_weights():
            return model_state(model)
        out: dict[str, Shard] = {}
        for s in self._saved(saving):
            out.update(chunks(self.canonical, s, s.master.detach(), MODEL_PREFIX))
        return out

    def load_weights(self, ckpt_dir: str, model: nn.Module) -> None:
        """Stored ``model.*`` into the masters (fp32, exact) and the parameters (cast)."""
        if self._masters_are_weights():
            load_tensors(ckpt_dir, self.weight_shards(model, saving=False))
        if self.stage < 3:
            load_tensors(ckpt_dir, model_state(model))
        self._write_back()

    def _write_back(self) -> None:
        """Masters -> 16-bit parameters (each subclass knows where its parameter shard lives)."""

    def state_shards(self, model: nn.Module, saving: bool = True) -> dict[str, Shard]:
        init_optimizer_state(self.optimizer)
        out, _ = sharded_state(self.canonical, self._saved(saving), self.optimizer, OPTIM_PREFIX)
        out[OPTIM_PREFIX + "step"] = Shard.full(torch.tensor([float(self.steps_taken)]))
        return out

    def load_state(self, ckpt_dir: str, model: nn.Module) -> None:
        targets = self.state_shards(model, saving=False)
        load_tensors(ckpt_dir, targets)
        self.steps_taken = int(targets[OPTIM_PREFIX + "step"].local.reshape(-1)[0])
        for s in self.shards:
            st = self.optimizer.state[s.master]
            if "step" in st:
                st["step"].fill_(float(self.steps_taken))

    def memory(self) -> dict[str, int]:
        masters = [s.master for s in self.shards] if self.param_dtype != torch.float32 else []
        return model_state_bytes(self.weight_buffers(), self.grad_shard_buffers() + self._full_grads(), masters,
                                 self.optimizer)

    def _full_grads(self) -> list[torch.Tensor]:
        return []

    def remove_hooks(self) -> None:
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
