"""What a training run's checkpoint holds, and how a run loads one (trainer.py's side of checkpointer.py).

The parts: the weights and optimizer state (the gradient engine's shards), where the run stands
(progress.py), the fp16 loss scale, each rank's dropout streams, and the model's non-parameter state
(an expert router's selection bias: ``buffers.*``). Loading verifies the
checksums with every rank first; a damaged newest checkpoint of a save_dir falls back to the next
intact one. A resume continues the saved run; a fine-tune (``checkpoint.finetune``) takes only the
weights, except when rolling back (train.on_nan=rollback), which always continues.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from mpformer.checkpoint.checkpointer import Checkpointer, CheckpointPart, Manifest
from mpformer.checkpoint.io import BUFFER_PREFIX, load_tensors, stored_metadata, verify_checksums
from mpformer.checkpoint.manifest import MANIFEST, check_model_matches, newest_complete
from mpformer.core.config import LOAD_AUTO
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout
from mpformer.core.shards import Shard
from mpformer.data.tokenizer import copy_tokenizer
from mpformer.optim.loss_scale import LossScaler
from mpformer.parallel.kernel_choice import KernelChoice
from mpformer.parallel.random import DropoutStreams
from mpformer.training.preflight import RunSpec
from mpformer.training.progress import Progress


class Weights(Protocol):
    """The gradient engine's shards as the checkpoint saves and loads them (optim/engine.py)."""

    def tensors(self) -> dict: ...

    def load(self, ckpt_dir: str, *, optimizer: bool) -> None: ...


class RunCheckpoint:
    """The run's checkpointer, its parts, and the loading of them. It reads the run's spec and kernel
    choice; on load it changes what it is handed: the weights (and optimizer state), the progress,
    the loss scale and the dropout streams."""

    def __init__(self, spec: RunSpec, rank: int, kernels: KernelChoice, weights: Weights, progress: Progress,
                 scaler: LossScaler | None, rng: DropoutStreams,
                 buffers: Callable[[], dict[str, Shard]] | None = None) -> None:
        """``buffers``: the model's non-parameter state (``Transformer.canonical_buffers``), saved as ``buffers.*``."""
        self.spec, self.cfg, self.layout, self.kernels = spec, spec.cfg, spec.layout, kernels
        self.weights, self.progress, self.scaler, self.rng, self.rank = weights, progress, scaler, rng, rank
        self.buffers = buffers
        cfg = spec.cfg
        tok = Path(cfg.data.tokenizer) if cfg.data.tokenizer else None
        if tok is None and spec.manifest is not None and spec.manifest.tokenizer:
            tok = spec.manifest.path / spec.manifest.tokenizer  # keep carrying it
        self.tokenizer = tok
        self.save_dir = Path(cfg.checkpoint.save_dir) if cfg.checkpoint.save_dir else spec.run_dir / "checkpoints"
        self.checkpointer = Checkpointer(self.save_dir, self._parts(), rank=rank,
                                         keep=cfg.checkpoint.keep, extra=self._manifest,
                                         owner=lambda: progress.run_id,
                                         populate=(lambda d: copy_tokenizer(tok, d / "tokenizer")) if tok else None)
        # Background saves coordinate over a gloo group of their own: the DCP thread's collectives must not
        # interleave with training's (torchtitan does the same).
        self.save_group = (torch.distributed.new_group(backend="gloo")
                           if cfg.checkpoint.async_save and spec.layout.world_size > 1 else None)
        self.rolling_back = False

    def load_start(self, manifest: Manifest) -> None:
        """The checkpoint the run starts from (``checkpoint.load``), verified first."""
        self.checkpointer.load(self._verified(manifest))

    def newest(self) -> tuple[Manifest | None, list[str]]:
        """The newest complete checkpoint of save_dir (a background save in flight committed first: it
        may be that one), and what was passed over to reach it."""
        self.checkpointer.wait()
        return newest_complete(self.save_dir)

    def roll_back_to(self, manifest: Manifest) -> None:
        """Everything as saved in ``manifest``, the optimizer state included even for a fine-tune."""
        self.rolling_back = True
        try:
            self.checkpointer.load(manifest)
        finally:
            self.rolling_back = False

    def _manifest(self) -> dict:
        out = {"model": self.cfg.model.to_dict(), "layout": self.layout.to_dict(), "has_optimizer": True,
               "world_size": self.layout.world_size, "config": self.spec.resolved,
               "kernels": self.kernels.to_dict()}  # a resume takes the same CPU kernels (kernel_choice.py)
        if self.tokenizer is not None:
            out["tokenizer"] = "tokenizer"  # checkpoints carry their tokenizer, so exports are complete
        return out

    def _parts(self) -> list[CheckpointPart]:
        """Weights and optimizer state; where the run stands; the loss scale; the dropout streams."""
        parts = [CheckpointPart("model", tensors=self.weights.tensors, load_tensors=self._load_tensors),
                 CheckpointPart("trainer", state=lambda: self.progress.state(self.cfg), load_state=self._load_progress)]
        if self.scaler is not None:
            parts.append(CheckpointPart("loss_scaler", state=self.scaler.state_dict, load_state=self._load_scaler))
        parts.append(CheckpointPart("rng", rank_state=self.rng.state, load_rank_state=self._load_rng))
        if self.buffers is not None and self.buffers():
            parts.append(CheckpointPart("buffers", tensors=self._buffer_shards, load_tensors=self._load_buffers))
        return parts

    def _buffer_shards(self) -> dict[str, Shard]:
        return {BUFFER_PREFIX + k: sh for k, sh in self.buffers().items()}

    def _load_buffers(self, step_dir: str, manifest: Manifest) -> None:
        """The saved buffers, where the checkpoint has them (a dense or HF-converted one: they start at 0)."""
        stored = stored_metadata(step_dir)
        targets = {k: sh for k, sh in self._buffer_shards().items() if k in stored}
        for k, sh in targets.items():  # e.g. fp8 amax histories after train.fp8.amax_history_len changed
            if tuple(stored[k][0]) != tuple(sh.global_shape):
                raise ConfigError(f"checkpoint {step_dir}: {k} has shape {tuple(stored[k][0])} where this run keeps "
                                  f"{tuple(sh.global_shape)} (train.fp8.amax_history_len changed?); valid: the "
                                  f"settings the checkpoint was saved with")
        if targets:
            load_tensors(step_dir, targets)

    def _verified(self, manifest: Manifest) -> Manifest:
        """The checkpoint to load, its checksums verified by all ranks together. A damaged one fails,
        naming the file; when it was the newest of a save_dir (checkpoint.load=auto or a save_dir), the
        next older intact one is taken instead, with a warning naming what was wrong."""
        cfg = self.cfg
        load = cfg.checkpoint.load
        from_dir = load == LOAD_AUTO or (load is not None and not (Path(load) / MANIFEST).is_file())
        save_dir = self.save_dir if load == LOAD_AUTO else Path(str(load))
        while (bad := verify_checksums(manifest)) is not None:
            older, passed = newest_complete(save_dir, below=manifest.step) if from_dir else (None, [])
            if older is None:
                raise ConfigError(f"{bad}; no older intact checkpoint to fall back to" if from_dir else bad)
            for line in [bad, *passed]:
                self._warn(f"warning: {line}; falling back to {older.path}")
            check_model_matches(older, cfg.model)
            manifest = older
        return manifest

    def _warn(self, text: str) -> None:
        """A line from rank 0 (before the metrics logger exists)."""
        if self.rank == 0:
            print(text, file=sys.stderr, flush=True)

    def _resuming(self, manifest: Manifest) -> bool:
        """A resume continues the saved run (optimizer state, counters); a fine-tune takes the weights."""
        return manifest.has_optimizer and (self.rolling_back or not self.cfg.checkpoint.finetune)

    def _load_tensors(self, step_dir: str, manifest: Manifest) -> None:
        self.weights.load(step_dir, optimizer=self._resuming(manifest))

    def _load_progress(self, state: dict | None, manifest: Manifest) -> None:
        if state is not None and self._resuming(manifest):
            self.progress.load(state)

    def _load_scaler(self, state: dict | None, manifest: Manifest) -> None:
        saved = state if state is not None else (manifest.get("trainer") or {}).get("loss_scaler")
        if saved and self._resuming(manifest):
            self.scaler.load_state_dict(saved)

    def _load_rng(self, saved: dict | None, manifest: Manifest) -> None:
        """The saved streams when this rank continues the same rank of the same layout, else fresh ones."""
        saved_layout = manifest.layout  # as a layout: a key added since then takes its default
        same = saved_layout is not None and ParallelLayout(**saved_layout).to_dict() == self.layout.to_dict()
        if saved is None or not self.progress.step or not same:
            self.rng.reseed(self.progress.step)
        else:
            self.rng.load(saved)
