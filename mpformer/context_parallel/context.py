"""The context-parallel context and what one rank holds of a micro-batch's sequence.

Every cp kind shares the zigzag split of core/sequence.py; they differ only in how a rank's queries
meet the other ranks' keys (``attention``):

    ring       K/V travel around the cp ring (ring.py)
    allgather  K/V all-gathered once per layer, dK/dV reduce-scattered (Llama 3's choice at long context)
    ulysses    all-to-all from sequence-sharded to head-sharded, full-sequence attention on cp-th of the
               heads, all-to-all back (DeepSpeed-Ulysses); kv heads replicated when cp exceeds them
    hybrid     Ulysses over ``cp_ulysses`` consecutive cp ranks inside a ring over the rest (USP, LoongTrain)

Inside the cp group the Ulysses ranks are the fastest dimension (cp rank = u + U * r): all-to-all
moves the most bytes and so gets the closest links.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mpformer.context_parallel.blockwise import Docs, doc_starts, local_attention, segment_index
from mpformer.context_parallel.fused import causal_attention
from mpformer.context_parallel.ring import Ring, ring_attention
from mpformer.context_parallel.token_slices import KVSlices
from mpformer.core.sequence import Segment, Segments, concat, merge, rank_segments
from mpformer.parallel.comm import Comm, all_gather_seq, all_to_all
from mpformer.parallel.device import kernel_device, no_autocast
from mpformer.parallel.kernels import cpu_attention


@dataclass(frozen=True)
class CPContext:
    """The cp group, and for Ulysses and hybrid the all-to-all group and the ring of such groups."""

    kind: str
    comm: Comm
    ulysses: Comm | None = None
    ring: Comm | None = None
    overlap: bool = True  # ring: post the next K/V hop before computing the current block

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def segments(self, seq_len: int) -> Segments:
        return rank_segments(seq_len, self.size, self.rank)


@dataclass(frozen=True)
class SeqShard:
    """This rank's part of a micro-batch's sequence of ``total`` positions: its ``segments``, their
    positions as a tensor (``index``; None without cp: every position in order), the document id of
    every position of the whole sequence (``docs`` ``[b, total]``, document masks only; each rank
    holds the whole micro-batch's tokens, so other ranks' ids need no communication), each row's
    document starts (``doc_starts``, host integers: what the attention plans cut at) and the rotary
    tables at this rank's positions."""

    total: int
    segments: Segments
    index: torch.Tensor | None = None
    docs: torch.Tensor | None = None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    past: KVSlices | None = None  # token slices: the earlier slices' keys and values (token_slices.py)
    doc_starts: Docs = None  # derived from ``docs`` when not given

    def __post_init__(self) -> None:
        if self.docs is not None and self.doc_starts is None:
            # The attention plans cut at document starts: host integers, one copy of the boundaries
            # per micro-batch (on CUDA a sync, as Megatron's packed-sequence cu_seqlens).
            object.__setattr__(self, "doc_starts", doc_starts(self.docs))

    @property
    def key_segments(self) -> Segments:
        """The positions this rank's queries attend over locally: its own, or with token slices every
        position from 0 to its slice's end."""
        return self.segments if self.past is None else (Segment(0, self.segments[-1].stop),)


def document_ids(tokens_bs: torch.Tensor, eos: int) -> torch.Tensor:
    """Document id of every position: the number of EOS tokens before it (an EOS ends its document)."""
    ends = (tokens_bs == eos).to(torch.int32)
    return torch.cumsum(ends, dim=1) - ends


def _kv_for_ulysses(x_bksd: torch.Tensor, u: int) -> torch.Tensor:
    """Replicate kv heads when the Ulysses degree exceeds them, so every rank receives whole heads."""
    kv = x_bksd.shape[1]
    return x_bksd if kv % u == 0 else x_bksd.repeat_interleave(u // kv, dim=1)


@functools.lru_cache(maxsize=64)
def _sorting(received: Segments, device: torch.device) -> torch.Tensor:
    """The permutation that puts positions received in rank order into position order."""
    return torch.argsort(segment_index(received, device), stable=True)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the attention kernels run in: the inputs', or fp32 for 16-bit inputs on a CPU whose
    start-up probe found the fp32 kernel faster (parallel/kernels.py)."""
    if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) and cpu_attention(t.dtype).upcast:
        return torch.float32
    return t.dtype


@torch.compiler.disable
def attention(q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, cp: CPContext, seq: SeqShard,
              window: int | None, scale: float) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence: ``[b, n, s/cp, d]``. Keys and
    values travel in their own dtype; the kernels cast them to the queries' compute dtype. Opaque to
    torch.compile (train.compile): a compiled block breaks its graph here once, around the collectives
    and the per-block kernel calls, rather than tracing the plan's Python into many small graphs."""
    parts = [rank_segments(seq.total, cp.size, i) for i in range(cp.size)]
    q = q_bnsd.to(compute_dtype(q_bnsd))
    if cp.kind == "ring":
        ring = Ring(cp.comm, tuple(parts), seq.doc_starts, window, scale, cp.overlap)
        return ring_attention(q, k_bksd, v_bksd, ring).to(q_bnsd.dtype)
    if cp.kind == "allgather":
        kv_s = torch.stack([k_bksd, v_bksd]).movedim(3, 0)  # the sequence first: the gather concatenates it
        k_all, v_all = all_gather_seq(kv_s.contiguous(), cp.comm).movedim(0, 3).unbind(0)
        out = local_attention(q, k_all, v_all, parts[cp.rank], concat(parts), seq.doc_starts, window, scale)
        return out.to(q_bnsd.dtype)
    return _ulysses(q_bnsd, k_bksd, v_bksd, cp, seq, parts, window, scale)


def _ulysses(q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, cp: CPContext, seq: SeqShard,
             parts: list[Segments], window: int | None, scale: float) -> torch.Tensor:
    """All-to-all over the Ulysses group (heads scattered, sequence gathered), then attention over the
    group's part of the sequence in position order (a ring over the groups for hybrid), and back."""
    a2a = cp.ulysses
    assert a2a is not None
    u = a2a.size
    q = all_to_all(q_bnsd, a2a, scatter_dim=1, gather_dim=2)
    k = all_to_all(_kv_for_ulysses(k_bksd, u), a2a, scatter_dim=1, gather_dim=2)
    v = all_to_all(_kv_for_ulysses(v_bksd, u), a2a, scatter_dim=1, gather_dim=2)

    def group_part(r: int) -> tuple[Segments, Segments]:
        """Ring member r's gathered segments as received, and sorted by position (merged)."""
        got = tuple(seg for i in range(u) for seg in parts[i + u * r])
        return got, merge(tuple(sorted(got, key=lambda s: s.start)))

    received, ordered = group_part(cp.rank // u)
    order = _sorting(received, q.device)
    q, k, v = (t.index_select(2, order) for t in (q, k, v))
    dtype, q = q.dtype, q.to(compute_dtype(q))
    if cp.kind == "ulysses":
        assert ordered == (Segment(0, seq.total),)
        if seq.doc_starts is None and window is None:  # the whole sequence in order: one fused kernel
            k, v = k.to(q.dtype), v.to(q.dtype)
            with no_autocast(q):
                if kernel_device(q) == "cuda":  # the kernel fused.attention_kernel picks (GQA: never math)
                    out = causal_attention(q, k, v, scale=scale)
                else:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                         enable_gqa=q.shape[1] != k.shape[1])
        else:
            out = local_attention(q, k, v, ordered, ordered, seq.doc_starts, window, scale)
    else:
        assert cp.ring is not None
        ring = Ring(cp.ring, tuple(group_part(r)[1] for r in range(cp.ring.size)), seq.doc_starts, window, scale,
                    cp.overlap)
        out = ring_attention(q, k, v, ring)
    out = out.to(dtype).index_select(2, torch.argsort(order))
    return all_to_all(out, a2a, scatter_dim=2, gather_dim=1)
