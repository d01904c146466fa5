"""Every check that can run before a process group exists (docs/architecture.md, principle 8: loud
and early), and the run specification they resolve.

A mistake found here costs the user a second and one line of output, instead of a hang or a
traceback from N ranks after start-up. What preflight opened and decided (the checkpoint's model,
the auto-configurator's layout, the validated layout, the dataset, the eval tokens, the manifest)
comes back as one immutable RunSpec: the config it validated is never rewritten, and the trainer
reads nothing else.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mpformer.checkpoint.manifest import Manifest, check_files, check_model_matches, newest_complete, read_manifest
from mpformer.core.composed import Composed
from mpformer.core.config import LOAD_AUTO, Config, check_training_config
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout, validate
from mpformer.core.model_config import ModelConfig
from mpformer.data.blend import BlendedDataset
from mpformer.data.gpt_dataset import GPTDataset
from mpformer.data.indexed import check_data_prefix
from mpformer.data.sampler import build_train_dataset
from mpformer.training.evaluation import check_pipeline_eval, load_eval_tokens_for

if TYPE_CHECKING:
    from mpformer.autoconfig.plan import Prediction
    from mpformer.data.synthetic import SyntheticTokens


@dataclass(frozen=True)
class RunSpec:
    """A training run as preflight resolved it."""

    cfg: Config  # with the checkpoint's model and the auto-configurator's layout applied
    layout: ParallelLayout  # validated, dp resolved
    run_dir: Path
    resolved: dict[str, Any]  # cfg as resolved_config.yaml holds it
    dataset: GPTDataset | BlendedDataset | SyntheticTokens
    eval_tokens: np.ndarray | None  # eval.tokens, when validation runs during training
    manifest: Manifest | None  # the checkpoint to load: read, its files checked
    prediction: Prediction | None  # the cost model's, when a cluster is named or parallel=auto chose
    document_eos: int | None = None  # data.document_mask: the token that ends each document


def adopt_checkpoint_model(composed: Composed) -> tuple[ModelConfig, Manifest | None]:
    """The model config and, with checkpoint.load, its manifest. With a checkpoint the model is the
    checkpoint's, with any ``model.<key>=`` overrides applied on top; a preset chosen on the command
    line (model=..., experiment=...) is used as is. Either way the shapes must match the checkpoint's."""
    cfg = composed.cfg
    if not cfg.checkpoint.load:
        return cfg.model, None
    if cfg.checkpoint.load == LOAD_AUTO:
        manifest = auto_checkpoint(cfg, Path(composed.run_dir))
        if manifest is None:
            return cfg.model, None
    else:
        manifest = read_manifest(cfg.checkpoint.load)
    # Files and sizes here, on every rank; the checksums once the group is up, each rank a share of the
    # files (io.verify_checksums: no rank hashes everything while the others wait at the rendezvous).
    check_files(manifest)
    model = cfg.model
    if not (composed.overridden_group("model") or composed.overridden_group("experiment")):
        saved = ModelConfig.from_dict(manifest.model)
        model = replace(saved, **{key: getattr(cfg.model, key) for key in composed.overridden_keys("model")})
    check_model_matches(manifest, model)
    return model, manifest


def auto_checkpoint(cfg: Config, run_dir: Path) -> Manifest | None:
    """checkpoint.load=auto: the newest complete checkpoint in the save_dir this run writes to, or None
    (a fresh start), so that ``torchrun --max-restarts=N`` restarts in place. Newer ones that are
    incomplete or damaged are passed over with a warning naming what is wrong."""
    save_dir = Path(cfg.checkpoint.save_dir) if cfg.checkpoint.save_dir else run_dir / "checkpoints"
    manifest, passed = newest_complete(save_dir)
    if os.environ.get("RANK", "0") == "0":
        for line in passed:
            print(f"warning: checkpoint.load=auto passes over {line}", file=sys.stderr, flush=True)
        if manifest is None:
            print(f"checkpoint.load=auto: no checkpoint in {save_dir}, starting fresh", flush=True)
    return manifest


def check_resume_data(manifest: Manifest, cfg: Config) -> None:
    """A resume continues the saved sample stream; a changed stream must be asked for (finetune)."""
    saved = (manifest.get("trainer") or {}).get("data")
    if saved is None or cfg.checkpoint.finetune or not manifest.has_optimizer:
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


def document_eos(cfg: Config) -> int | None:
    """The EOS id that bounds documents under data.document_mask (data.eos_token_id, else the tokenizer's)."""
    d = cfg.data
    if not d.document_mask:
        if d.eos_token_id is not None:
            raise ConfigError(f"data.eos_token_id={d.eos_token_id} bounds documents only under data.document_mask="
                              "true; valid: data.document_mask=true, or no data.eos_token_id")
        return None
    if d.eos_token_id is not None:
        if not 0 <= d.eos_token_id < cfg.model.vocab_size:
            raise ConfigError(f"data.eos_token_id={d.eos_token_id} is outside the vocabulary [0, "
                              f"{cfg.model.vocab_size - 1}]")
        return d.eos_token_id
    if d.tokenizer:
        from mpformer.data.tokenizer import eos_id, load_tokenizer

        return eos_id(load_tokenizer(d.tokenizer))
    raise ConfigError("data.document_mask=true needs the token that ends each document: give data.eos_token_id=ID "
                      "or data.tokenizer=DIR (its EOS token)")


def check_eval_rows(layout: ParallelLayout, rows: np.ndarray, path: str | None) -> None:
    """Eval rows split like training sequences: over tp under sequence parallelism, into 2*cp chunks."""
    sp, cp = layout.tp if layout.sequence_parallel else 1, 2 * layout.cp if layout.cp > 1 else 1
    seq, parts = rows.shape[1] - 1, []
    if sp > 1:
        parts.append(f"tp={layout.tp} (sequence parallelism)")
    if cp > 1:
        parts.append(f"2*cp={cp} chunks (context parallelism)")
    if seq % (sp * cp):
        raise ConfigError(f"eval.tokens={path}: rows of {seq} inputs do not split over {' and '.join(parts)}; valid: "
                          f"multiples of {sp * cp}")


def _layout(composed: Composed, world_size: int,
            model: ModelConfig) -> tuple[Config, ParallelLayout, Prediction | None]:
    """The config with ``model``, the auto-configurator's choice applied under parallel=auto, and its
    validated layout."""
    cfg = replace(composed.cfg, model=model)
    check_training_config(cfg)
    prediction = None
    if cfg.parallel.auto:  # the search's layout and micro-batch size, pins kept
        from mpformer.autoconfig.plan import apply_plan, choose_layout

        prediction = choose_layout(cfg, composed, world_size)
        cfg = apply_plan(cfg, composed, prediction)
        check_training_config(cfg)  # the rules that involve the layout, on the chosen one
    t = cfg.train
    layout = validate(cfg.parallel.layout(), cfg.model, world_size, global_batch_size=t.global_batch_size,
                      micro_batch_size=t.micro_batch_size, seq_length=t.seq_length)
    return cfg, layout, prediction


def _resolved(cfg: Config) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def preflight_train(composed: Composed, world_size: int) -> RunSpec:
    """Validate everything pretrain needs and resolve it into a RunSpec."""
    model, manifest = adopt_checkpoint_model(composed)
    cfg, layout, prediction = _layout(composed, world_size, model)
    t = cfg.train
    check_data(list(cfg.data.paths), cfg.data.tokenizer)
    eos = document_eos(cfg)
    if cfg.data.tokenizer:
        check_tokenizer_fits(cfg.data.tokenizer, cfg.model.vocab_size)
    if manifest is not None:
        check_resume_data(manifest, cfg)
    check_writable(Path(cfg.checkpoint.save_dir or composed.run_dir), "checkpoint.save_dir" if
                   cfg.checkpoint.save_dir else "hydra.run.dir")
    if t.use_apex and importlib.util.find_spec("apex") is None:
        raise ConfigError("train.use_apex=true but NVIDIA apex is not installed; valid: false (torch's native "
                          "kernels), or install apex (the docker image has it)")
    dataset = build_train_dataset(list(cfg.data.paths), cfg.data.weights, t.seq_length, t.seed)  # too small fails
    rows = load_eval_tokens_for(cfg) if cfg.eval.interval else None
    if rows is not None:
        if layout.pp > 1:
            check_pipeline_eval(layout, rows.shape[0], cfg.eval.micro_batch_size)
        check_eval_rows(layout, rows, cfg.eval.tokens)
    if prediction is None and cfg.autoconfig.cluster is not None:
        from mpformer.autoconfig.plan import predict

        prediction = predict(cfg, layout, world_size)
    return RunSpec(cfg, layout, Path(composed.run_dir), _resolved(cfg), dataset, rows, manifest, prediction, eos)


def preflight_rehearsal(composed: Composed, world_size: int) -> RunSpec:
    """The RunSpec of a rehearsal (rehearsal/): the same model and layout checks as pretraining, synthetic
    token ids instead of data files (data/synthetic.py), no checkpoint read or written, no validation,
    nothing written to a run directory."""
    from mpformer.data.synthetic import SyntheticTokens

    cfg = composed.cfg
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, enabled=False, load=None), eval=replace(cfg.eval, interval=0),
                  logging=replace(cfg.logging, progress=False, wandb=replace(cfg.logging.wandb, mode="disabled")))
    composed = replace(composed, cfg=cfg)
    cfg, layout, prediction = _layout(composed, world_size, cfg.model)
    eos = None
    if cfg.data.document_mask:  # the id that ends documents; a tokenizer is not needed to rehearse
        eos = cfg.data.eos_token_id if cfg.data.eos_token_id is not None else cfg.model.vocab_size - 1
    dataset = SyntheticTokens(cfg.train.seq_length, cfg.model.vocab_size, cfg.train.seed, eos)
    return RunSpec(cfg, layout, Path(composed.run_dir), _resolved(cfg), dataset, None, None, prediction, eos)
