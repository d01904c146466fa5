"""The kernels a GPU runs that no CPU test can reach, on the device (gpu_check.sh runs these).

    block kernels      the attention plan's blocks on CUDA's fused ops (flash for bf16, the efficient
                       kernel for fp32 and masked blocks, kv heads repeated there): outputs and dq, dk,
                       dv against SDPA with the dense mask, causal / window / documents / a cp rank /
                       a token slice; fp32 within 1e-5 of the largest element (TF32 off), bf16 2e-2
    log-sum-exp        the merged statistics of a cp rank's blocks against the dense scores'
    no host sync       the fused cross entropy under torch.cuda.set_sync_debug_mode("error")
    RMSNorm            saves its input and the fp32 1/rms rows only, as the memory model counts

``MPFORMER_GPU_DRY_RUN=1`` (gpu_check.sh --dry-run) runs them on the CPU instead, where the same calls
reach the CPU's fused ops: a typo cannot cost GPU minutes. Without either they are skipped.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DRY = os.environ.get("MPFORMER_GPU_DRY_RUN") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda" and not DRY,
                                                  reason="needs a CUDA device (gpu_check.sh; --dry-run on CPU)")]

from mpformer.context_parallel.blockwise import Accumulator, KVBlock, QueryPart, doc_starts, local_attention  # noqa: E402
from mpformer.context_parallel.context import document_ids  # noqa: E402
from mpformer.core.sequence import Segment, concat, positions, rank_segments  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _no_tf32():
    if DEVICE != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _dense(s_q: int, s_k: int, q_pos, k_pos, docs, window):
    i, j = torch.tensor(q_pos, device=DEVICE)[:, None], torch.tensor(k_pos, device=DEVICE)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    if docs is not None:
        mask = mask & (docs[0][i] == docs[0][j])
    return mask


def _close(got, want, dtype, what):
    got, want = got.detach().float(), want.detach().float()
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= TOL[dtype], (what, err)


CASES = {  # name -> (query segments, key segments, window, documents)
    "causal": ((Segment(0, 512),), (Segment(0, 512),), None, False),
    "window": ((Segment(0, 512),), (Segment(0, 512),), 100, False),
    "documents": ((Segment(0, 512),), (Segment(0, 512),), None, True),
    "cp rank": (rank_segments(512, 2, 0), concat([rank_segments(512, 2, 0), rank_segments(512, 2, 1)]), None, False),
    "cp rank window docs": (rank_segments(512, 2, 1), concat([rank_segments(512, 2, r) for r in (0, 1)]), 150, True),
    "token slice": ((Segment(384, 128),), (Segment(0, 512),), None, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_block_kernels_equal_dense_sdpa(case, dtype, monkeypatch):
    from mpformer.core import attention_plan

    monkeypatch.setattr(attention_plan, "TILE", 128)  # masked blocks of several sizes, at test sizes
    q_seg, k_seg, window, with_docs = CASES[case]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40, (1, 512), generator=gen)
    docs = document_ids(tokens, 0).to(DEVICE) if with_docs else None
    starts = doc_starts(docs.cpu()) if with_docs else None
    qp, kp = positions(q_seg), positions(k_seg)
    q = torch.randn(1, 8, len(qp), 64, generator=gen).to(DEVICE, dtype).requires_grad_()
    k, v = (torch.randn(1, 2, len(kp), 64, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(2))
    g = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    out = local_attention(q, k, v, q_seg, k_seg, starts, window, 64 ** -0.5)
    got = torch.autograd.grad(out, (q, k, v), g)
    mask = _dense(len(qp), len(kp), qp, kp, docs, window)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, enable_gqa=True)
    want_grads = torch.autograd.grad(want, ref_in, g)
    _close(out, want, dtype, (case, "out"))
    for name, a, b in zip("qkv", got, want_grads):
        _close(a, b, dtype, (case, "d" + name))


def test_merged_log_sum_exp_is_the_dense_scores():
    q_seg = rank_segments(1024, 2, 0)
    keys = [rank_segments(1024, 2, r) for r in (0, 1)]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 512, 64, generator=gen).to(DEVICE)
    kv = [torch.randn(2, 1, 2, 512, 64, generator=gen).to(DEVICE) for _ in keys]
    qp = QueryPart(q, q_seg, None, None, 0.125)
    acc = Accumulator(q)
    for (k, v), seg in zip(kv, keys):
        acc.add(qp, KVBlock(k, v, seg))
    kall = torch.cat([k for k, _ in kv], dim=2).repeat_interleave(2, dim=1)
    scores = (q @ kall.transpose(-1, -2)) * 0.125
    scores = scores.masked_fill(~_dense(512, 1024, positions(q_seg), positions(concat(keys)), None, None), -torch.inf)
    torch.testing.assert_close(acc.lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


def test_fused_cross_entropy_never_waits_for_the_device():
    from mpformer.layers.fused_cross_entropy import fused_linear_cross_entropy

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 64, generator=gen).to(DEVICE).requires_grad_()
    w = torch.randn(1000, 64, generator=gen).to(DEVICE).requires_grad_()
    labels = torch.randint(0, 1000, (300,), generator=gen).to(DEVICE)
    labels[::3] = -100
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
        try:
            fused_linear_cross_entropy(x, w, labels, chunk=64).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        from mpformer.parallel.host_syncs import HostSyncs

        with HostSyncs() as syncs:
            fused_linear_cross_entropy(x, w, labels, chunk=64).backward()
        assert syncs.ops == []


def test_rmsnorm_saves_its_input_and_the_row_statistics():
    from mpformer.layers.norm import RMSNorm

    norm = RMSNorm(256, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(128, 4, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() != norm.weight.data_ptr():
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x).sum().backward()
    assert sum(saved.values()) == 2 * x.numel() + 4 * 128 * 4
