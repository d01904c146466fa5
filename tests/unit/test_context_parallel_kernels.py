"""The block kernels and the zigzag split, on one process.

Oracle: torch's SDPA over the whole sequence with an explicit boolean mask (causal, sliding window,
documents), in float64 so that agreement to 1e-12 shows the algebra, not rounding, is the same;
and the split's arithmetic worked by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpformer.context_parallel.blockwise import doc_starts, local_attention
from mpformer.context_parallel.context import document_ids
from mpformer.core import attention_plan
from mpformer.core.sequence import Segment, attention_pairs, concat, load_balance, merge, positions, rank_segments

S, D = 24, 8


def _reference(q, k, v, docs, window):
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    mask = mask[None, None] if docs is None else mask & (docs[:, None, :, None] == docs[:, None, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("tile", [1024, 3])  # one tile per segment, and many (partly masked, partly skipped)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_docs", [False, True])
def test_blocks_equal_full_attention_in_any_storage_order(tile, window, with_docs, monkeypatch):
    monkeypatch.setattr(attention_plan, "TILE", tile)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, S, D, generator=gen, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    docs = document_ids(torch.randint(0, 4, (2, S), generator=gen), 0) if with_docs else None
    ref = _reference(q, k, v, docs, window)
    starts = None if docs is None else doc_starts(docs)
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    parts = [rank_segments(S, 3, r) for r in range(3)]
    keys = concat(parts)  # what an all-gather holds: every rank's chunks in rank order
    for mine in parts:
        idx, kidx = torch.tensor(positions(mine)), torch.tensor(positions(keys))
        ql, kl, vl = q.detach()[:, :, idx].requires_grad_(), k.detach()[:, :, kidx].requires_grad_(), \
            v.detach()[:, :, kidx].requires_grad_()
        out = local_attention(ql, kl, vl, mine, keys, starts, window, D ** -0.5)
        torch.testing.assert_close(out, ref.detach()[:, :, idx], rtol=0, atol=1e-12)
        dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), g[:, :, idx])
        torch.testing.assert_close(dq, ref_grads[0][:, :, idx], rtol=0, atol=1e-12)
        # this rank's queries' share of every key's gradient: summed over the ranks below
        for got, want in ((dk, ref_grads[1]), (dv, ref_grads[2])):
            assert got.shape == want[:, :, kidx].shape
    total = [torch.zeros_like(t) for t in (k, v)]
    for mine in parts:
        idx, kidx = torch.tensor(positions(mine)), torch.tensor(positions(keys))
        kl, vl = k.detach()[:, :, kidx].requires_grad_(), v.detach()[:, :, kidx].requires_grad_()
        out = local_attention(q.detach()[:, :, idx], kl, vl, mine, keys, starts, window, D ** -0.5)
        dk, dv = torch.autograd.grad(out, (kl, vl), g[:, :, idx])
        total[0][:, :, kidx] += dk
        total[1][:, :, kidx] += dv
    torch.testing.assert_close(total[0], ref_grads[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(total[1], ref_grads[2], rtol=0, atol=1e-12)


def test_a_query_with_no_visible_key_gets_zero_not_nan():
    """Keys all after the queries: every block skipped or fully masked, output and gradients 0."""
    q = torch.randn(1, 1, 4, D, requires_grad=True)
    k, v = torch.randn(1, 1, 4, D, requires_grad=True), torch.randn(1, 1, 4, D, requires_grad=True)
    out = local_attention(q, k, v, (Segment(0, 4),), (Segment(8, 4),), None, None, 1.0)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_documents_end_with_their_eos():
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 3]])
    assert document_ids(tokens, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3]]


def test_zigzag_split_by_hand():
    assert rank_segments(16, 2, 0) == (Segment(0, 4), Segment(12, 4))
    assert rank_segments(16, 2, 1) == (Segment(4, 4), Segment(8, 4))
    assert positions(rank_segments(8, 4, 3)) == [3, 4]
    assert merge((Segment(0, 2), Segment(2, 2), Segment(6, 1))) == (Segment(0, 4), Segment(6, 1))
    assert rank_segments(12, 1, 0) == (Segment(0, 12),)
    with pytest.raises(ValueError, match="2\\*cp=4"):
        rank_segments(10, 2, 0)
    # Causal work per rank, in query-key products of the blocks the kernels run: zigzag gives every
    # rank (2cp + 1) c^2 at chunk c = s / 2cp; contiguous gives rank i (i + 1) (2c)^2.
    every = concat([rank_segments(64, 4, r) for r in range(4)])
    assert {attention_pairs(rank_segments(64, 4, r), every) for r in range(4)} == {9 * 8 * 8}
    assert load_balance(64, 4) == 1.0
    assert load_balance(64, 4, "contiguous") == 4.0  # rank 3 runs 4 blocks of 16 x 16, rank 0 one
