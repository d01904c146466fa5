"""Held-out loss: the evaluate CLI's core, also run by the trainer every eval.interval steps."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mpformer.errors import ConfigError

if TYPE_CHECKING:  # torch loads after validation, so bad input exits in about a second
    import torch

    from mpformer.parallel.comm import Comm
    from mpformer.training.config import Config


def load_eval_tokens(path: str | None, vocab_size: int, max_positions: int | None = None) -> np.ndarray:
    """The eval rows, checked: integer [batch, seq+1], ids inside the vocabulary, and (learned
    positions) seq <= max_positions."""
    if not path:
        raise ConfigError("eval.tokens is not set; give eval.tokens=FILE.npy (int64 array [batch, seq+1])")
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"eval.tokens={path}: no such file")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ConfigError(f"eval.tokens={path}: not a readable .npy file ({e})") from None
    if arr.ndim != 2 or arr.shape[1] < 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"eval.tokens={path}: expected an integer array [batch, seq+1] with seq >= 1, got "
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
                  dp: Comm | None = None) -> tuple[float, int]:
    """Sum of token losses over this dp rank's rows, all-reduced over ``dp``: (mean loss, token count)."""
    import torch

    dp_rank, dp_size = (dp.rank, dp.size) if dp is not None else (0, 1)
    rows = np.array_split(np.arange(tokens.shape[0]), dp_size)[dp_rank]
    total = torch.zeros((), dtype=torch.float64, device=device)  # on the device: NCCL reduces no CPU tensors
    for i in range(0, len(rows), micro_batch):
        batch = torch.from_numpy(tokens[rows[i:i + micro_batch]]).to(device)
        with torch.no_grad():
            # The training loss path (mean over the batch's tokens): under tensor parallelism it is the
            # vocabulary-parallel cross entropy, so full logits are never gathered.
            mean = model(batch[:, :-1], batch[:, 1:])
        total += mean.double() * batch[:, 1:].numel()
    if dp is not None:
        dp.all_reduce(total)
    count = tokens.shape[0] * (tokens.shape[1] - 1)
    return float(total.item() / count), count


def load_eval_tokens_for(cfg: Config) -> np.ndarray:
    """eval.tokens checked against cfg.model."""
    m = cfg.model
    return load_eval_tokens(cfg.eval.tokens, m.vocab_size, m.max_position_embeddings if m.learned_positions else None)
