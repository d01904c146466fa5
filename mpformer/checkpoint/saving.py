"""Saving checkpoints: atomic, hashed by the ranks that wrote them, in the foreground or the background.

    begin_save        collective: rank 0 makes ``step_N.tmp``
    payload           every rank: its own objects (RNG states, torch.save), then DCP's tensors
                      (dcp.save; or dcp.async_save on a separate gloo group, staged to host memory
                      first, so training goes on while a thread writes)
    finish_save       collective, once the payload is down: each rank has hashed the files it wrote (the
                      data files while writing them, hashed_writer.py), rank 0
                      gathers the digests, writes manifest.json, renames ``step_N.tmp`` to ``step_N``,
                      moves ``latest``, prunes; a failure on any rank (a full disk) is raised on all,
                      as one line, with the temp directory removed and the previous checkpoint intact

A SIGKILL at any instant leaves either the previous state or the new complete directory (the
rename is the commit; ``latest`` follows it, and checkpoint.load=auto does not need it).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from mpformer.checkpoint.hashed_writer import HashingFileSystemWriter
from mpformer.checkpoint.io import _no_dist, quiet_dcp
from mpformer.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    commit_dir,
    file_digests,
    fresh_temp_dir,
    point_latest,
    step_dir_name,
    step_dirs,
    write_manifest,
)
from mpformer.checkpoint.shards import ShardSavePlanner
from mpformer.core.errors import ConfigError
from mpformer.core.shards import Shard


def save_checkpoint(save_dir: str | Path, step: int, tensors: dict[str, Shard],
                    manifest: dict[str, Any], *, rank_files: dict[str, Any] | None = None,
                    populate: Callable[[Path], None] | None = None, keep: int = 0,
                    owner: str | None = None) -> Path:
    """Atomically write ``save_dir/step_N``: temp dir, payload, manifest, rename, then ``latest``.

    Collective when torch.distributed is initialised: every rank calls it with its tensors (DCP
    deduplicates replicated ones); ``rank_files`` are this rank's own objects (e.g. RNG states);
    ``populate(tmp_dir)`` runs on rank 0 to add files (e.g. the tokenizer) before the manifest.
    Every rank hashes the files it wrote and rank 0 gathers the digests: no rank reads everyone's
    files while the others wait. ``keep``: the newest ``keep`` checkpoints whose manifest names this
    ``owner`` (a run id) are kept, older ones of that owner removed; others' are never touched.
    A failed write (a full disk) removes the partial directory and raises a one-line ConfigError:
    the previous checkpoint and ``latest`` stay as they were.
    """
    save_dir = Path(save_dir)
    final, tmp = begin_save(save_dir, step)
    rank_paths, failure = write_rank_files(tmp, rank_files)
    writer = HashingFileSystemWriter(tmp)
    try:
        with quiet_dcp():  # collective: a rank's failed write raises on every rank
            dcp.save({k: sh.local for k, sh in tensors.items()}, storage_writer=writer,
                     planner=ShardSavePlanner(tensors), no_dist=_no_dist())
    except CheckpointException as e:
        failure = failure or _cause(e)
    digests, failure = _digests(tmp, writer, rank_paths, failure)
    return finish_save(save_dir, step, final, tmp, manifest, populate=populate, keep=keep, owner=owner,
                       digests=digests, failure=failure)


def _digests(tmp: Path, writer: HashingFileSystemWriter, rank_paths: list[Path],
             failure: str | None) -> tuple[dict[str, dict[str, Any]], str | None]:
    """This rank's files' digests: the data files' from the writer (taken while writing), its own objects'
    hashed here; or the failure, if the save failed or they cannot be read."""
    if failure is not None:
        return {}, failure
    try:
        return {**writer.digests(tmp), **file_digests(tmp, rank_paths)}, None
    except OSError as e:
        return {}, f"rank {_rank()}: {e.strerror or e}"


def begin_save(save_dir: Path, step: int) -> tuple[Path, Path]:
    """Collective: the step directory's final name and its empty temp directory (rank 0 makes it)."""
    final = save_dir / step_dir_name(step)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        tmp = fresh_temp_dir(final)
    _barrier()
    return final, tmp


def write_rank_files(tmp: Path, rank_files: dict[str, Any] | None) -> tuple[list[Path], str | None]:
    """This rank's own objects (torch.save), and the failure if one could not be written (the caller
    still takes part in the collective save: the failure is agreed on at the commit)."""
    paths = []
    try:
        for name, obj in (rank_files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj, tmp / name)
            paths.append(tmp / name)
    except OSError as e:
        return paths, f"rank {_rank()}: {e.strerror or e}"
    return paths, None


def finish_save(save_dir: Path, step: int, final: Path, tmp: Path, manifest: dict[str, Any], *,
                populate: Callable[[Path], None] | None, keep: int, owner: str | None,
                digests: dict[str, dict[str, Any]], failure: str | None) -> Path:
    """Collective, once every rank's payload is in ``tmp`` and hashed (``digests``: this rank's files):
    rank 0 writes the manifest from all of them and commits; a failure anywhere is raised on every rank."""
    rank = _rank()
    failure = _commit_on_rank0(save_dir, final, tmp, step, manifest, populate, keep, owner, rank,
                               _gather((digests, failure), rank))
    if failure is not None:
        raise ConfigError(f"checkpoint save of step {step} to {final} failed ({failure}); the previous checkpoint "
                          f"and {save_dir / LATEST} are unchanged")
    return final


def _rank() -> int:
    return 0 if _no_dist() else dist.get_rank()


def _cause(e: CheckpointException) -> str:
    """The first failing rank's own error, in a few words (DCP's message is every rank's traceback)."""
    for rank, (exc, _) in sorted(e.failures.items()):
        what = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        return " ".join(f"rank {rank}: {what}".split())[:300]
    return "CheckpointException"


def _commit_on_rank0(save_dir: Path, final: Path, tmp: Path, step: int, manifest: dict[str, Any],
                     populate: Callable[[Path], None] | None, keep: int, owner: str | None, rank: int,
                     results: list[tuple[dict, str | None]]) -> str | None:
    """Rank 0: the manifest from every rank's digests, the rename, ``latest``, pruning; the failure (any
    rank's, or the commit's), the same on every rank (collective)."""
    failure = None
    if rank == 0:
        failure = next((f for _, f in results if f is not None), None)
        if failure is None:
            try:
                if populate is not None:
                    populate(tmp)
                known = {k: v for d, _ in results for k, v in d.items()}
                write_manifest(tmp, {"step": step, **({"owner": owner} if owner else {}), **manifest}, known)
                commit_dir(tmp, final)  # re-saving a step moves the old copy aside first
                point_latest(save_dir, final.name)
                _prune(save_dir, keep, owner, final)
            except OSError as e:
                failure = e.strerror or str(e)
        if failure is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if _no_dist():
        return failure
    box = [failure]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(mine: tuple[dict, str | None], rank: int) -> list[tuple[dict, str | None]]:
    """Every rank's (digests, failure) on rank 0 (this rank's alone without a process group)."""
    if _no_dist():
        return [mine]
    got: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    return got or []


def _prune(save_dir: Path, keep: int, owner: str | None, newest: Path) -> None:
    """Remove this owner's checkpoints beyond the newest ``keep`` (never ``newest``, never another run's)."""
    if keep <= 0:
        return
    mine = []
    for d in step_dirs(save_dir):
        try:
            if json.loads((d / MANIFEST).read_text()).get("owner") == owner and owner is not None:
                mine.append(d)
        except (OSError, ValueError):
            continue  # not a complete checkpoint: not ours to judge
    for old in mine[keep:]:
        if old != newest:
            shutil.rmtree(old)


def _barrier() -> None:
    if not _no_dist():
        dist.barrier()


def _stage(t: torch.Tensor, staging: dict[str, torch.Tensor] | None, key: str) -> torch.Tensor:
    """A host copy of ``t``, in ``staging[key]`` when it has the shape and dtype (kept there for next time)."""
    buf = staging.get(key) if staging is not None else None
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
        if staging is not None:
            staging[key] = buf
    return buf.copy_(t.detach(), non_blocking=False)


class _Staged(AsyncStager):
    """The state dict is a private copy already: DCP's own staging would copy it a second time."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:  # nothing is in flight
        pass


class BackgroundSave:
    """A checkpoint whose tensors a DCP thread is writing (start_background_save); ``finish`` commits it.
    The thread's writer hashes the data files as it writes them, so the commit hashes nothing."""

    def __init__(self, future: Future, writer: HashingFileSystemWriter, save_dir: Path, step: int, final: Path,
                 tmp: Path, manifest: dict[str, Any], commit: dict[str, Any], rank_paths: list[Path],
                 failure: str | None) -> None:
        self.future, self.writer, self.save_dir, self.step = future, writer, save_dir, step
        self.final, self.tmp = final, tmp
        self.manifest, self.commit, self.rank_paths, self.failure = manifest, commit, rank_paths, failure
        self.digests: dict[str, dict[str, Any]] = {}
        self._hashed = threading.Event()
        self._rank = _rank()
        future.add_done_callback(self._hash)

    def _hash(self, future: Future) -> None:
        """In the writer thread: this rank's failure, or the digests of the files it wrote."""
        try:
            future.result()
        except CheckpointException as e:
            self.failure = self.failure or _cause(e)
        except OSError as e:
            self.failure = self.failure or f"rank {self._rank}: {e.strerror or e}"
        finally:
            try:
                self.digests, self.failure = _digests(self.tmp, self.writer, self.rank_paths, self.failure)
            finally:
                self._hashed.set()

    def written_here(self) -> bool:
        """This rank's part is down and hashed (the others' may not be: agree before ``finish``)."""
        return self._hashed.is_set()

    def finish(self) -> Path:
        """Collective: wait for this rank's part, then commit as a foreground save does."""
        self._hashed.wait()
        return finish_save(self.save_dir, self.step, self.final, self.tmp, self.manifest,
                           failure=self.failure, digests=self.digests, **self.commit)


def start_background_save(save_dir: str | Path, step: int, tensors: dict[str, Shard], manifest: dict[str, Any], *,
                          group: dist.ProcessGroup | None, rank_files: dict[str, Any] | None = None,
                          populate: Callable[[Path], None] | None = None, keep: int = 0,
                          owner: str | None = None, staging: dict[str, torch.Tensor] | None = None) -> BackgroundSave:
    """Collective: the save of ``save_checkpoint`` with its tensors staged to host memory now and written
    by a DCP thread (dcp.async_save) that coordinates over ``group``, a gloo group of its own (the
    training group's collectives must not interleave with the thread's). The manifest, the rename and
    ``latest`` come with ``finish``, so the checkpoint appears whole or not at all. ``staging``: host
    buffers kept from the previous background save (filled in place: a fresh copy of every tensor would
    page-fault its way through the whole state each time); the caller must not start the next save before
    this one is finished."""
    save_dir = Path(save_dir)
    final, tmp = begin_save(save_dir, step)
    rank_paths, failure = write_rank_files(tmp, rank_files)
    # Staged here, not by DCP: the planner resolves each write from its own shards, so it must hold the
    # copies (planned over the live tensors, the thread would write whatever training has made of them).
    staged = {k: dataclasses.replace(sh, local=_stage(sh.local, staging, k)) for k, sh in tensors.items()}
    writer = HashingFileSystemWriter(tmp, background=True)
    with quiet_dcp():
        future = dcp.async_save({k: sh.local for k, sh in staged.items()}, storage_writer=writer,
                                planner=ShardSavePlanner(staged), process_group=group, no_dist=_no_dist(),
                                async_stager=_Staged())
    return BackgroundSave(future, writer, save_dir, step, final, tmp, manifest,
                          {"populate": populate, "keep": keep, "owner": owner}, rank_paths, failure)
