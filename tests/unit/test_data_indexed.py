"""Indexed dataset: Megatron byte layout, round trips, and loud failures on damaged files."""

from __future__ import annotations

import pickle
import re
import struct

import numpy as np
import pytest

from mpformer.core.errors import ConfigError
from mpformer.data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    check_data_prefix,
)


def _write(prefix, docs, dtype) -> None:
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for d in docs:
            b.add_document(d)
        b.finalize()


def _docs(rng, high, n=7):
    return [rng.integers(0, high, size=int(rng.integers(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65536), (np.int32, 200_000)])
def test_round_trip(tmp_path, dtype, high):
    rng = np.random.default_rng(0)
    docs = _docs(rng, high)
    prefix = tmp_path / "rt"
    _write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs)
    assert ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(len(d) for d in docs)
    assert ds.sizes.tolist() == [len(d) for d in docs]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds.get(i), d)
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds.get(3, offset=1, length=2), docs[3][1:3])
    np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))
    assert isinstance(ds.tokens, np.memmap)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rt.bin", "rt.idx"]  # no temp files left


def test_header_matches_megatron_layout(tmp_path):
    docs = [np.array([5, 6, 7]), np.array([1]), np.array([9, 9])]
    _write(tmp_path / "h", docs, np.uint16)
    raw = (tmp_path / "h.idx").read_bytes()
    magic, version, code, seq_count, doc_count = struct.unpack_from("<9sQBQQ", raw, 0)
    assert (magic, version, code, seq_count, doc_count) == (b"MMIDIDX\x00\x00", 1, 8, 3, 4)
    off = 9 + 8 + 1 + 8 + 8
    assert struct.unpack_from("<3i", raw, off) == (3, 1, 2)  # int32 sequence lengths
    off += 3 * 4
    assert struct.unpack_from("<3q", raw, off) == (0, 6, 8)  # int64 byte pointers (uint16: 2 bytes)
    off += 3 * 8
    assert struct.unpack_from("<4q", raw, off) == (0, 1, 2, 3)  # int64 document indices 0..S
    assert len(raw) == off + 4 * 8
    assert (tmp_path / "h.bin").read_bytes() == np.array([5, 6, 7, 1, 9, 9], "<u2").tobytes()


def test_int32_dtype_code(tmp_path):
    _write(tmp_path / "i", [np.array([70_000, 1])], np.int32)
    assert struct.unpack_from("<B", (tmp_path / "i.idx").read_bytes(), 17) == (4,)


def test_best_dtype():
    assert best_dtype(300) is np.uint16
    assert best_dtype(65535) is np.uint16
    assert best_dtype(65536) is np.int32
    assert best_dtype(152_064) is np.int32


@pytest.mark.parametrize("cut", [1, 5, 9])
def test_truncated_idx_is_rejected(tmp_path, cut):
    _write(tmp_path / "t", _docs(np.random.default_rng(1), 100), np.uint16)
    idx = tmp_path / "t.idx"
    idx.write_bytes(idx.read_bytes()[:-cut])
    with pytest.raises(ConfigError, match=r"truncated/corrupt") as e:
        IndexedDataset(tmp_path / "t")
    assert str(idx) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=re.escape(str(idx))):
        check_data_prefix(tmp_path / "t")


def test_padded_idx_is_rejected(tmp_path):
    _write(tmp_path / "p", [np.arange(10)], np.uint16)
    with open(tmp_path / "p.idx", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(ConfigError, match=r"truncated/corrupt.*but the file has"):
        check_data_prefix(tmp_path / "p")


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_file_names_the_path(tmp_path, missing):
    _write(tmp_path / "m", [np.arange(10)], np.uint16)
    (tmp_path / f"m{missing}").unlink()
    with pytest.raises(ConfigError, match="does not exist") as e:
        IndexedDataset(tmp_path / "m")
    assert str(tmp_path / f"m{missing}") in str(e.value)


@pytest.mark.parametrize("delta", [-2, 2])
def test_bin_of_wrong_size_is_rejected(tmp_path, delta):
    _write(tmp_path / "b", [np.arange(10), np.arange(5)], np.uint16)
    path = tmp_path / "b.bin"
    data = path.read_bytes()
    path.write_bytes(data[:delta] if delta < 0 else data + b"\0" * delta)
    with pytest.raises(ConfigError, match=r"b\.bin has \d+ bytes but its index lists 15 uint16 tokens = 30"):
        check_data_prefix(tmp_path / "b")


def test_bad_magic_and_dtype_code(tmp_path):
    _write(tmp_path / "x", [np.arange(4)], np.uint16)
    idx = tmp_path / "x.idx"
    good = idx.read_bytes()
    idx.write_bytes(b"NOTANIDX\0" + good[9:])
    with pytest.raises(ConfigError, match="not a Megatron indexed dataset"):
        check_data_prefix(tmp_path / "x")
    idx.write_bytes(good[:17] + bytes([99]) + good[18:])
    with pytest.raises(ConfigError, match="dtype code 99"):
        check_data_prefix(tmp_path / "x")


def test_prefix_with_extension_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"prefix without \.bin"):
        check_data_prefix(str(tmp_path / "data.bin"))


def test_token_out_of_dtype_range(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "r", np.uint16) as b, pytest.raises(ConfigError, match="wider dtype"):
        b.add_document([1, 70_000])
    assert list(tmp_path.iterdir()) == []  # the context manager dropped the temp files


def test_failed_rewrite_keeps_previous_pair(tmp_path):
    _write(tmp_path / "k", [np.arange(10)], np.uint16)
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(tmp_path / "k", np.uint16) as b:
        b.add_document(np.arange(3))
        raise RuntimeError("crash before finalize")
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "k").tokens, np.arange(10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.bin", "k.idx"]


def test_empty_dataset_is_readable(tmp_path):
    _write(tmp_path / "e", [], np.uint16)
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.tokens.size == 0


def test_bulk_add_documents_equals_one_by_one(tmp_path):
    docs = _docs(np.random.default_rng(2), 1000)
    _write(tmp_path / "one", docs, np.uint16)
    with IndexedDatasetBuilder(tmp_path / "bulk", np.uint16) as b:
        b.add_documents(np.concatenate(docs), [len(d) for d in docs])
        b.finalize()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"bulk{ext}").read_bytes()


def test_pickles_by_prefix_not_by_content(tmp_path):
    _write(tmp_path / "pk", [np.arange(50_000)], np.int32)
    ds = IndexedDataset(tmp_path / "pk")
    blob = pickle.dumps(ds)
    assert len(blob) < 1000
    np.testing.assert_array_equal(pickle.loads(blob).tokens, ds.tokens)
