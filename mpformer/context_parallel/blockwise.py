"""Attention over blocks of keys on torch's fused kernels, merged by log-sum-exp, with an exact backward.

A query part and a key block are each a list of segments (core/sequence.py): runs of global
positions. The causal mask, a sliding window and a document mask are all functions of the global
positions and of the documents they fall in, so any split and any storage order is attended
correctly: the attention plan (core/attention_plan.py) cuts the seen pairs into blocks, and each
block is one call of the device's fused kernel with the log-sum-exp (fused.py). No block holds a
score matrix or a mask larger than the plan's tile, and a block no query may see costs nothing.

Shape legend: b batch, n query heads, k kv heads (GQA: the kernels take fewer kv heads natively),
q/s query/key positions, d head dim. Queries ``[b, n, q, d]``, keys and values ``[b, k, s, d]``.
The merged output and statistics are fp32 for 16-bit and fp32 inputs (fp64 stays fp64).

    forward (one block):  out_b, lse_b = kernel(q, k, v)       (softmax over the block's keys)
    merge:                lse' = logaddexp(lse, lse_b)    out' = exp(lse - lse') out + exp(lse_b - lse') out_b
    backward (one block): dq_b, dk_b, dv_b = kernel_backward(dout, q, k, v, out_final, lse_final)

Documents are given as each batch row's document starts (host integers, ``DocStarts``): rows with
the same starts run together, each different one by itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mpformer.context_parallel.fused import block_backward as fused_backward
from mpformer.context_parallel.fused import block_forward as fused_forward
from mpformer.core.attention_plan import DocStarts, ScoreBlock, plan
from mpformer.core.sequence import Segments
from mpformer.parallel.device import no_autocast

NEG_INF = float("-inf")
Docs = tuple[DocStarts, ...] | None  # per batch row (None: no document mask)


@dataclass(frozen=True)
class KVBlock:
    """Keys and values ``[b, k, s, d]`` whose positions are ``segments``."""

    k: torch.Tensor
    v: torch.Tensor
    segments: Segments


@dataclass(frozen=True)
class QueryPart:
    """Queries ``[b, n, q, d]`` at ``segments``; the document starts of each row; the attention's rules."""

    q: torch.Tensor
    segments: Segments
    docs: Docs
    window: int | None
    scale: float
    dropout: float = 0.0  # CUDA's fused kernels only (fused.py); each block call draws its own mask


@functools.lru_cache(maxsize=256)
def segment_index(segments: Segments, device: torch.device) -> torch.Tensor:
    """The global positions of ``segments`` in storage order, as a tensor (built once per split: every
    layer of every micro-batch asks for the same few)."""
    return torch.cat([torch.arange(s.start, s.stop, device=device) for s in segments])


def doc_starts(doc_ids_bs: torch.Tensor) -> tuple[DocStarts, ...]:
    """Each row's document starts from its document ids ``[b, s]`` (one host copy of the boundaries)."""
    cuts = (doc_ids_bs[:, 1:] != doc_ids_bs[:, :-1]).nonzero().tolist()
    rows: list[list[int]] = [[] for _ in range(doc_ids_bs.shape[0])]
    for r, p in cuts:
        rows[r].append(p + 1)
    return tuple(tuple(r) for r in rows)


def row_plans(batch: int, q_segments: Segments, k_segments: Segments, docs: Docs, window: int | None
              ) -> list[tuple[slice, tuple[ScoreBlock, ...]]]:
    """Runs of batch rows that share one plan (the same document starts), each with it."""
    if docs is None:
        return [(slice(0, batch), plan(q_segments, k_segments, window))]
    out, start = [], 0
    for r in range(1, batch + 1):
        if r == batch or docs[r] != docs[start]:
            out.append((slice(start, r), plan(q_segments, k_segments, window, docs[start])))
            start = r
    return out


def _row_groups(qp: QueryPart, kv: KVBlock) -> list[tuple[slice, tuple[ScoreBlock, ...]]]:
    return row_plans(qp.q.shape[0], qp.segments, kv.segments, qp.docs, qp.window)


def _rows(qp: QueryPart, kv: KVBlock, rows_b: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch rows ``rows_b`` of q, k and v, the keys and values in the queries' dtype (16-bit K/V travel
    as they are and meet fp32 queries here when the kernel choice computes in fp32)."""
    q = qp.q[rows_b]
    return q, kv.k[rows_b].to(q.dtype), kv.v[rows_b].to(q.dtype)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 statistics for 16-bit and fp32 inputs; fp64 stays fp64 (exact tests)."""
    return torch.promote_types(t.dtype, torch.float32)


class Accumulator:
    """The running (out, lse) of every query row, merged block by block."""

    def __init__(self, q: torch.Tensor) -> None:
        self.out = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
        self.lse = torch.full(q.shape[:-1], NEG_INF, dtype=acc_dtype(q), device=q.device)
        self.rng: list = []  # with dropout: each block call's kernel state, in call order, for the backward

    def add(self, qp: QueryPart, kv: KVBlock) -> None:
        for rows_b, blocks in _row_groups(qp, kv):
            q, k, v = _rows(qp, kv, rows_b)
            for blk in blocks:
                out_b, lse_b, rng = fused_forward(q[:, :, blk.q_rows], k[:, :, blk.k_rows], v[:, :, blk.k_rows],
                                                  blk, qp.window, qp.scale, qp.dropout)
                self.rng.append(rng)
                self._merge(rows_b, blk.q_rows, out_b, lse_b.to(self.lse.dtype))

    def _merge(self, rows_b: slice, rows: slice, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        lse_a = self.lse[rows_b, :, rows]
        lse = torch.logaddexp(lse_a, lse_b)
        out = self.out[rows_b, :, rows]
        out.mul_(torch.exp(lse_a - lse).unsqueeze(-1)).add_(out_b * torch.exp(lse_b - lse).unsqueeze(-1))
        lse_a.copy_(lse)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return self.out.to(dtype)


@dataclass
class Saved:
    """What the backward needs of the forward: the final output (the inputs' dtype) and statistics."""

    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor
    rng: list | None = None  # the forward's block calls' dropout states, in call order (Accumulator.rng)

    @classmethod
    def of(cls, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, rng: list | None = None) -> Saved:
        return cls(out, lse, dout.to(out.dtype).contiguous(), rng)


def block_backward(qp: QueryPart, kv: KVBlock, saved: Saved, dq: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds this key block's query gradients into ``dq`` (fp32); returns its (dk, dv) in fp32."""
    dk = torch.zeros(kv.k.shape, dtype=dq.dtype, device=kv.k.device)
    dv = torch.zeros_like(dk)
    rngs = iter(saved.rng or ())
    for rows_b, blocks in _row_groups(qp, kv):
        q, k, v = _rows(qp, kv, rows_b)
        out, lse, dout = saved.out[rows_b], saved.lse[rows_b], saved.dout[rows_b]
        for blk in blocks:
            qr, kr = blk.q_rows, blk.k_rows
            dq_b, dk_b, dv_b = fused_backward(dout[:, :, qr], q[:, :, qr], k[:, :, kr], v[:, :, kr], out[:, :, qr],
                                              lse[:, :, qr], blk, qp.window, qp.scale, qp.dropout, next(rngs, None))
            dq[rows_b, :, qr] += dq_b
            dk[rows_b, :, kr] += dk_b
            dv[rows_b, :, kr] += dv_b
    return dk, dv


class BlockAttention(torch.autograd.Function):
    """Queries against key blocks that are all present on this rank (all-gather CP, Ulysses' local
    part, document masks and sliding windows without cp): saves the inputs, the output and the
    statistics, never a score matrix."""

    @staticmethod
    def forward(ctx, q, k, v, q_segments, k_segments, docs, window, scale, dropout):
        qp = QueryPart(q, q_segments, docs, window, scale, dropout)
        acc = Accumulator(q)
        with no_autocast(q):
            acc.add(qp, KVBlock(k, v, k_segments))
        out = acc.result(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.meta = (q_segments, k_segments, docs, window, scale, dropout)
        ctx.rng = acc.rng
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        q_segments, k_segments, docs, window, scale, dropout = ctx.meta
        qp = QueryPart(q, q_segments, docs, window, scale, dropout)
        dq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
        with no_autocast(q):
            dk, dv = block_backward(qp, KVBlock(k, v, k_segments), Saved.of(out, lse, dout, ctx.rng), dq)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


@torch.compiler.disable
def local_attention(q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, q_segments: Segments,
                    k_segments: Segments, docs: Docs, window: int | None, scale: float,
                    dropout: float = 0.0) -> torch.Tensor:
    """Queries at ``q_segments`` against keys at ``k_segments``, all on this rank; ``[b, n, q, d]``.
    ``dropout``: on CUDA's fused kernels only (the CPU's: dropout_tiles.py). Opaque to torch.compile, as
    context.attention."""
    return BlockAttention.apply(q_bnsd, k_bksd, v_bksd, q_segments, k_segments, docs, window, scale, dropout)
