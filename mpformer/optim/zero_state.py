"""ZeRO optimizer state in the layout-free checkpoint: by canonical name and slice.

A rank's optimizer state for a parameter covers a contiguous range ``[lo, hi)`` of the flattened
(tensor-parallel) parameter (buffers.Piece). A canonical tensor's block in that parameter is a set
of whole rows (q of a fused qkv, a vocabulary block, a row-parallel column block), so the range
cuts it into at most three rectangles: the end of a first row, whole rows, the start of a last
row. Each rectangle is saved as a chunk of ``optim.<state>.<canonical name>`` at its global offsets,
exactly where an unsharded run would have put those elements, so any layout, sharded or not, reads
its own slices back (DCP resolves the overlaps).
"""

from __future__ import annotations

import torch
from torch import nn

from mpformer.checkpoint.io import OPTIM_PREFIX, init_adam_state
from mpformer.checkpoint.shards import Shard
from mpformer.optim.zero import ShardParam, ZeroOptimizer


def _inside(view: torch.Tensor, p: nn.Parameter) -> bool:
    """Whether ``view`` looks into ``p`` (parameters of a bucket share one storage: compare ranges)."""
    if view.numel() == 0 or view.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
        return False
    return p.storage_offset() <= view.storage_offset() < p.storage_offset() + p.numel()


def _row_block(view: torch.Tensor, p: nn.Parameter) -> tuple[int, int, int]:
    """(first row, rows, row length) of ``view``, a block of whole rows of parameter ``p``."""
    row = p.numel() // p.shape[0] if p.dim() > 1 else 1
    first = (view.storage_offset() - p.storage_offset()) // row
    rows = view.shape[0] if view.dim() > 0 else 1
    assert view.numel() == rows * row, "canonical views are blocks of whole rows"
    return first, rows, row


def rectangles(x: int, y: int, row: int) -> list[tuple[int, int, int, int]]:
    """Flat range [x, y) of a row-major block with rows of ``row`` as (row, col, rows, cols) pieces."""
    out = []
    r0, c0 = divmod(x, row)
    r1, c1 = divmod(y, row)
    if r0 == r1:
        return [(r0, c0, 1, c1 - c0)] if c1 > c0 else []
    if c0:
        out.append((r0, c0, 1, row - c0))
        r0 += 1
    if r1 > r0:
        out.append((r0, 0, r1 - r0, row))
    if c1:
        out.append((r1, 0, 1, c1))
    return out


def _chunks(canonical: dict[str, Shard], shard: ShardParam) -> list[tuple[str, tuple[int, ...], slice, tuple]]:
    """(canonical name, global offsets, slice of the master, local shape) per rectangle."""
    p, piece = shard.param, shard.piece
    out = []
    for name, sh in canonical.items():
        if not _inside(sh.local, p):
            continue
        first, rows, row = _row_block(sh.local, p)
        a, b = max(piece.lo, first * row), min(piece.hi, (first + rows) * row)
        if a >= b:
            continue
        for r, c, nr, nc in rectangles(a - first * row, b - first * row, row):
            flat = r * row + c + first * row - piece.lo
            if p.dim() > 1:
                offsets = (sh.offsets[0] + r, sh.offsets[1] + c)
                out.append((name, offsets, slice(flat, flat + nr * nc), (nr, nc)))
            else:
                out.append((name, (sh.offsets[0] + r,), slice(flat, flat + nr), (nr,)))
    return out


def zero_optimizer_state(model: nn.Module, zero: ZeroOptimizer) -> dict[str, Shard]:
    """``optim.<key>.<name>`` chunks of this rank's optimizer state, and the step count once."""
    init_adam_state(zero.optimizer)
    canonical = model.canonical_shards()
    out: dict[str, Shard] = {}
    steps = set()
    for s in zero.shards:
        state = zero.optimizer.state[s.master]
        steps.add(float(state["step"]))
        for key, t in state.items():
            if t.dim() == 0:
                continue
            for name, offsets, sl, shape in _chunks(canonical, s):
                sh = canonical[name]
                fqn = f"{OPTIM_PREFIX}{key}.{name}"
                out[f"{fqn}@{offsets}"] = Shard(t[sl].view(shape), tuple(sh.global_shape), offsets, fqn)
    if steps:
        assert len(steps) == 1, f"shards disagree on the optimizer step: {steps}"
    step = next(iter(steps)) if steps else 0.0
    out[OPTIM_PREFIX + "step"] = Shard.full(torch.tensor([step]))
    return out


def set_zero_step(zero: ZeroOptimizer, step_tensor: torch.Tensor) -> None:
    for s in zero.shards:
        zero.optimizer.state[s.master]["step"].fill_(float(step_tensor.reshape(-1)[0]))


def load_zero_state(ckpt_dir: str, model: nn.Module, zero: ZeroOptimizer) -> None:
    """Read this rank's slices of the stored optimizer state (written under any layout)."""
    from mpformer.checkpoint.io import load_tensors

    targets = zero_optimizer_state(model, zero)
    load_tensors(ckpt_dir, targets)
    set_zero_step(zero, targets[OPTIM_PREFIX + "step"].local)
