"""DCP's file writer, hashing each data file while it writes it.

The manifest lists a sha256 per file. Hashing the files after the save is a second pass over every
byte. In a background save that pass competes with training for the cache and memory bandwidth, so
the digest is taken from the bytes as they go to the file instead. The byte count is compared with
the file's size when the file is closed: a file that was not written as one sequence of ``write``
calls is hashed again from disk, so the manifest never holds a digest of anything but the file.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from mpformer.checkpoint.manifest import sha256_file


class _Tee:
    """A binary file whose writes also go into a hash (every other attribute is the file's)."""

    def __init__(self, f: Any) -> None:
        self._f, self.hash, self.count = f, hashlib.sha256(), 0

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.hash.update(view)
        self.count += view.nbytes
        return self._f.write(b)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class _HashingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[Path, str] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as f:
            if "w" not in mode or not str(path).endswith(".distcp"):
                yield f
                return
            tee = _Tee(f)
            yield tee
        p = Path(path)
        self.digests[p] = tee.hash.hexdigest() if tee.count == p.stat().st_size else sha256_file(p)


class HashingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose ``digests()`` are the sha256 of the data files it wrote. ``background``:
    the thread that writes (DCP's async-save thread) runs at the lowest CPU priority, so that where the
    training ranks fill every core (2 ranks on 2 cores) the writer takes the time they leave idle
    instead of theirs (Linux: a thread's nice value is its own)."""

    def __init__(self, path: str | os.PathLike, *, background: bool = False) -> None:
        super().__init__(path)
        self.fs = _HashingFileSystem()
        self.background = background

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.background and sys.platform.startswith("linux"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass  # a priority is a preference: the save is the same without it
        return super().write_data(plan, planner)

    def digests(self, ckpt_dir: Path) -> dict[str, dict[str, Any]]:
        """relative path -> sha256 and size, as manifest.file_digests gives them."""
        return {str(p.relative_to(ckpt_dir)): {"sha256": h, "bytes": p.stat().st_size}
                for p, h in self.fs.digests.items()}
