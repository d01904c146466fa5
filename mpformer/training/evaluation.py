"""Held-out loss: the evaluate CLI's core, also run by the trainer every eval.interval steps."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mpformer.core.errors import ConfigError

if TYPE_CHECKING:  # torch loads after validation, so bad input exits in about a second
    import torch

    from mpformer.core.config import Config
    from mpformer.core.layout import ParallelLayout
    from mpformer.core.pipeline_plan import StagePlan
    from mpformer.parallel.comm import Comm
    from mpformer.parallel.groups import ProcessGroups


def load_eval_tokens(path: str | None, vocab_size: int, max_positions: int | None = None) -> np.ndarray:
    """The eval rows, checked: integer [batch, seq+1], ids inside the vocabulary, and (learned
    positions) seq <= max_positions."""
    if not path:
        raise ConfigError("eval.tokens is not set; give eval.tokens=FILE.npy (int64 array [batch, seq+1])")
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"eval.tokens={path}: {'a directory, not' if p.is_dir() else 'no such'} file; give a "
                          ".npy file (int64 array [batch, seq+1])")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        why = "empty" if isinstance(e, EOFError) else " ".join(str(e).split()).replace(" allow_pickle=False", "")
        raise ConfigError(f"eval.tokens={path}: not a readable .npy file ({why}); give an int64 array "
                          "[batch, seq+1] saved with numpy.save") from None
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"eval.tokens={path}: expected an integer array [batch, seq+1] with batch >= 1 and "
                          f"seq >= 1, got "
                          f"{arr.dtype} {list(arr.shape)}")
    if max_positions is not None and arr.shape[1] - 1 > max_positions:
        raise ConfigError(f"eval.tokens={path}: rows of {arr.shape[1] - 1} inputs exceed the model's "
                          f"max_position_embeddings={max_positions}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ConfigError(f"eval.tokens={path}: token ids span [{lo}, {hi}] but the model's vocabulary is "
                          f"[0, {vocab_size - 1}]")
    return np.asarray(arr, dtype=np.int64)


def evaluate_loss(model: torch.nn.Module, tokens: np.ndarray, micro_batch: int, device: torch.device,
                  dp: Comm | None = None, cp: int = 1,
                  autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                  ) -> tuple[float, int]:
    """Sum of token losses over this dp rank's rows, all-reduced over ``dp`` (dp x cp: each cp rank's
    loss is its share of the batch's, so the sum over them is the batch's): (mean loss, token count)."""
    import torch

    dp_rank, dp_size = (dp.rank // cp, dp.size // cp) if dp is not None else (0, 1)
    parts = np.array_split(np.arange(tokens.shape[0]), dp_size)
    rows = parts[dp_rank]
    # Every rank runs as many forward passes as the rank with most rows (ZeRO-3 gathers parameters
    # collectively in each one); a rank out of rows repeats its first batch and counts it zero.
    passes = -(-max(len(r) for r in parts) // micro_batch)
    total = torch.zeros((), dtype=torch.float64, device=device)  # on the device: NCCL reduces no CPU tensors
    for k in range(passes):
        i = k * micro_batch
        idx = rows[i:i + micro_batch] if i < len(rows) else rows[:micro_batch] if len(rows) else parts[0][:1]
        batch = torch.from_numpy(tokens[idx]).to(device)
        with torch.no_grad(), autocast():
            # The training loss path (mean over the batch's tokens): under tensor parallelism it is the
            # vocabulary-parallel cross entropy, so full logits are never gathered.
            mean = model(batch[:, :-1], batch[:, 1:])
        if i < len(rows):
            total += mean.double() * batch[:, 1:].numel()
    if dp is not None:
        dp.all_reduce(total)
    count = tokens.shape[0] * (tokens.shape[1] - 1)
    return float(total.item() / count), count


def load_eval_tokens_for(cfg: Config) -> np.ndarray:
    """eval.tokens checked against cfg.model."""
    m = cfg.model
    return load_eval_tokens(cfg.eval.tokens, m.vocab_size, m.max_position_embeddings if m.learned_positions else None)


def check_pipeline_eval(layout: ParallelLayout, rows: int, micro_batch: int) -> None:
    """Pipeline micro-batches have one fixed shape: each data-parallel rank's rows must split evenly."""
    from mpformer.core.layout import check_args

    per_rank = rows // layout.dp
    if rows % layout.dp or per_rank % micro_batch:
        raise ConfigError(f"eval.tokens has {rows} rows: under pipeline parallelism each of dp={layout.dp} ranks needs "
                          f"a whole number of eval.micro_batch_size={micro_batch} rows; valid: rows a multiple of "
                          f"{layout.dp * micro_batch}")
    try:
        check_args(layout.schedule, layout.pp, per_rank // micro_batch, layout.vpp)
    except ConfigError as e:
        raise ConfigError(f"eval.tokens: {per_rank // micro_batch} micro-batches per rank: {e}") from None


def pipeline_evaluate_loss(model: torch.nn.Module, plan: StagePlan, layout: ParallelLayout, groups: ProcessGroups,
                           tokens: np.ndarray, micro_batch: int,
                           autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                           ) -> tuple[float, int]:
    """The forward passes of the training schedule (forward_only), the loss summed on the last stage
    and shared over pp and dp: (mean loss, token count)."""
    import torch

    from mpformer.parallel.comm import Comm
    from mpformer.pipeline.build import build_pipeline

    device = groups.device.torch_device
    rows = np.array_split(np.arange(tokens.shape[0]), layout.dp)[groups.dp_rank]
    batches = []
    for i in range(0, len(rows), micro_batch):
        b = torch.from_numpy(tokens[rows[i:i + micro_batch]]).to(device)
        batches.append((b[:, :-1], b[:, 1:]))
    seq = tokens.shape[1] - 1
    dtype = next(model.parameters()).dtype  # the residual stream's: 16-bit under bf16/fp16 parameters
    engine = build_pipeline(model, plan, layout, groups, micro_batches=len(batches), seq_length=seq,
                            micro_batch_size=micro_batch, dtype=dtype, autocast=autocast, forward_only=True)
    with torch.no_grad():
        means = engine.run(batches, forward_only=True)
    total = (means.double().sum() * (micro_batch * seq)).to(device)
    for comm in (Comm(groups.pp, groups.ledger, "eval.pp."), Comm(groups.data_group, groups.ledger, "eval.dp.")):
        comm.all_reduce(total)
    count = tokens.shape[0] * seq
    return float(total.item() / count), count


def validation_loss(model: torch.nn.Module, plan: StagePlan | None, layout: ParallelLayout, groups: ProcessGroups,
                    tokens: np.ndarray, micro_batch: int,
                    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> float:
    """The mean loss on eval.tokens during training, rows split over dp: through the stage's forward
    passes under a pipeline; the model is back in training mode afterwards."""
    from mpformer.parallel.comm import Comm

    model.eval()
    try:
        if plan is not None:
            return pipeline_evaluate_loss(model, plan, layout, groups, tokens, micro_batch, autocast=autocast)[0]
        return evaluate_loss(model, tokens, micro_batch, groups.device.torch_device,
                             Comm(groups.data_group, groups.ledger, tag="eval.dp."), layout.cp, autocast=autocast)[0]
    finally:
        model.train()
