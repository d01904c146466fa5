"""Read a DCP checkpoint's ``.metadata`` without running code from it.

torch.distributed.checkpoint writes ``.metadata`` with plain pickle, and its FileSystemReader reads
it back with ``pickle.load``. A pickle may name any importable callable and call it, so a crafted
checkpoint (downloaded, shared, copied from a scratch disk) runs arbitrary code the moment DCP opens
it, before a single tensor is read. The tensor files and the rank files are already safe: they are
read with ``torch.load(weights_only=True)``. :class:`SafeReader` is DCP's FileSystemReader with its
``read_metadata`` through :class:`MetadataUnpickler`, whose ``find_class`` admits exactly the globals
that DCP's metadata holds. They were found by listing every global that real ``.metadata`` files
reference (``pickletools.genops``, and a ``find_class`` that logs), over mpformer's own saves, the
converter's default-planner save, and raw ``dcp.save`` calls with nested state, bytes and objects,
in every dtype (tests/unit/test_safe_metadata.py checks the list against fresh saves):

    torch.distributed.checkpoint.metadata    Metadata, StorageMeta, TensorStorageMetadata,
                                             BytesStorageMetadata, ChunkStorageMetadata,
                                             TensorProperties, MetadataIndex, _MEM_FORMAT_ENCODING
    torch.distributed.checkpoint.filesystem  _StorageInfo
    torch.Size
    torch.<dtype>                            a dtype pickles as the global ``torch.float32``; only
                                             names whose value is a torch.dtype are admitted
    torch.serialization._get_layout          a layout pickles as this call with the layout's name;
                                             answered by our own lookup over torch's layouts
    pathlib.PosixPath                        StorageMeta.checkpoint_id (DCP keeps the path as a Path)

Nothing else is needed. Dataclasses pickle as NEWOBJ and BUILD, and containers and scalars as
opcodes, so no builtins are needed. torch.memory_format never appears, because TensorProperties
pickles it as the _MEM_FORMAT_ENCODING enum. Any other global fails as a ConfigError that names it,
before anything is called. A truncated or garbled file, or one holding something other than
checkpoint metadata, fails as a ConfigError that names the file.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import PosixPath, PurePath
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from mpformer.core.errors import ConfigError

METADATA = ".metadata"  # DCP's index file in a checkpoint directory (filesystem._metadata_fn)


def _layout(name: object) -> torch.layout:
    """What ``torch.serialization._get_layout(name)`` returns, for the name of one of torch's layouts."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return layouts[name]


ALLOWED: dict[tuple[str, str], type | Callable[..., Any]] = {
    **{("torch.distributed.checkpoint.metadata", c.__name__): c
       for c in (Metadata, StorageMeta, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                 TensorProperties, MetadataIndex, _MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): PosixPath,
}
"""(module, name) -> the object a metadata pickle gets for it; torch dtypes are admitted beside these."""


def _shown(text: str) -> str:
    """``text`` as it can stand in a one-line message (a crafted name may hold anything)."""
    return text if text.isprintable() and len(text) <= 200 else ascii(text[:200])


def _one_line(e: BaseException) -> str:
    return _shown(" ".join(f"{type(e).__name__}: {e}".split()))


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of DCP metadata (:data:`ALLOWED`, torch dtypes).

    Pickle looks up every global (GLOBAL, STACK_GLOBAL and the copyreg extension codes) through
    ``find_class``, and the base class already refuses persistent ids, so nothing else is reachable.
    """

    def __init__(self, file: IO[bytes], ckpt_dir: object, filename: str = METADATA) -> None:
        super().__init__(file)
        self.ckpt_dir, self.filename = ckpt_dir, filename

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(dtype := vars(torch).get(name), torch.dtype):
            return dtype
        raise ConfigError(f"checkpoint {self.ckpt_dir}: {self.filename} names {_shown(f'{module}.{name}')}, which is "
                          f"not a checkpoint metadata type; refusing to load it (it could run code)")


def _check_storage_paths(md: Metadata) -> None:
    """Every data file the index names lies inside the checkpoint directory, under a plain name."""
    if not isinstance(md.storage_data, dict):
        raise ValueError(f"its storage_data is a {type(md.storage_data).__name__}, not a dict")
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or PurePath(rel).is_absolute() or ".." in PurePath(rel).parts:
            raise ValueError(f"it names a data file outside the checkpoint: {rel!r}")


def load_metadata(stream: IO[bytes], ckpt_dir: object, filename: str = METADATA) -> Metadata:
    """The Metadata pickled in ``stream`` (a checkpoint's ``filename``), with no code run from it."""
    try:
        md = MetadataUnpickler(stream, ckpt_dir, filename).load()
        if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
            raise ValueError(f"it holds a {type(md).__name__}, not a {Metadata.__name__}")
        if not isinstance(md.storage_meta, StorageMeta | None):
            raise ValueError(f"its storage_meta is a {type(md.storage_meta).__name__}")
        _check_storage_paths(md)
    except ConfigError:
        raise
    except Exception as e:  # a garbled pickle can fail in any of a dozen ways; all mean the same here
        raise ConfigError(f"checkpoint {ckpt_dir}: {filename} is truncated or garbled ({_one_line(e)}); it is not "
                          f"a readable torch.distributed.checkpoint index") from None
    return md


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, reading ``.metadata`` through :class:`MetadataUnpickler`.

    Everything else is inherited: set_up_storage_reader takes ``storage_data`` from the metadata,
    and read_data loads tensors with ``torch.load(weights_only=True)``. dcp.load wraps whatever
    read_metadata raises in a CheckpointException (after trying the rank-local ``__<rank>.metadata``,
    through this reader too), so the first refusal is kept in ``refusal`` for the caller to raise.
    """

    def __init__(self, path: str | PurePath, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.refusal: ConfigError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            return self._read_metadata(kwargs.get("rank"))
        except ConfigError as e:
            self.refusal = self.refusal or e
            raise

    def _read_metadata(self, rank: int | None) -> Metadata:
        # As FileSystemReader.read_metadata (torch 2.13) does it, with our unpickler in place of pickle.load.
        path = self._get_metadata_path(rank)
        filename = PurePath(path).name
        if not self.fs.exists(path):
            raise ConfigError(f"checkpoint {self.path}: {filename} is missing; it is not a complete "
                              f"torch.distributed.checkpoint directory")
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = load_metadata(metadata_file, self.path, filename)

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id

        return metadata


def read_checkpoint_metadata(ckpt_dir: str | PurePath) -> Metadata:
    """The DCP index of a checkpoint directory, read safely."""
    return SafeReader(str(ckpt_dir)).read_metadata()
