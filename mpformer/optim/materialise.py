"""A bucket's weights: the flat parameter buffer, this rank's shard of it, and the fp32 masters.

Two ways in. A materialised model's parameters are copied into the buffer (``init=None``). A model
built on the meta device (models/parallelize.py, ``deferred``) is filled from the blocked
initialiser (models/init.py) instead, and only where this rank keeps values:

    stage   allocated and drawn                       the full buffer
    0-2     the whole bucket (every rank holds it)    the parameters' home
    3       this rank's shard only                    allocated empty, viewed, freed at once

At stage 3 a rank keeps its shard once: fp32 parameters as the shard itself, 16-bit ones as the fp32
masters alone (the gathers cast them, optim/gather.py), so no 16-bit copy outlives a gather.

Each piece of what a rank fills is a flat range of one (tensor-parallel) parameter; checkpoint/rows.py
cuts it into rectangles of canonical tensors at their global offsets, which is exactly what the
initialiser draws, so a ZeRO-3 rank draws only the blocks that meet its shard and ends with the
single-device model's values. Parameters become views into the buffer through ``p.data`` (a meta
parameter first swaps its contents for a real placeholder, ``torch.utils.swap_tensors``: a meta
tensor's data cannot be set to a real one), so the parameter objects that hooks, gradient specs and
the pipeline hold stay the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mpformer.checkpoint.rows import CanonicalRows, chunks
from mpformer.core.buffers import BucketLayout, Piece
from mpformer.models.init import ModelInit


def fill_piece(dst: torch.Tensor, piece: Piece, canonical: Sequence[CanonicalRows], init: ModelInit) -> None:
    """``dst`` (flat, zeros) gets elements ``[piece.lo, piece.hi)`` of its parameter's initial values;
    elements that are no canonical tensor's (vocabulary padding rows) stay 0."""
    for key, sh in chunks(canonical, piece, dst, "").items():
        init.fill_shard(key, sh)


def place(params: Sequence[nn.Parameter], layout: BucketLayout, buf: torch.Tensor) -> None:
    """Every parameter becomes its slot's view of ``buf``, keeping its identity."""
    for p, s in zip(params, layout.slots):
        shape = p.shape
        if p.is_meta:  # a real placeholder first: its own version counter, not the buffer's
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, dtype=buf.dtype, device=buf.device),
                                                     requires_grad=p.requires_grad))
        # .data keeps the parameter's version counter: ZeRO-3's gathers write into the buffer while
        # autograd holds the parameter, and must not look like in-place changes of it.
        p.data = buf[s.start:s.end].view(shape)


def free(buf: torch.Tensor) -> None:
    """ZeRO-3: the full buffer has no storage until its unit is gathered (optim/gather.py)."""
    buf.untyped_storage().resize_(0)


@torch.no_grad()
def bucket_weights(params: Sequence[nn.Parameter], layout: BucketLayout, *, rank: int, stage: int,
                   dtype: torch.dtype, device: torch.device, canonical: Sequence[CanonicalRows],
                   init: ModelInit | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(param_buf, param_shard, masters) of one bucket; ``params`` in slot order. 16-bit parameters
    get fp32 masters of this rank's shard, from the full-precision values rather than their rounding.
    Stage 3's buffer is freed and its shard is its own tensor (fp32), or none beside the masters
    (16-bit); below stage 3 the shard is a view of the buffer."""
    lo, hi = layout.shard_range(rank)
    low_precision = dtype != torch.float32
    if init is not None and stage == 3:  # the shard alone, drawn in fp32
        mine = torch.zeros(hi - lo, device=device)
        for piece in layout.pieces(rank):
            fill_piece(mine[piece.shard_offset:piece.shard_offset + piece.numel], piece, canonical, init)
        buf = torch.empty(layout.size, dtype=dtype, device=device)  # never written: viewed, then freed
        place(params, layout, buf)
        free(buf)
        return buf, (None if low_precision else mine), (mine if low_precision else None)
    buf = torch.zeros(layout.size, dtype=dtype, device=device)
    full = torch.zeros(layout.size, device=device) if low_precision else buf  # fp32 values
    for p, s in zip(params, layout.slots):
        if init is not None:
            fill_piece(full[s.start:s.end], Piece(s.index, 0, s.numel, 0), canonical, init)
        else:
            full[s.start:s.end].copy_(p.detach().reshape(-1))
    if low_precision:
        buf.copy_(full)
    place(params, layout, buf)
    masters = (full if hi - lo == layout.size else full[lo:hi].clone()) if low_precision else None
    if stage < 3:
        return buf, buf[lo:hi], masters
    shard = None if low_precision else buf[lo:hi].clone()
    free(buf)
    return buf, shard, masters
