"""Per-parameter tensors as checkpoint chunks: by canonical name and slice (the one row map).

A rank's part of a parameter covers a contiguous range ``[lo, hi)`` of the flattened (tensor-
parallel) parameter (core.buffers.Piece; a whole parameter is the one-piece case, which is how
unsharded optimizers are saved too). A canonical tensor's block in that parameter is a set of
whole rows (q of a fused qkv, a vocabulary block, a row-parallel column block), so the range cuts
it into at most three rectangles: the end of a first row, whole rows, the start of a last row. Each
rectangle is saved as a chunk of ``optim.<state>.<canonical name>`` (or, for master weights,
``model.<canonical name>``) at its global offsets, exactly where an unsharded run would have put
those elements, so any layout, sharded or not, reads its own slices back (DCP resolves overlaps).

The map from canonical names to parameter rows is taken once, before the gradient engine moves the
parameters into its buffers (on a meta-built model: before they exist; ZeRO-3 frees the storage the
views point into afterwards).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpformer.core.buffers import Piece
from mpformer.core.shards import Shard


@dataclass(frozen=True)
class CanonicalRows:
    """Canonical tensor ``name`` is rows ``[first, first + rows)`` (of ``row`` elements) of parameter
    ``index``, stored at ``offsets`` of a tensor of ``global_shape``."""

    name: str
    index: int
    first: int
    rows: int
    row: int
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _inside(view: torch.Tensor, p: nn.Parameter) -> bool:
    # The same storage object, not the same data pointer: every meta tensor's pointer is null (a
    # model built on the meta device maps its rows before the gradient engine allocates them).
    if view.numel() == 0 or view.untyped_storage()._cdata != p.untyped_storage()._cdata:
        return False
    return p.storage_offset() <= view.storage_offset() < p.storage_offset() + p.numel()


def canonical_rows(model: nn.Module, params: Sequence[nn.Parameter]) -> list[CanonicalRows]:
    """Where every canonical tensor of this rank lives in ``params`` (real or on the meta device)."""
    out = []
    for name, sh in model.canonical_shards().items():
        for i, p in enumerate(params):
            if _inside(sh.local, p):
                row = p.numel() // p.shape[0] if p.dim() > 1 else 1
                first = (sh.local.storage_offset() - p.storage_offset()) // row
                rows = sh.local.shape[0] if sh.local.dim() > 0 else 1
                assert sh.local.numel() == rows * row, "canonical views are blocks of whole rows"
                out.append(CanonicalRows(name, i, first, rows, row, tuple(sh.global_shape), tuple(sh.offsets)))
                break
    return out


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


def chunks(canon: Sequence[CanonicalRows], piece: Piece, t: torch.Tensor, prefix: str) -> dict[str, Shard]:
    """``t`` (elements ``[piece.lo, piece.hi)`` of a flat parameter, contiguous) as checkpoint chunks
    of ``prefix + canonical name``; views of ``t``, so loading fills it in place."""
    t = t.reshape(-1)
    out = {}
    for c in canon:
        if c.index != piece.index:
            continue
        a, b = max(piece.lo, c.first * c.row), min(piece.hi, (c.first + c.rows) * c.row)
        if a >= b:
            continue
        fqn = prefix + c.name
        rects = rectangles(a - c.first * c.row, b - c.first * c.row, c.row)
        for r, col, nr, nc in rects:
            flat = (c.first + r) * c.row + col - piece.lo
            if len(c.global_shape) > 1:
                offsets, shape = (c.offsets[0] + r, c.offsets[1] + col), (nr, nc)
            else:
                offsets, shape = (c.offsets[0] + r,), (nr,)
            key = fqn if len(rects) == 1 else f"{fqn}@{offsets}"  # one chunk: keyed by the stored name
            out[key] = Shard(t[flat:flat + nr * nc].view(shape), c.global_shape, offsets, fqn)
    return out


def state_chunks(canon: Sequence[CanonicalRows], pieces: Sequence[tuple[Piece, torch.Tensor]],
                 optimizer: torch.optim.Optimizer, prefix: str) -> tuple[dict[str, Shard], float | None]:
    """``prefix<key>.<name>`` chunks of every per-element state tensor of the optimizer parameters in
    ``pieces`` (each with the part of a model parameter it holds), and their common step count."""
    out: dict[str, Shard] = {}
    steps = set()
    for piece, param in pieces:
        state = optimizer.state[param]
        if "step" in state:
            steps.add(float(state["step"]))
        for key, t in state.items():
            if torch.is_tensor(t) and t.dim() > 0:
                out.update(chunks(canon, piece, t, f"{prefix}{key}."))
    assert len(steps) <= 1, f"shards disagree on the optimizer step: {steps}"
    return out, (next(iter(steps)) if steps else None)
