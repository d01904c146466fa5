"""How one chunk of a pipeline rank runs forward; which layers the rank holds is its StagePlan
(:mod:`mpformer.core.pipeline_plan`)."""

from __future__ import annotations

import torch
from torch import nn

from mpformer.context_parallel.token_slices import KVSlices
from mpformer.core.attention_plan import DocStarts
from mpformer.core.pipeline_plan import StagePlan


def chunk_forward(model: nn.Module, plan: StagePlan, chunk: int, x: torch.Tensor | None, tokens_bs: torch.Tensor,
                  labels_bs: torch.Tensor | None, past: KVSlices | None = None,
                  doc_starts: DocStarts | None = None) -> torch.Tensor:
    """Chunk ``chunk`` of this rank: its input activation (or the tokens, on stage 0) to its output
    activation (or, on the last stage, the mean loss; the logits when ``labels_bs`` is None). With
    ``past`` (token slices) only slice ``past.current`` of the sequence, and on the last stage its share
    of the micro-batch's mean loss. ``doc_starts``: the rows' document starts, found on the host (else
    from the tokens)."""
    # Every stage holds the micro-batch's tokens (cp, token slices: it picks its positions).
    part = past.current if past is not None else 0
    seq = model.sequence(tokens_bs, past, part, doc_starts=doc_starts)
    if plan.is_first(chunk):
        x = model.embed_tokens(tokens_bs, seq)
    assert x is not None
    x = model.run_layers(x, plan.local_indices(chunk), seq)
    if plan.is_last(chunk):
        return model.head_output(x, labels_bs, seq)
    return x
