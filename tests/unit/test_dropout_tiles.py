"""Attention dropout a tile at a time (context_parallel/dropout_tiles.py) against a dense oracle.

Oracle: the whole score matrix in float64 with the causal / window / document mask, softmax, the
same dropout mask assembled from the tiles' (each drawn from the call's seed and the tile's position),
times V, and torch's autograd through it: outputs and q, k, v gradients within 1e-12 of the largest
element (float64: agreement shows the algebra is the same, not the rounding).
"""

from __future__ import annotations

import pytest
import torch

from mpformer.context_parallel import dropout_tiles
from mpformer.context_parallel.blockwise import doc_starts
from mpformer.context_parallel.context import document_ids
from mpformer.context_parallel.dropout_tiles import DropoutTiles
from mpformer.core import attention_plan
from mpformer.core.attention_plan import plan
from mpformer.core.sequence import Segment, positions


def _dense(q, k, v, q_seg, k_seg, docs, window, p, seed, blocks):
    qp, kp = torch.tensor(positions(q_seg)), torch.tensor(positions(k_seg))
    i, j = qp[:, None], kp[None, :]
    seen = j <= i
    if window is not None:
        seen = seen & (i - j < window)
    if docs is not None:
        seen = seen & (docs[0][i] == docs[0][j])
    keep = torch.zeros((*q.shape[:2], *seen.shape), dtype=torch.float64)  # each head its own mask
    for t in (x for b in blocks for x in dropout_tiles._tiles(b, window)):
        shape = (*q.shape[:2], t.q_len, t.k_len)
        keep[:, :, t.q_rows, t.k_rows] = dropout_tiles._keep(seed, t, shape, p, q.device).double()
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kr.transpose(-1, -2)) * q.shape[-1] ** -0.5
    prob = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
    return (prob * keep) @ vr


@pytest.mark.parametrize("case", ["causal", "window", "documents", "slice"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_tiles_equal_the_dense_attention_with_the_same_masks(case, p, monkeypatch):
    monkeypatch.setattr(attention_plan, "TILE", 4)  # many masked blocks and tiles at a test's size
    monkeypatch.setattr(dropout_tiles, "TILE", 3)  # tiles that cut masked blocks and the causal diagonal
    s = 24
    q_seg, k_seg = ((Segment(16, 8),), (Segment(0, 24),)) if case == "slice" else ((Segment(0, s),),) * 2
    window = 7 if case == "window" else None
    gen = torch.Generator().manual_seed(0)
    docs = document_ids(torch.randint(0, 5, (1, s), generator=gen), 0) if case == "documents" else None
    starts = doc_starts(docs)[0] if docs is not None else ()
    blocks = plan(q_seg, k_seg, window, starts)
    q = torch.randn(1, 4, len(positions(q_seg)), 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, len(positions(k_seg)), 8, dtype=torch.float64, generator=gen, requires_grad=True)
            for _ in range(2))
    g = torch.randn(q.shape, dtype=torch.float64, generator=gen)
    out = DropoutTiles.apply(q, k, v, blocks, window, 8 ** -0.5, p, 1234)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = _dense(q, k, v, q_seg, k_seg, docs, window, p, 1234, blocks)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12 * float(want.detach().abs().max()))
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * float(b.abs().max()))


def test_a_seed_gives_the_same_masks_and_the_rate_is_p():
    t = plan((Segment(0, 64),), (Segment(0, 64),))[0]
    a, b = (dropout_tiles._keep(7, t, (1, 1, 64, 64), 0.25, torch.device("cpu")) for _ in range(2))
    assert torch.equal(a, b)
    assert abs(float((a == 0).float().mean()) - 0.25) < 0.03
    assert not torch.equal(a, dropout_tiles._keep(8, t, (1, 1, 64, 64), 0.25, torch.device("cpu")))


def test_tile_seeds_do_not_repeat_past_64k_positions():
    """Every tile of a 256k-token sequence gets its own seed (the earlier q * 65537 + k sent tiles to one
    generator once k passed 65536: (0, 65537) and (1, 0), for one)."""
    from mpformer.context_parallel.dropout_tiles import tile_seed

    tiles = [(q, k) for q in range(0, 262144, 512) for k in range(0, q + 1, 4096)]
    seeds = {tile_seed(7, q, k) for q, k in tiles}
    assert len(seeds) == len(tiles)
    assert tile_seed(7, 0, 65537) != tile_seed(7, 1, 0)  # a pair the old seed sent to one generator
    assert (7 * 1_000_003 + 0 * 65_537 + 65_537) % 2**63 == (7 * 1_000_003 + 1 * 65_537 + 0) % 2**63
