"""Memory-mapped indexed token dataset, byte-compatible with Megatron-LM's ``MMIDIDX`` format.

A dataset is a pair of files sharing a prefix ``P``:

``P.bin``  the token ids of every sequence, concatenated, in one dtype, no header.
``P.idx``  a little-endian header followed by three arrays::

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          <Q        1
    dtype code       <B        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence_count   <Q        S
    document_count   <Q        D + 1  (length of document_indices below)
    sequence_lengths int32[S]  tokens per sequence
    sequence_ptrs    int64[S]  byte offset of each sequence in P.bin
    document_indices int64[D+1] 0, ..., S: document d is sequences [di[d], di[d+1])

mpformer writes one sequence per document, so document_indices is 0..S; files with several
sequences per document (Megatron's --split-sentences) read fine, since training only uses the
concatenated token stream.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import numpy.typing as npt

from mpformer.core.errors import ConfigError, format_choices

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's DType codes; the numbers are part of the file format.
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


def best_dtype(vocab_size: int) -> type[np.generic]:
    """Smallest token dtype for a vocabulary: uint16 below 65536 ids, else int32 (as Megatron)."""
    if vocab_size <= 0:
        raise ConfigError(f"vocab_size must be positive, got {vocab_size}")
    return np.uint16 if vocab_size < 65536 else np.int32


def data_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """The (.bin, .idx) paths of a dataset prefix."""
    p = os.fspath(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


class IndexedDatasetBuilder:
    """Streams documents into ``prefix.bin``/``prefix.idx``.

    Both files are written under temporary names; ``finalize`` renames the .bin first and the .idx
    last (after removing any old .idx), so a crash leaves either the previous pair, or a pair
    without .idx, never a fresh-looking .idx beside a half-written .bin. Use as a context manager
    to remove the temporary files when an exception escapes before ``finalize``.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: npt.DTypeLike) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            names = format_choices(np.dtype(t).name for t in DTYPE_CODES.values())
            raise ConfigError(f"unsupported token dtype {self.dtype.name}; use one of {names}")
        self.bin_path, self.idx_path = data_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + tag)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + tag)
        self._bin = open(self._bin_tmp, "wb")  # closed in finalize() or abort()
        self._lengths: list[np.ndarray] = []
        self._num_tokens = 0
        self._finalized = False
        info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._lo, self._hi = (info.min, info.max) if info is not None else (None, None)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._finalized:
            self.abort()

    @property
    def num_documents(self) -> int:
        return sum(len(x) for x in self._lengths)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add_document(self, tokens: npt.ArrayLike) -> None:
        """Append one document (a 1-D sequence of token ids)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ConfigError(f"a document must be a 1-D token sequence, got shape {arr.shape}")
        self.add_documents(arr, np.array([arr.size], dtype=np.int64))

    def add_documents(self, tokens: npt.ArrayLike, lengths: npt.ArrayLike) -> None:
        """Append several documents at once: ``tokens`` is their concatenation, ``lengths`` their sizes."""
        if self._finalized:
            raise RuntimeError("IndexedDatasetBuilder: add after finalize")
        arr = np.asarray(tokens)
        lens = np.asarray(lengths, dtype=np.int64)
        if arr.ndim != 1 or lens.ndim != 1 or int(lens.sum()) != arr.size or (lens < 0).any():
            raise ConfigError(f"document lengths (sum {int(lens.sum())}) do not match {arr.size} tokens")
        if (lens > np.iinfo(np.int32).max).any():
            raise ConfigError(f"a document has more than {np.iinfo(np.int32).max} tokens (int32 lengths)")
        if arr.size and self._lo is not None and (arr.min() < self._lo or arr.max() > self._hi):
            raise ConfigError(
                f"token ids span [{arr.min()}, {arr.max()}], outside {self.dtype.name} range "
                f"[{self._lo}, {self._hi}]; build with a wider dtype (best_dtype(vocab_size))"
            )
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(lens.astype(np.int32))
        self._num_tokens += arr.size

    def finalize(self) -> None:
        """Write the index and publish both files atomically (see the class docstring)."""
        if self._finalized:
            raise RuntimeError("IndexedDatasetBuilder: finalize called twice")
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        count = lengths.size
        pointers = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        doc_idx = np.arange(count + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], count, doc_idx.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        self.idx_path.unlink(missing_ok=True)  # an old .idx must not pair with the new .bin
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        self._finalized = True

    def abort(self) -> None:
        """Drop the temporary files; the previous pair at this prefix, if any, is untouched."""
        if not self._bin.closed:
            self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._idx_tmp.unlink(missing_ok=True)
        self._finalized = True


class _Index:
    """The parsed, validated .idx file: arrays are zero-copy views of a memory map."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        bin_path, idx_path = data_paths(prefix)
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise ConfigError(f"dataset file {path} does not exist (data prefix {os.fspath(prefix)})")
        idx_size = idx_path.stat().st_size
        if idx_size < _HEADER.size:
            raise ConfigError(
                f"index {idx_path} is truncated/corrupt: {idx_size} bytes, shorter than the {_HEADER.size}-byte header"
            )
        with open(idx_path, "rb") as f:
            magic, version, code, count, doc_count = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise ConfigError(f"{idx_path} is not a Megatron indexed dataset index (magic {magic!r}, want {MAGIC!r})")
        if version != VERSION:
            raise ConfigError(f"{idx_path} has index version {version}; supported: {VERSION}")
        if code not in DTYPE_CODES:
            raise ConfigError(f"{idx_path} has dtype code {code}; valid codes: {format_choices(DTYPE_CODES)}")
        expected = _HEADER.size + 4 * count + 8 * count + 8 * doc_count
        if idx_size != expected:
            raise ConfigError(
                f"index {idx_path} is truncated/corrupt: header implies {expected} bytes "
                f"({count} sequences, {doc_count} document indices) but the file has {idx_size}"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.sizes = np.frombuffer(raw, dtype="<i4", count=count, offset=off)
        off += 4 * count
        self.pointers = np.frombuffer(raw, dtype="<i8", count=count, offset=off)
        off += 8 * count
        self.document_indices = np.frombuffer(raw, dtype="<i8", count=doc_count, offset=off)
        if doc_count < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise ConfigError(f"index {idx_path} is corrupt: document indices must run from 0 to {count} sequences")
        self.num_tokens = int(self.sizes.sum(dtype=np.int64))
        bin_size = bin_path.stat().st_size
        want_bin = self.num_tokens * self.dtype.itemsize
        if bin_size != want_bin:
            raise ConfigError(
                f"data file {bin_path} has {bin_size} bytes but its index lists {self.num_tokens} "
                f"{self.dtype.name} tokens = {want_bin} bytes; the pair is truncated or mismatched"
            )
        # O(1) spot check of the pointers; a full check would read the whole index.
        if count and (
            int(self.pointers[0]) != 0
            or int(self.pointers[-1]) != (self.num_tokens - int(self.sizes[-1])) * self.dtype.itemsize
        ):
            raise ConfigError(f"index {idx_path} is corrupt: sequence pointers disagree with lengths")
        self.bin_path = bin_path


def check_data_prefix(prefix: str | os.PathLike) -> None:
    """Validate a dataset prefix (files, header, sizes) without mapping the token data.

    Raises ConfigError with one line naming the path and the problem.
    """
    _Index(_checked_prefix(prefix))


def _checked_prefix(prefix: str | os.PathLike) -> str:
    p = os.fspath(prefix)
    for ext in (".bin", ".idx"):
        if p.endswith(ext):
            raise ConfigError(f"data path {p!r} should be a prefix without {ext}: use {p[: -len(ext)]!r}")
    return p


class IndexedDataset:
    """Read-only view of a ``prefix.bin``/``prefix.idx`` pair through ``np.memmap``.

    ``len(ds)`` is the number of sequences (one per document in files mpformer writes);
    ``ds.tokens`` is the whole token stream, 1-D, without copying.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = _checked_prefix(prefix)
        self._index = _Index(self.prefix)
        self.dtype = self._index.dtype
        if self._index.num_tokens:
            self.tokens: np.ndarray = np.memmap(self._index.bin_path, dtype=self.dtype, mode="r")
        else:  # np.memmap cannot map an empty file
            self.tokens = np.zeros(0, dtype=self.dtype)

    def __getstate__(self) -> dict:
        # Pickle (DataLoader workers, spawn) by prefix: re-map the files, never copy the tokens.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        return int(self._index.sizes.size)

    @property
    def num_tokens(self) -> int:
        return self._index.num_tokens

    @property
    def sizes(self) -> np.ndarray:
        """int32[len(self)]: tokens per sequence."""
        return self._index.sizes

    @property
    def document_indices(self) -> np.ndarray:
        return self._index.document_indices

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``doc`` (to its end when length is None)."""
        n = len(self)
        if not -n <= doc < n:
            raise IndexError(f"document {doc} out of range for {n} documents")
        doc %= n
        size = int(self._index.sizes[doc])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) outside document {doc} of {size} tokens")
        start = int(self._index.pointers[doc]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def __getitem__(self, doc: int) -> np.ndarray:
        return self.get(doc)
