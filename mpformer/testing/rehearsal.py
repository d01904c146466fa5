"""Rehearsals for the tests: many in one spawned process, and the defects they must catch.

    reports = rehearse_many([(overrides, world_size, rank, defect), ...])

Each case is rehearsed (rehearsal/rank.py) one after another in one fresh process (a rehearsal takes
the process's default process group while it runs), so a test pays one start-up for many. ``defect``
(None, or a name of ``DEFECTS``) plants a known mistake in that case only: what the rehearsal exists to
find before a GPU is spent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

Case = tuple[Sequence[str], int, int, "str | None"]


@contextlib.contextmanager
def _sdpa_gqa_fp32() -> Iterator[None]:
    """The CUDA path of the old attention core: torch's SDPA with enable_gqa, which no fused CUDA kernel
    takes in fp32 (SDPA falls to its math kernel and forms the [s, s] scores)."""
    import torch.nn.functional as F

    from mpformer.layers import attention

    def sdpa(q, k, v, *, dropout=0.0, scale=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    old, attention.causal_attention = attention.causal_attention, sdpa
    try:
        yield
    finally:
        attention.causal_attention = old


@contextlib.contextmanager
def _item_in_forward() -> Iterator[None]:
    """A host read inside every layer's forward (a logged statistic, say): a sync per layer on a GPU."""
    from mpformer.layers.mlp import MLP

    old = MLP.forward

    def forward(self, x, *a, **kw):
        x.float().abs().max().item()
        return old(self, x, *a, **kw)

    MLP.forward = forward
    try:
        yield
    finally:
        MLP.forward = old


@contextlib.contextmanager
def _dense_mask() -> Iterator[None]:
    """A causal mask built as a dense [s, s] boolean matrix before the fused kernel."""
    import torch

    from mpformer.layers import attention

    old = attention.causal_attention

    def masked(q, k, v, *, dropout=0.0, scale=None):
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        return old(q, k, v, dropout=dropout, scale=scale) * mask.any()

    attention.causal_attention = masked
    try:
        yield
    finally:
        attention.causal_attention = old


DEFECTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "sdpa_gqa_fp32": _sdpa_gqa_fp32, "item_in_forward": _item_in_forward, "dense_mask": _dense_mask}


def _worker(cases: Sequence[Case], steps: int) -> list[dict]:
    import torch

    from mpformer.cli.compose import compose_config
    from mpformer.rehearsal.rank import rehearse_rank

    torch.set_num_threads(1)
    out = []
    for overrides, world, rank, defect in cases:
        with DEFECTS[defect]() if defect else contextlib.nullcontext():
            out.append(rehearse_rank(compose_config(list(overrides)), world, rank, steps).to_dict())
    return out


def rehearse_many(cases: Sequence[Case], steps: int = 1, timeout: float = 600.0) -> list[dict]:
    """Each case's report (RankReport.to_dict), rehearsed in one fresh process."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(_worker, (list(cases), steps)).get(timeout)
