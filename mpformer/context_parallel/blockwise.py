"""Attention over blocks of keys, merged by log-sum-exp, with an exact backward (flash-attention's
algebra, written with plain torch ops so it runs on every device and dtype).

A query part and a key block are each a list of segments (core/sequence.py): runs of global
positions. The causal mask, a sliding window and a document mask are all functions of the global
positions and of the documents they fall in, so any split and any storage order is attended
correctly; a (query segment, key segment) block no query may see is skipped.

Shape legend: b batch, k kv heads, g query heads per kv head, q/s query/key positions, d head dim.
Queries are ``[b, k, g, q, d]`` (grouped under their kv head: GQA without copying K/V), keys and
values ``[b, k, s, d]``. Softmax statistics and accumulators are fp32 for 16-bit and fp32 inputs (fp64 stays fp64).

    forward (one block):  S = q kᵀ·scale (masked)   lse = logsumexp(S)   out = exp(S - lse) v
    merge:                lse' = logaddexp(lse₁, lse₂)   out' = Σ exp(lseᵢ - lse') outᵢ
    backward (one block): P = exp(S - lse_final)   dv = Pᵀ dout   dS = P ∘ (dout vᵀ - rowsum(dout ∘ out))
                          dq = dS k·scale   dk = dSᵀ q·scale
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from mpformer.core.sequence import Segment, Segments, block_needs_mask, block_visible

NEG_INF = float("-inf")


@dataclass(frozen=True)
class KVBlock:
    """Keys and values ``[b, k, s, d]`` whose positions are ``segments``; ``docs`` ``[b, s]`` (or None)."""

    k: torch.Tensor
    v: torch.Tensor
    segments: Segments
    docs: torch.Tensor | None = None


@dataclass(frozen=True)
class QueryPart:
    """Queries ``[b, k, g, q, d]`` at ``segments``; ``docs`` ``[b, q]`` (or None); the attention's rules."""

    q: torch.Tensor
    segments: Segments
    docs: torch.Tensor | None
    window: int | None
    scale: float


@functools.lru_cache(maxsize=256)
def segment_index(segments: Segments, device: torch.device) -> torch.Tensor:
    """The global positions of ``segments`` in storage order, as a tensor (built once per split: every
    layer of every micro-batch asks for the same few)."""
    return torch.cat([torch.arange(s.start, s.stop, device=device) for s in segments])


def doc_ids_at(docs_bs: torch.Tensor | None, segments: Segments) -> torch.Tensor | None:
    """The document ids of ``segments``'s positions (``docs_bs``: every position of the sequence)."""
    if docs_bs is None:
        return None
    return docs_bs.index_select(1, segment_index(segments, docs_bs.device))


TILE = 1024  # rows and columns of one score block: bounds the transient [b, k, g, TILE, TILE] fp32 scores


def _tiles(segments: Segments) -> list[tuple[Segment, int]]:
    """Every segment cut into tiles of at most TILE positions, each with its row offset in storage."""
    out, o = [], 0
    for seg in segments:
        for t in range(0, seg.length, TILE):
            out.append((Segment(seg.start + t, min(TILE, seg.length - t)), o + t))
        o += seg.length
    return out


def _pairs(qp: QueryPart, kv: KVBlock):
    """(query rows, key rows, mask or None) of every tile pair some query may see."""
    dev = qp.q.device
    k_tiles = _tiles(kv.segments)
    for qs, qo in _tiles(qp.segments):
        for ks, ko in k_tiles:
            if not block_visible(qs, ks, qp.window):
                continue
            mask = None
            if block_needs_mask(qs, ks, qp.window):
                i = torch.arange(qs.start, qs.stop, device=dev)[:, None]
                j = torch.arange(ks.start, ks.stop, device=dev)[None, :]
                mask = j <= i
                if qp.window is not None:
                    mask = mask & (i - j < qp.window)
                mask = mask[None, None, None]
            if qp.docs is not None:
                same = (qp.docs[:, qo:qo + qs.length, None] == kv.docs[:, None, ko:ko + ks.length])[:, None, None]
                mask = same if mask is None else mask & same
            yield slice(qo, qo + qs.length), slice(ko, ko + ks.length), mask


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 statistics for 16-bit and fp32 inputs; fp64 stays fp64 (exact tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def _up(t: torch.Tensor) -> torch.Tensor:
    return t.to(acc_dtype(t))


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = torch.einsum("bkgqd,bksd->bkgqs", _up(q), _up(k)) * scale
    return s if mask is None else s.masked_fill(~mask, NEG_INF)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf rows (no visible key) as 0, so exp(S - lse) is 0 there rather than nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class Accumulator:
    """The running (out, lse) of every query row, merged block by block."""

    def __init__(self, q: torch.Tensor) -> None:
        self.out = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
        self.lse = torch.full(q.shape[:-1], NEG_INF, dtype=acc_dtype(q), device=q.device)

    def add(self, qp: QueryPart, kv: KVBlock) -> None:
        for rows, cols, mask in _pairs(qp, kv):
            s = _scores(qp.q[..., rows, :], kv.k[..., cols, :], mask, qp.scale)
            lse_b = torch.logsumexp(s, dim=-1)
            out_b = torch.einsum("bkgqs,bksd->bkgqd", torch.exp(s - _finite(lse_b)[..., None]),
                                 _up(kv.v[..., cols, :]))
            lse_a = self.lse[..., rows]
            lse = torch.logaddexp(lse_a, lse_b)
            safe = _finite(lse)
            self.out[..., rows, :] = (self.out[..., rows, :] * torch.exp(lse_a - safe)[..., None]
                                      + out_b * torch.exp(lse_b - safe)[..., None])
            self.lse[..., rows] = lse


@dataclass
class Saved:
    """What the backward needs of the forward: the final output and statistics, and dout's row sums."""

    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor
    delta: torch.Tensor

    @classmethod
    def of(cls, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor) -> Saved:
        dout = dout.to(out.dtype)
        return cls(out, lse, dout, (dout * out).sum(-1))


def block_backward(qp: QueryPart, kv: KVBlock, saved: Saved, dq: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds this block's query gradients into ``dq`` (fp32); returns its (dk, dv) in fp32."""
    dk = torch.zeros(kv.k.shape, dtype=acc_dtype(kv.k), device=kv.k.device)
    dv = torch.zeros_like(dk)
    lse = _finite(saved.lse)
    for rows, cols, mask in _pairs(qp, kv):
        q, k = qp.q[..., rows, :], kv.k[..., cols, :]
        p = torch.exp(_scores(q, k, mask, qp.scale) - lse[..., rows, None])
        dout = saved.dout[..., rows, :]
        dv[..., cols, :] += torch.einsum("bkgqs,bkgqd->bksd", p, dout)
        ds = p * (torch.einsum("bkgqd,bksd->bkgqs", dout, _up(kv.v[..., cols, :])) - saved.delta[..., rows, None])
        dq[..., rows, :] += torch.einsum("bkgqs,bksd->bkgqd", ds, _up(k)) * qp.scale
        dk[..., cols, :] += torch.einsum("bkgqs,bkgqd->bksd", ds, _up(q)) * qp.scale
    return dk, dv


def no_autocast(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on ``t``'s device: the kernels upcast to fp32 themselves, and autocast would cast
    their einsums (and logsumexp) back to 16-bit in forward but not in backward, which runs outside it."""
    return torch.autocast(t.device.type, enabled=False)


class BlockAttention(torch.autograd.Function):
    """Queries against key blocks that are all present on this rank (all-gather CP, Ulysses' local
    part): saves the inputs, the output and the statistics, never a score matrix."""

    @staticmethod
    def forward(ctx, q, k, v, q_segments, k_segments, q_docs, k_docs, window, scale):
        qp = QueryPart(q, q_segments, q_docs, window, scale)
        kv = KVBlock(k, v, k_segments, k_docs)
        acc = Accumulator(q)
        with no_autocast(q):
            acc.add(qp, kv)
        ctx.save_for_backward(q, k, v, acc.out, acc.lse)
        ctx.meta = (q_segments, k_segments, q_docs, k_docs, window, scale)
        return acc.out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        q_segments, k_segments, q_docs, k_docs, window, scale = ctx.meta
        qp = QueryPart(q, q_segments, q_docs, window, scale)
        dq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
        with no_autocast(q):
            dk, dv = block_backward(qp, KVBlock(k, v, k_segments, k_docs), Saved.of(out, lse, dout), dq)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def group_queries(q_bnsd: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, n, s, d]`` -> ``[b, k, n/k, s, d]`` (a view): query heads under the kv head they share."""
    b, n, s, d = q_bnsd.shape
    return q_bnsd.view(b, kv_heads, n // kv_heads, s, d)


def local_attention(q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, q_segments: Segments,
                    k_segments: Segments, docs_bs: torch.Tensor | None, window: int | None,
                    scale: float) -> torch.Tensor:
    """Queries at ``q_segments`` against keys at ``k_segments``, all on this rank; ``[b, n, q, d]``."""
    qg = group_queries(q_bnsd, k_bksd.shape[1])
    out = BlockAttention.apply(qg, k_bksd, v_bksd, q_segments, k_segments, doc_ids_at(docs_bs, q_segments),
                               doc_ids_at(docs_bs, k_segments), window, scale)
    return out.flatten(1, 2)
