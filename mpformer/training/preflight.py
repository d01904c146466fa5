"""Every check that can run before a process group exists (docs/architecture.md, principle 8: loud and early).

A mistake found here costs the user a second and one line of output, instead of a hang or a
traceback from N ranks after start-up.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpformer.checkpoint.manifest import check_files, check_model_matches, read_manifest
from mpformer.core.composed import Composed
from mpformer.core.config import check_training_config
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout, validate
from mpformer.core.model_config import ModelConfig
from mpformer.data.indexed import check_data_prefix
from mpformer.data.sampler import build_train_dataset
from mpformer.training.evaluation import check_pipeline_eval, load_eval_tokens_for

if TYPE_CHECKING:
    from mpformer.autoconfig.plan import Prediction


def adopt_checkpoint_model(composed: Composed) -> dict[str, Any] | None:
    """With checkpoint.load, the model config is the checkpoint's, with any ``model.<key>=`` overrides
    applied on top; a preset chosen on the command line (model=..., experiment=...) is used as is.
    Either way the shapes must match the checkpoint's."""
    cfg = composed.cfg
    if not cfg.checkpoint.load:
        return None
    manifest = read_manifest(cfg.checkpoint.load)
    # Rank 0 alone verifies checksums: every rank reading the whole checkpoint twice buys nothing.
    check_files(manifest, checksums=os.environ.get("RANK", "0") == "0")
    if not (composed.overridden_group("model") or composed.overridden_group("experiment")):
        saved = ModelConfig.from_dict(manifest["model"])
        for key in composed.overridden_keys("model"):
            setattr(saved, key, getattr(cfg.model, key))
        cfg.model = saved
    check_model_matches(manifest, cfg.model)
    return manifest


def check_resume_data(manifest: dict[str, Any], composed: Composed) -> None:
    """A resume continues the saved sample stream; a changed stream must be asked for (finetune)."""
    cfg = composed.cfg
    saved = (manifest.get("trainer") or {}).get("data")
    if saved is None or cfg.checkpoint.finetune or not manifest.get("has_optimizer"):
        return
    now = {"paths": [str(Path(p).resolve()) for p in cfg.data.paths], "weights": cfg.data.weights,
           "seq_length": cfg.train.seq_length, "seed": cfg.train.seed}
    before = {**saved, "paths": [str(Path(p).resolve()) for p in saved["paths"]]}
    for key, value in now.items():
        if before.get(key) != value:
            raise ConfigError(f"checkpoint.load resumes a run whose data {key} was {before.get(key)}, now {value}: "
                              f"the sample order would not continue; keep it, or set checkpoint.finetune=true to "
                              f"start a new run from these weights")


def check_writable(path: Path, what: str) -> None:
    """The nearest existing ancestor of ``path`` must be a writable directory (probed, not guessed)."""
    p = path.resolve()
    while not p.exists():
        p = p.parent
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".mpformer-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"{what}={path} is not writable ({e.strerror}); choose a directory you can write") from None


def check_tokenizer_fits(tokenizer: str, vocab_size: int) -> None:
    import json

    tok_file = Path(tokenizer) / "tokenizer.json"
    if not tok_file.is_file():
        return
    vocab = json.loads(tok_file.read_text()).get("model", {}).get("vocab", {})
    added = json.loads(tok_file.read_text()).get("added_tokens", [])
    size = max([len(vocab)] + [t["id"] + 1 for t in added])
    if size > vocab_size:
        raise ConfigError(f"data.tokenizer={tokenizer} has {size} tokens but model.vocab_size={vocab_size}; "
                          f"valid: model.vocab_size >= {size}")


def check_data(cfg_data_paths: list[str], tokenizer: str | None) -> None:
    if not cfg_data_paths:
        raise ConfigError("data.paths is empty; give data.paths=[PREFIX,...] (indexed .bin/.idx prefixes written by "
                          "tools/preprocess_data.py) or a preset such as data=demo")
    for p in cfg_data_paths:
        check_data_prefix(p)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ConfigError(f"data.tokenizer={tokenizer}: no such directory (a Hugging Face tokenizer folder)")


def preflight_train(composed: Composed, world_size: int) -> tuple[ParallelLayout, Prediction | None]:
    """Validate everything pretrain needs; return the resolved layout and, when a cluster is named or
    parallel=auto chose the layout, the cost model's prediction for it."""
    cfg = composed.cfg
    manifest = adopt_checkpoint_model(composed)
    check_training_config(cfg)
    prediction = None
    if cfg.parallel.auto:  # fills in cfg.parallel and train.micro_batch_size
        from mpformer.autoconfig.plan import choose_layout

        prediction = choose_layout(composed, world_size)
    t = cfg.train
    layout = validate(cfg.parallel.layout(), cfg.model, world_size, global_batch_size=t.global_batch_size,
                      micro_batch_size=t.micro_batch_size, seq_length=t.seq_length)
    check_data(list(cfg.data.paths), cfg.data.tokenizer)
    if cfg.data.tokenizer:
        check_tokenizer_fits(cfg.data.tokenizer, cfg.model.vocab_size)
    if manifest is not None:
        check_resume_data(manifest, composed)
    check_writable(Path(cfg.checkpoint.save_dir or composed.run_dir), "checkpoint.save_dir" if
                   cfg.checkpoint.save_dir else "hydra.run.dir")
    if t.use_apex and importlib.util.find_spec("apex") is None:
        raise ConfigError("train.use_apex=true but NVIDIA apex is not installed; valid: false (torch's native "
                          "kernels), or install apex (the docker image has it)")
    build_train_dataset(list(cfg.data.paths), cfg.data.weights, t.seq_length, t.seed)  # too-small data fails here
    if cfg.eval.interval:
        rows = load_eval_tokens_for(cfg)
        if layout.pp > 1:
            check_pipeline_eval(layout, rows.shape[0], cfg.eval.micro_batch_size)
        if layout.sequence_parallel and (rows.shape[1] - 1) % layout.tp:
            raise ConfigError(f"eval.tokens={cfg.eval.tokens}: rows of {rows.shape[1] - 1} inputs do not split over "
                              f"parallel.tp={layout.tp} under sequence parallelism; valid: multiples of {layout.tp}")
    if prediction is None and cfg.autoconfig.cluster is not None:
        from mpformer.autoconfig.plan import predict

        prediction = predict(cfg, layout, world_size)
    return layout, prediction
