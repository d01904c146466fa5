"""Checkpoint directories, manifests and the ``latest`` pointer.

    save_dir/
      latest                 text file naming the newest complete step directory
      step_0000010/
        manifest.json        format, step, model config, layout, trainer state, sha256 of every file
        .metadata, *.distcp  torch.distributed.checkpoint payload: tensors by global (canonical) name
        rng/rank_00000.pt    per-rank RNG states

A directory only gets its final name after every file and the manifest are on disk, and the
``latest`` pointer moves last, so a crash at any point leaves the previous checkpoint intact.
These functions are pure file operations: they run before any process group exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mpformer.core.errors import ConfigError
from mpformer.core.model_config import ModelConfig

FORMAT = "mpformer-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fresh_temp_dir(final: Path) -> Path:
    """``final.tmp``, empty: the leftovers of a crashed write removed, parents created."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """Give a complete ``tmp`` its final name: fsynced, an existing ``final`` moved aside first (so the
    name never stands for a half-written directory) and removed after. Checkpoint saves and
    conversions both end this way."""
    fsync_dir(tmp)
    old = None
    if final.exists():  # a fresh, unique name beside it: nothing of anyone else's is ever removed
        old = Path(tempfile.mkdtemp(prefix=final.name + ".old-", dir=final.parent))
        old.rmdir()
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old)
    fsync_dir(final.parent)


def file_digests(ckpt_dir: Path, files: list[Path]) -> dict[str, dict[str, Any]]:
    """relative path -> sha256 and size of ``files`` (hashlib releases the GIL on large buffers: threads)."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        digests = list(pool.map(sha256_file, files))
    return {str(p.relative_to(ckpt_dir)): {"sha256": h, "bytes": p.stat().st_size} for p, h in zip(files, digests)}


def write_manifest(ckpt_dir: Path, manifest: dict[str, Any],
                   known: dict[str, dict[str, Any]] | None = None) -> None:
    """Write manifest.json (fsynced) listing every payload file with its sha256: ``known`` digests (the
    other ranks hashed their own files), the rest hashed here."""
    known = dict(known or {})
    files = sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    known.update(file_digests(ckpt_dir, [p for p in files if str(p.relative_to(ckpt_dir)) not in known]))
    listed = {str(p.relative_to(ckpt_dir)) for p in files}
    manifest = {"format": FORMAT, "version": VERSION, **manifest,
                "files": {rel: known[rel] for rel in sorted(listed)}}
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST)


def point_latest(save_dir: Path, name: str) -> None:
    tmp = save_dir / (LATEST + ".tmp")
    tmp.write_text(name + "\n")
    with open(tmp) as f:
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)
    fsync_dir(save_dir)


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """A step directory (has manifest.json) or a save_dir (has ``latest``) -> the step directory."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"checkpoint.load={path}: no such directory")
    if (p / MANIFEST).is_file():
        return p
    if (p / LATEST).is_file():
        name = (p / LATEST).read_text().strip()
        target = p / name
        if not (target / MANIFEST).is_file():
            raise ConfigError(f"checkpoint.load={path}: 'latest' points to {name}, which has no {MANIFEST}")
        return target
    raise ConfigError(f"checkpoint.load={path} is not a checkpoint: expected {MANIFEST} (a step directory) or "
                      f"'{LATEST}' (a save directory)")


@dataclass(frozen=True)
class Manifest(Mapping[str, Any]):
    """A checkpoint's manifest.json as read and checked: what mpformer reads of it, typed, over the
    JSON object itself. As a read-only Mapping it is that object (a part's state is the value under
    the part's name, and ``path`` the step directory), for the parts and for tools reading raw keys."""

    path: Path  # the step directory
    step: int
    model: dict[str, Any]
    has_optimizer: bool
    layout: dict[str, Any] | None
    tokenizer: str | None  # the tokenizer folder inside the checkpoint, if it carries one
    files: dict[str, dict[str, Any]]  # relative path -> sha256 and bytes
    raw: Mapping[str, Any]

    @classmethod
    def parse(cls, step_dir: Path, m: dict[str, Any]) -> Manifest:
        try:
            return cls(step_dir, int(m["step"]), dict(m["model"]), bool(m.get("has_optimizer")), m.get("layout"),
                       m.get("tokenizer"), dict(m.get("files", {})), {**m, "path": str(step_dir)})
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"checkpoint {step_dir}: {MANIFEST} lacks or mangles {e}; it is not a complete "
                              f"{FORMAT}") from None

    def with_entries(self, **entries: Any) -> Manifest:
        """The same manifest with extra entries (what a load did, say), this one unchanged."""
        return replace(self, raw={**self.raw, **entries})

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


def read_manifest(path: str | os.PathLike) -> Manifest:
    d = resolve_checkpoint_dir(path)
    try:
        m = json.loads((d / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"checkpoint {d}: unreadable {MANIFEST} ({e})") from None
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise ConfigError(f"checkpoint {d}: format {m.get('format')} v{m.get('version')} is not "
                          f"{FORMAT} v{VERSION}")
    return Manifest.parse(d, m)


def check_files(manifest: Manifest, *, checksums: bool = False, share: tuple[int, int] = (0, 1)) -> None:
    """Every file the manifest lists exists with its size (and, if asked, its sha256), and the DCP
    index (``.metadata``) reads as checkpoint metadata, through the unpickler that runs no code: a
    crafted checkpoint (whose manifest agrees with its files) is refused here, before any rank starts.
    ``share=(rank, n)``: the checksums of every n-th file from ``rank`` on (the ranks split the reading)."""
    d = manifest.path
    for i, (rel, info) in enumerate(sorted(manifest.files.items())):
        p = d / rel
        if not p.is_file():
            raise ConfigError(f"checkpoint {d}: file {rel} listed in the manifest is missing")
        if p.stat().st_size != info["bytes"]:
            raise ConfigError(f"checkpoint {d}: file {rel} has {p.stat().st_size} bytes, manifest says "
                              f"{info['bytes']} (truncated or overwritten)")
        if checksums and i % share[1] == share[0] and sha256_file(p) != info["sha256"]:
            raise ConfigError(f"checkpoint {d}: file {rel} fails its sha256 check (corrupt)")
    # torch's DCP classes load here, not at import: a bad config must fail before torch loads (~1 s)
    from mpformer.checkpoint.safe_metadata import METADATA, read_checkpoint_metadata

    if (d / METADATA).is_file():
        read_checkpoint_metadata(d)


def check_model_matches(manifest: Manifest, model: ModelConfig) -> None:
    """A checkpoint of another model shape fails with the first differing field named."""
    saved = ModelConfig.from_dict(manifest.model).shape_signature()
    want = model.shape_signature()
    diff = [k for k in want if saved.get(k) != want.get(k)]
    if diff:
        details = ", ".join(f"{k}: checkpoint {saved.get(k)} vs config {want.get(k)}" for k in diff)
        raise ConfigError(f"checkpoint {manifest.path} holds another model shape ({details}); use the "
                          f"model config it was saved with or another checkpoint")


def step_dirs(save_dir: Path) -> list[Path]:
    """The committed step directories of a save_dir, newest first (``*.tmp`` writes in progress excluded)."""
    if not save_dir.is_dir():
        return []
    found = [p for p in save_dir.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def newest_complete(save_dir: Path, below: int | None = None) -> tuple[Manifest | None, list[str]]:
    """The newest checkpoint in ``save_dir`` (of a step below ``below``, if given) whose manifest reads and
    whose files are all there with their sizes, and a line for each newer one passed over (why).
    Checksums are the loader's (io.verify_checksums)."""
    passed: list[str] = []
    for d in step_dirs(save_dir):
        if below is not None and int(d.name[5:]) >= below:
            continue
        try:
            manifest = read_manifest(d)
            check_files(manifest)
        except ConfigError as e:
            passed.append(str(e))
            continue
        return manifest, passed
    return None, passed
