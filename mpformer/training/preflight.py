"""Every check that can run before a process group exists (DESIGN principle 8: loud and early).

A mistake found here costs the user a second and one line of output, instead of a hang or a
traceback from N ranks after start-up.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from mpformer.checkpoint.manifest import check_files, check_model_matches, read_manifest
from mpformer.cli.compose import Composed
from mpformer.data.indexed import check_data_prefix
from mpformer.data.sampler import build_train_dataset
from mpformer.errors import ConfigError
from mpformer.models.config import ModelConfig
from mpformer.parallel.layout import ParallelLayout, validate
from mpformer.training.config import check_training_config
from mpformer.training.evaluation import load_eval_tokens


def adopt_checkpoint_model(composed: Composed) -> dict[str, Any] | None:
    """With checkpoint.load and no model chosen on the command line, use the checkpoint's model
    config; when the user did choose one, it must match the checkpoint's shapes."""
    cfg = composed.cfg
    if not cfg.checkpoint.load:
        return None
    manifest = read_manifest(cfg.checkpoint.load)
    check_files(manifest)
    if composed.overridden("model") or composed.overridden("experiment"):
        check_model_matches(manifest, cfg.model)
    else:
        cfg.model = ModelConfig.from_dict(manifest["model"])
    return manifest


def check_data(cfg_data_paths: list[str], tokenizer: str | None) -> None:
    if not cfg_data_paths:
        raise ConfigError("data.paths is empty; give data.paths=[PREFIX,...] (indexed .bin/.idx prefixes written by "
                          "tools/preprocess_data.py) or a preset such as data=demo")
    for p in cfg_data_paths:
        check_data_prefix(p)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ConfigError(f"data.tokenizer={tokenizer}: no such directory (a Hugging Face tokenizer folder)")


def preflight_train(composed: Composed, world_size: int) -> ParallelLayout:
    """Validate everything pretrain needs; return the resolved layout."""
    cfg = composed.cfg
    adopt_checkpoint_model(composed)
    check_training_config(cfg)
    t = cfg.train
    layout = validate(cfg.parallel.layout(), cfg.model, world_size, global_batch_size=t.global_batch_size,
                      micro_batch_size=t.micro_batch_size, seq_length=t.seq_length)
    check_data(list(cfg.data.paths), cfg.data.tokenizer)
    if t.use_apex and importlib.util.find_spec("apex") is None:
        raise ConfigError("train.use_apex=true but NVIDIA apex is not installed; valid: false (torch's native "
                          "kernels), or install apex (the docker image has it)")
    build_train_dataset(list(cfg.data.paths), cfg.data.weights, t.seq_length, t.seed)  # too-small data fails here
    if cfg.eval.interval:
        load_eval_tokens(cfg.eval.tokens, cfg.model.vocab_size)
    return layout
