"""One checkpointer over a run's stateful parts: each part gives its state and loads it back.

    part.tensors()          this rank's tensors by canonical name and slice (DCP: every rank writes its own)
    part.state()            a small JSON value, stored in the manifest under the part's name (rank 0 writes)
    part.rank_state()       an object of this rank alone (RNG streams), one file per rank

``save(step)`` writes all of them atomically (saving.save_checkpoint: temp dir, payload, manifest with
checksums, rename, then ``latest``). ``load(manifest)`` takes the checkpoint preflight opened
(manifest read, every file present, checksums on rank 0) and restores in the resume order: tensors
first (weights, then optimizer state), then the manifest states (counters, loss scale), then the
rank files; each load callable also gets the manifest, so a part decides for itself what to take
(a fine-tune takes the weights only). The
checks that need no process group (manifest, files, model shapes) are in manifest.py and run in
preflight, before any rank starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpformer.checkpoint.manifest import Manifest
from mpformer.checkpoint.saving import BackgroundSave, save_checkpoint, start_background_save
from mpformer.core.shards import Shard


@dataclass(frozen=True)
class CheckpointPart:
    """One stateful piece of a run; every callable is optional."""

    name: str
    tensors: Callable[[], dict[str, Shard]] | None = None
    load_tensors: Callable[[str, Manifest], None] | None = None  # (step directory, manifest)
    state: Callable[[], Any] | None = None
    load_state: Callable[[Any, Manifest], None] | None = None  # (the saved state or None, manifest)
    rank_state: Callable[[], Any] | None = None
    load_rank_state: Callable[[Any, Manifest], None] | None = None  # (this rank's object or None, manifest)


class Checkpointer:
    def __init__(self, save_dir: Path, parts: Sequence[CheckpointPart], *, rank: int, keep: int = 0,
                 extra: Callable[[], dict[str, Any]] | None = None,
                 populate: Callable[[Path], None] | None = None,
                 owner: Callable[[], str | None] | None = None) -> None:
        """``extra()``: manifest entries beside the parts' (model config, layout, ...); ``populate(dir)``
        adds files on rank 0 before the manifest is written (the tokenizer); ``owner()``: the run id
        written into each manifest, the only checkpoints ``keep`` prunes."""
        self.save_dir, self.parts, self.rank, self.keep = save_dir, list(parts), rank, keep
        self.extra, self.populate, self.owner = extra, populate, owner
        self.pending: BackgroundSave | None = None  # at most one background save in flight
        self.staging: dict[str, torch.Tensor] = {}  # its host copies, reused by the next one
        names = [p.name for p in self.parts]
        assert len(set(names)) == len(names), f"two checkpoint parts share a name: {names}"

    def _rank_file(self) -> str:
        return f"rng/rank_{self.rank:05d}.pt"

    def save(self, step: int, *, group: Any = None, background: bool = False) -> Path | None:
        """Collective: every rank calls it. ``background``: the tensors are staged to host memory and
        written by a thread coordinating over ``group`` (a gloo group of its own); the checkpoint is
        committed by a later ``poll`` or ``wait``, and a save still in flight is finished first."""
        self.wait()
        tensors: dict[str, Shard] = {}
        for p in self.parts:
            if p.tensors is not None:
                tensors.update(p.tensors())
        manifest = dict(self.extra()) if self.extra is not None else {}
        manifest.update({p.name: p.state() for p in self.parts if p.state is not None})
        ranked = {p.name: p.rank_state() for p in self.parts if p.rank_state is not None}
        kw = {"keep": self.keep, "rank_files": {self._rank_file(): ranked} if ranked else None,
              "populate": self.populate, "owner": self.owner() if self.owner is not None else None}
        if background:
            self.pending = start_background_save(self.save_dir, step, tensors, manifest, group=group,
                                                 staging=self.staging, **kw)
            return None
        return save_checkpoint(self.save_dir, step, tensors, manifest, **kw)

    def poll(self, all_written: Callable[[bool], bool]) -> Path | None:
        """Collective at a step boundary: commit the background save if every rank's part is written
        (``all_written(mine)``: the ranks' agreement, a one-element all-reduce); its path, else None."""
        if self.pending is None or not all_written(self.pending.written_here()):
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Collective: the background save in flight, finished and committed (None: there was none)."""
        pending, self.pending = self.pending, None
        return pending.finish() if pending is not None else None

    def load(self, manifest: Manifest) -> Manifest:
        """Restore every part from the checkpoint whose ``manifest`` preflight read and checked (its
        ``path``: the step directory), so that the model config and the weights come from one step."""
        step_dir = str(manifest.path)
        for p in self.parts:
            if p.load_tensors is not None:
                p.load_tensors(step_dir, manifest)
        for p in self.parts:
            if p.load_state is not None:
                p.load_state(manifest.get(p.name), manifest)
        rank_file = Path(step_dir) / self._rank_file()
        ranked = torch.load(rank_file, weights_only=True) if rank_file.is_file() else {}
        holders = [p for p in self.parts if p.load_rank_state is not None]
        if ranked and len(holders) == 1 and holders[0].name not in ranked:  # one object, not keyed by part
            ranked = {holders[0].name: ranked}  # (checkpoints written before parts: the RNG states alone)
        for p in self.parts:
            if p.load_rank_state is not None:
                p.load_rank_state(ranked.get(p.name), manifest)
        return manifest
