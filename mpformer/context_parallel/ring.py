"""Ring attention (``parallel.cp_kind=ring``; Megatron-LM's ``--cp-comm-type p2p``).

Each cp rank keeps its queries; the keys and values travel around the ring, one hop per step, so
after cp steps every query has met every key. The next hop is posted before the current block is
computed, so the transfer hides behind the compute (``overlap=False`` waits first: the benchmark's
baseline). Only kv heads travel (GQA), packed as one ``[2, b, k, s, d]`` message.

Forward: partial outputs merge by log-sum-exp (blockwise.py), and only the rank's own q, k, v, output
and statistics are saved. Backward: K/V go around the ring again, and each block's dK/dV partial sum
travels with it: rank r adds its contribution to the block it holds and passes the running sum on,
so after the last hop every block's gradient is home, summed over every query that saw it.

    step j on cp rank r: holds the block of rank (r - j) mod cp; sends it to r + 1, receives from r - 1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpformer.context_parallel.blockwise import (
    Accumulator,
    Docs,
    KVBlock,
    QueryPart,
    Saved,
    acc_dtype,
    block_backward,
)
from mpformer.core.sequence import Segments
from mpformer.parallel.comm import Comm
from mpformer.parallel.device import no_autocast

_KV_TAG, _DKV_TAG = 17, 18  # distinct tags: a K/V hop and a dK/dV hop may be in flight together


@dataclass(frozen=True)
class Ring:
    """The ring and what every member holds: ``segments[i]`` are ring rank i's positions, ``docs`` each
    batch row's document starts over the whole sequence (or None)."""

    comm: Comm
    segments: tuple[Segments, ...]
    docs: Docs
    window: int | None
    scale: float
    overlap: bool = True

    def block(self, kv: torch.Tensor, src: int) -> KVBlock:
        return KVBlock(kv[0], kv[1], self.segments[src])

    def queries(self, q: torch.Tensor) -> QueryPart:
        return QueryPart(q, self.segments[self.comm.rank], self.docs, self.window, self.scale)


class _Hop:
    """One posted ring hop: ``t`` to the next rank, the previous rank's tensor into a new buffer."""

    def __init__(self, comm: Comm, t: torch.Tensor, tag: int) -> None:
        group, n, r = comm.group, comm.size, comm.rank
        nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
        t = t.contiguous()
        self.buf = torch.empty_like(t)
        self._keep = t  # referenced until the send completes
        self.ledger, self.kind = comm.ledger, comm.tag + "wait"
        comm.ledger.record(comm.tag + "send", t.numel() * t.element_size())
        self.works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt, group, tag),
                                             dist.P2POp(dist.irecv, self.buf, prv, group, tag)])

    def wait(self) -> torch.Tensor:
        self.ledger.blocked(self.kind, lambda: [w.wait() for w in self.works])  # exposed when the block ran short
        self._keep = None
        return self.buf


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        r, n = ring.comm.rank, ring.comm.size
        qp = ring.queries(q)
        acc = Accumulator(q)
        kv = torch.stack([k, v])
        for step in range(n):
            hop = _Hop(ring.comm, kv, _KV_TAG) if step < n - 1 else None
            if hop is not None and not ring.overlap:
                kv_next = hop.wait()
            with no_autocast(q):
                acc.add(qp, ring.block(kv, (r - step) % n))
            if hop is not None:
                kv = kv_next if not ring.overlap else hop.wait()
        out = acc.result(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        r, n = ring.comm.rank, ring.comm.size
        qp = ring.queries(q)
        saved = Saved.of(out, lse, dout)
        dq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
        kv, partial = torch.stack([k, v]), None
        for step in range(n):
            hop = _Hop(ring.comm, kv, _KV_TAG) if step < n - 1 else None
            if hop is not None and not ring.overlap:
                kv_next = hop.wait()
            with no_autocast(q):
                dk, dv = block_backward(qp, ring.block(kv, (r - step) % n), saved, dq)
            dkv = torch.stack([dk, dv])
            if partial is not None:
                dkv += partial.wait()  # what the ranks before this one added to the same block
            partial = _Hop(ring.comm, dkv, _DKV_TAG)  # on to the rank that holds this block next
            if hop is not None:
                kv = kv_next if not ring.overlap else hop.wait()
        dkv = partial.wait()  # this rank's own block, summed over every rank's queries
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, ring: Ring) -> torch.Tensor:
    """This rank's queries against every rank's keys: ``[b, n, s, d]``."""
    return RingAttention.apply(q_bnsd, k_bksd, v_bksd, ring)
