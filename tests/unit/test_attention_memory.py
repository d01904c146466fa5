"""No attention path without context parallelism forms an [s, s] mask or score matrix at long sequences.

Oracle: the storage meter (parallel/memory_meter.py, checked against malloc in test_memory_meter.py)
around one attention forward and backward at s = 8192: any [s, s] tensor of one byte per element is
64 MiB, and the bound here is a quarter of that. What may
legitimately be live is O(s): the inputs' gradients, the output and its statistics, and the plan's
masked tiles (at most 1024 x 1024 each; with dropout a tile's scores, probabilities and mask per head).
The context-parallel kinds get the same check on their ranks (tests/distributed/test_context_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from mpformer.context_parallel.context import SeqShard, document_ids
from mpformer.core.sequence import Segment
from mpformer.layers.attention import attention_core
from mpformer.parallel.memory_meter import StorageMeter

S = 8192


def _inputs(s_q: int, s_k: int):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, s_q, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 1, s_k, 8, generator=gen, requires_grad=True) for _ in range(2))
    return q, k, v


def _docs(s: int = S) -> torch.Tensor:
    tokens = torch.randint(1, 50, (1, s), generator=torch.Generator().manual_seed(1))
    tokens[0, ::1500] = 0
    return document_ids(tokens, 0)


CASES = {
    "causal": dict(window=None, docs=False, slice_=False, dropout=0.0),
    "causal with dropout": dict(window=None, docs=False, slice_=False, dropout=0.1),
    "documents with dropout": dict(window=None, docs=True, slice_=False, dropout=0.1),
    "window with dropout": dict(window=3000, docs=False, slice_=False, dropout=0.1),
    "token slice with dropout": dict(window=None, docs=False, slice_=True, dropout=0.1),
    "documents": dict(window=None, docs=True, slice_=False, dropout=0.0),
    "sliding window": dict(window=3000, docs=False, slice_=False, dropout=0.0),
    "window and documents": dict(window=3000, docs=True, slice_=False, dropout=0.0),
    "token slice": dict(window=None, docs=False, slice_=True, dropout=0.0),
    "token slice with documents": dict(window=None, docs=True, slice_=True, dropout=0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_square_mask_or_scores(case):
    c = CASES[case]
    s = S
    bound = s * s // 4
    s_q = s // 2 if c["slice_"] else s  # the second of two token slices: its queries after every key before
    q, k, v = _inputs(s_q, s)
    docs = _docs(s) if c["docs"] else None
    seq = SeqShard(s, (Segment(s - s_q, s_q),), docs=docs, past=_Past() if c["slice_"] else None)
    with StorageMeter() as meter:
        out = attention_core(q, k, v, dropout_p=c["dropout"], sliding_window=c["window"], seq=seq)
        out.backward(torch.ones_like(out))
    assert meter.peak < bound, f"{case}: {meter.peak / 2**20:.1f} MiB live at the peak (bound {bound / 2**20} MiB)"
    print(f"{case}: {meter.peak / 2**20:.1f} MiB at the peak")
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


class _Past:
    """Stands for KVSlices: only its presence matters to key_segments (every key up to the slice's end)."""
