"""Whole-folder conversions: an HF folder -> an mpformer checkpoint directory, and back.

The mpformer side is an ordinary checkpoint step directory (DCP payload with tensors keyed
``model.<canonical name>``, a router's selection bias ``buffers.<canonical name>``, manifest.json with
step 0 and no optimizer state), written directly at
the requested path rather than under ``save_dir/step_N``, so ``load_checkpoint(out, model)``,
``read_manifest(out)`` and ``read_all_tensors(out)`` accept it. Both directions write into a temp
sibling and rename at the end, so an interrupted conversion never leaves a half-written output.

The manifest's ``source`` keeps the HF config.json and generation_config.json verbatim: the model
config is rebuilt from ModelConfig on export, and only the token ids and generation settings,
which ModelConfig has no fields for, are taken from there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from mpformer.checkpoint.io import BUFFER_PREFIX, MODEL_PREFIX, quiet_dcp, read_all_tensors
from mpformer.checkpoint.manifest import (
    Manifest,
    check_files,
    commit_dir,
    fresh_temp_dir,
    read_manifest,
    write_manifest,
)
from mpformer.convert import adapter_for_arch, adapter_for_hf_config
from mpformer.convert.base import canonical_buffer_names, hf_dtype_name
from mpformer.convert.hf_io import (
    DEFAULT_MAX_SHARD_BYTES,
    read_generation_config,
    read_hf_config,
    read_hf_state,
    write_hf_dir,
)
from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.model_config import ModelConfig
from mpformer.data.tokenizer import TOKENIZER_FILES, copy_tokenizer
from mpformer.models.fp8 import BUFFERS as FP8_BUFFERS

TOKENIZER_DIR = "tokenizer"
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class ConversionSummary:
    out: Path
    arch: str
    num_tensors: int
    num_params: int
    dtype: str
    tokenizer_files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---- output directories ----------------------------------------------------------------------
def _check_out(out: Path, flag: str) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{flag} {out} already exists and is not an empty directory; choose a new path")


@contextlib.contextmanager
def _atomic_dir(out: Path):
    """Yield a temp sibling of ``out``; on success it is renamed to ``out`` (checked empty before the
    conversion started) as checkpoint saves are (manifest.commit_dir), on failure removed."""
    tmp = fresh_temp_dir(out)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(tmp, out)


def write_checkpoint_dir(path: str | os.PathLike, tensors: dict[str, torch.Tensor], manifest: dict[str, Any],
                         *, populate: Callable[[Path], None] | None = None,
                         buffers: frozenset[str] | set[str] = frozenset()) -> Path:
    """Write a single-process mpformer checkpoint (step 0, weights only) directly at ``path``.

    ``tensors`` are canonical name -> tensor, stored in their own dtypes; ``populate(tmp_dir)`` may
    add files (e.g. the tokenizer) before the manifest hashes everything. Names in ``buffers`` are stored
    as ``buffers.<name>`` (where a training run keeps them), the rest as ``model.<name>``.
    """
    out = Path(path)
    _check_out(out, "checkpoint output")
    with _atomic_dir(out) as tmp:
        with quiet_dcp():
            dcp.save({(BUFFER_PREFIX if k in buffers else MODEL_PREFIX) + k: v for k, v in tensors.items()},
                     checkpoint_id=str(tmp), no_dist=True)
        if populate is not None:
            populate(tmp)
        write_manifest(tmp, {"step": 0, **manifest})
    return out


# ---- HF -> mpformer --------------------------------------------------------------------------
def hf_to_mpformer(hf_dir: str | os.PathLike, out_dir: str | os.PathLike) -> ConversionSummary:
    """Convert an HF folder (config.json + safetensors [+ tokenizer]) to an mpformer checkpoint."""
    src, out = Path(hf_dir), Path(out_dir)
    hf_cfg = read_hf_config(src)
    _check_out(out, "--out")
    adapter = adapter_for_hf_config(hf_cfg)
    cfg = adapter.config_from_hf(hf_cfg)
    canonical = adapter.to_canonical(read_hf_state(src), cfg)
    manifest: dict[str, Any] = {
        "model": cfg.to_dict(),
        "has_optimizer": False,
        "source": {"format": "huggingface", "path": str(src.resolve()), "architecture": adapter.hf_architecture,
                   "config": hf_cfg, "generation_config": read_generation_config(src)},
    }
    copied: list[str] = []
    if any((src / f).is_file() for f in TOKENIZER_FILES):
        manifest["tokenizer"] = TOKENIZER_DIR

    def populate(tmp: Path) -> None:
        copied.extend(copy_tokenizer(src, tmp / TOKENIZER_DIR))

    write_checkpoint_dir(out, canonical, manifest, populate=populate, buffers=canonical_buffer_names(cfg))
    notes = [] if copied else [f"no tokenizer files in {src}; the checkpoint has none"]
    return _summary(out, cfg, canonical, copied, notes)


# ---- mpformer -> HF --------------------------------------------------------------------------
def mpformer_to_hf(ckpt: str | os.PathLike, out_dir: str | os.PathLike, *,
                   tokenizer: str | os.PathLike | None = None,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> ConversionSummary:
    """Convert an mpformer checkpoint (step dir or save dir with ``latest``) to an HF folder."""
    manifest = read_manifest(ckpt)
    check_files(manifest)
    out = Path(out_dir)
    _check_out(out, "--out")
    tok_src = _tokenizer_source(manifest, tokenizer)
    cfg = ModelConfig.from_dict(manifest.model).validate()
    adapter = adapter_for_arch(cfg.arch)
    canonical = {**read_all_tensors(manifest.path), **read_all_tensors(manifest.path, BUFFER_PREFIX)}
    # A float8 run's delayed-scaling state is training state, not part of the model HF holds
    canonical = {k: v for k, v in canonical.items() if k.rsplit(".", 1)[-1] not in FP8_BUFFERS}
    hf_state = adapter.to_hf(canonical, cfg)
    hf_cfg, notes = adapter.config_to_hf(cfg)
    hf_cfg["dtype"] = hf_cfg["torch_dtype"] = hf_dtype_name(hf_state)  # 5.x and 4.x spellings

    source = manifest.get("source") or {}
    same_arch = source.get("architecture") == adapter.hf_architecture
    old_cfg = (source.get("config") or {}) if same_arch else {}
    # Token ids are tokenizer facts ModelConfig does not hold; unknown ones are written as null so
    # HF does not fill in its class defaults (GPT2Config would claim 50256).
    hf_cfg.update({k: old_cfg.get(k) for k in TOKEN_ID_KEYS})
    if tok_src is not None:  # a trainer checkpoint carries its tokenizer: its special ids are the truth
        for k, v in _token_ids(tok_src).items():
            if hf_cfg.get(k) is None:
                hf_cfg[k] = v
    generation = source.get("generation_config") if same_arch else None
    if generation is None and hf_cfg["eos_token_id"] is not None:
        generation = {k: hf_cfg[k] for k in TOKEN_ID_KEYS if hf_cfg[k] is not None}

    copied: list[str] = []
    with _atomic_dir(out) as tmp:
        write_hf_dir(tmp, hf_state, hf_cfg, generation, max_shard_bytes=max_shard_bytes)
        if tok_src is not None:
            copied = copy_tokenizer(tok_src, tmp)
    if tok_src is None:
        notes.append("no tokenizer (none in the checkpoint, no --tokenizer given)")
    return _summary(out, cfg, canonical, copied, notes)


def _token_ids(tokenizer_dir: Path) -> dict[str, int | None]:
    from transformers import AutoTokenizer  # late: only exports that carry a tokenizer pay for it

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return {k: getattr(tok, k, None) for k in TOKEN_ID_KEYS}


def _tokenizer_source(manifest: Manifest, tokenizer: str | os.PathLike | None) -> Path | None:
    if tokenizer is not None:
        src = Path(tokenizer)
        if not src.is_dir():
            raise ConfigError(f"--tokenizer {src} does not exist or is not a directory")
        if not any((src / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(f"--tokenizer {src} holds no tokenizer files; expected any of "
                              f"{format_choices(TOKENIZER_FILES)}")
        return src
    name = manifest.tokenizer
    if name and (manifest.path / name).is_dir():
        return manifest.path / name
    return None


def _summary(out: Path, cfg: ModelConfig, canonical: dict[str, torch.Tensor], tokenizer_files: list[str],
             notes: list[str]) -> ConversionSummary:
    return ConversionSummary(out=out, arch=cfg.arch, num_tensors=len(canonical),
                             num_params=sum(t.numel() for t in canonical.values()),
                             dtype=hf_dtype_name(canonical), tokenizer_files=tokenizer_files, notes=notes)
