"""``mpformer-eval`` / ``tools/evaluate.py``: mean next-token loss of a checkpoint on a token file.

    torchrun ... tools/evaluate.py checkpoint.load=DIR parallel.tp=.. parallel.pp=.. eval.tokens=FILE.npy

FILE.npy holds int64 [batch, seq+1]. The last line printed is ``{"loss": float, "tokens": int}``:
the mean cross entropy over all batch*seq predicted tokens. The model config comes from the
checkpoint unless given on the command line (then it must match).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mpformer.cli import user_errors_to_exit
from mpformer.cli.compose import compose_config
from mpformer.errors import ConfigError
from mpformer.parallel.launch import init_distributed, shutdown, world_size_from_env
from mpformer.parallel.layout import validate
from mpformer.training.preflight import adopt_checkpoint_model

if TYPE_CHECKING:  # torch loads after validation, so bad input exits in about a second
    import torch
    import torch.distributed as dist


def load_eval_tokens(path: str | None, vocab_size: int) -> np.ndarray:
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
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ConfigError(f"eval.tokens={path}: token ids span [{lo}, {hi}] but the model's vocabulary is "
                          f"[0, {vocab_size - 1}]")
    return np.asarray(arr, dtype=np.int64)


def evaluate_loss(model: torch.nn.Module, tokens: np.ndarray, micro_batch: int, device: torch.device,
                  dp_rank: int = 0, dp_size: int = 1, group: dist.ProcessGroup | None = None) -> tuple[float, int]:
    """Sum of token losses over this dp rank's rows, all-reduced: returns (mean loss, token count)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rows = np.array_split(np.arange(tokens.shape[0]), dp_size)[dp_rank]
    total = torch.zeros((), dtype=torch.float64)
    for i in range(0, len(rows), micro_batch):
        batch = torch.from_numpy(tokens[rows[i:i + micro_batch]]).to(device)
        with torch.no_grad():
            logits = model(batch[:, :-1]).float()
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].reshape(-1), reduction="sum").double().cpu()
    if dp_size > 1:
        dist.all_reduce(total, group=group)
    count = tokens.shape[0] * (tokens.shape[1] - 1)
    return float(total / count), count


@user_errors_to_exit
def main(argv: list[str] | None = None) -> int:
    composed = compose_config(sys.argv[1:] if argv is None else argv)
    cfg = composed.cfg
    if not cfg.checkpoint.load:
        raise ConfigError("checkpoint.load is not set; give checkpoint.load=DIR (a checkpoint or save directory)")
    manifest = adopt_checkpoint_model(composed)
    assert manifest is not None
    layout = validate(cfg.parallel.layout(), cfg.model, world_size_from_env(), seq_length=None)
    tokens = load_eval_tokens(cfg.eval.tokens, cfg.model.vocab_size)
    from mpformer.checkpoint.io import load_checkpoint
    from mpformer.models.transformer import Transformer
    from mpformer.parallel.device import resolve_device
    from mpformer.parallel.groups import ProcessGroups

    device = resolve_device(cfg.train.device)
    init_distributed(device, cfg.train.dist_timeout_s)
    try:
        groups = ProcessGroups.build(layout, device)
        model = Transformer(cfg.model, device=device.torch_device, seed=None).eval()
        load_checkpoint(manifest["path"], model)
        loss, count = evaluate_loss(model, tokens, cfg.eval.micro_batch_size, device.torch_device,
                                    groups.dp_rank, layout.dp, groups.dp)
        if groups.is_logging_rank:
            print(json.dumps({"loss": loss, "tokens": count}), flush=True)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
