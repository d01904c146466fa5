"""Text files -> tokenized indexed dataset (``P.bin`` + ``P.idx``).

Inputs are read with the ``datasets`` library (its json and text builders), tokenized in parallel
with ``Dataset.map(num_proc=workers)``, and written in input order, so the output bytes do not
depend on the number of workers: ``map`` splits a dataset into contiguous shards and concatenates
them back in order. The ``datasets`` cache lives in a temporary folder beside the output and is
deleted at the end; nothing is written under ``~/.cache``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpformer.core.errors import ConfigError, format_choices
from mpformer.data.indexed import IndexedDatasetBuilder, best_dtype
from mpformer.data.tokenizer import eos_id, load_tokenizer

TXT_SPLITS = ("document", "line", "paragraph")
# extension -> datasets builder; .json is read as JSON lines too, like Megatron's loose json inputs.
INPUT_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text"}
TEXT_COLUMN = "text"  # the column name of the datasets "text" builder


@dataclass(frozen=True)
class PreprocessResult:
    output_prefix: str
    documents: int
    tokens: int
    skipped_empty: int
    dtype: str
    seconds: float

    def summary(self) -> str:
        return (
            f"wrote {self.output_prefix}.bin/.idx: {self.documents} documents, {self.tokens} tokens "
            f"({self.dtype}), {self.skipped_empty} empty skipped, {self.seconds:.1f} s"
        )


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def check_inputs(inputs: Sequence[str | os.PathLike]) -> list[tuple[str, Path]]:
    """[(builder, path)] for each input; ConfigError for a missing file or an unknown extension."""
    if not inputs:
        raise ConfigError("no input files; pass --input FILE (.txt or .jsonl), repeatable")
    checked = []
    for item in inputs:
        path = Path(item)
        builder = INPUT_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(
                f"input {path} has unknown extension {path.suffix!r}; supported: {format_choices(INPUT_BUILDERS)}"
            )
        if not path.is_file():
            raise ConfigError(f"input file {path} does not exist")
        checked.append((builder, path))
    return checked


def _tokenize_batch(batch: dict, *, tokenizer, column: str, eos: int | None) -> dict:
    """Map function (runs in worker processes): texts -> token ids, EOS after each non-empty doc."""
    texts = [t if t is not None else "" for t in batch[column]]
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # _fast: no offsets
    ids = [e.ids for e in encode(texts, add_special_tokens=False)]
    if eos is not None:
        ids = [[*x, eos] if x else x for x in ids]
    return {"input_ids": ids}


@contextlib.contextmanager
def _no_tokenizer_threads(active: bool) -> Iterator[None]:
    """With worker processes, the processes are the parallelism: Rust tokenizer threads inside
    forked workers would oversubscribe the cores and can deadlock after fork."""
    key = "TOKENIZERS_PARALLELISM"
    old = os.environ.get(key)
    if active:
        os.environ[key] = "false"
    try:
        yield
    finally:
        if active:
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _load_group(builder: str, files: list[Path], *, json_key: str, txt_split: str, cache_dir: str):
    """One ``datasets.Dataset`` for consecutive inputs of the same kind, and its text column."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    kwargs = {"sample_by": txt_split} if builder == "text" else {}
    verbosity = datasets.logging.get_verbosity()
    # datasets logs a parse failure before raising it; we report it ourselves, in one line.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        ds = datasets.load_dataset(
            builder, data_files=[str(f) for f in files], split="train", cache_dir=cache_dir, **kwargs
        )
    except (DatasetGenerationError, OSError, ValueError, StopIteration) as e:
        names = ", ".join(str(f) for f in files)
        if all(f.stat().st_size == 0 for f in files) or type(e.__cause__ or e).__name__ == "SchemaInferenceError":
            raise ConfigError(f"{names}: no documents in the input (an empty file); give a file with text") from None
        cause = e.__cause__ or e
        first = (str(cause).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"cannot read {names} as {builder}: {type(cause).__name__}: {first}") from e
    finally:
        datasets.logging.set_verbosity(verbosity)
    column = json_key if builder == "json" else TEXT_COLUMN
    if column not in ds.column_names:
        names = ", ".join(str(f) for f in files)
        raise ConfigError(
            f"json key {column!r} not found in {names}; keys present: {format_choices(ds.column_names)} "
            f"(choose one with --json-key)"
        )
    feature = ds.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ConfigError(f"json key {column!r} in {files[0]} holds {feature}, not text; choose a text field")
    return ds, column


def _group_consecutive(checked: list[tuple[str, Path]]) -> list[tuple[str, list[Path]]]:
    groups: list[tuple[str, list[Path]]] = []
    for builder, path in checked:
        if groups and groups[-1][0] == builder:
            groups[-1][1].append(path)
        else:
            groups.append((builder, [path]))
    return groups


def preprocess(
    inputs: Sequence[str | os.PathLike],
    tokenizer_dir: str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    json_key: str = "text",
    txt_split: str = "document",
    workers: int = 1,
    append_eos: bool = True,
) -> PreprocessResult:
    """Tokenize ``inputs`` (.txt / .jsonl, in the given order) into ``output_prefix.{bin,idx}``.

    .txt: one document per file (``txt_split="document"``), per line or per blank-line paragraph.
    .jsonl: one document per line, its ``json_key`` field. Documents with no tokens are skipped;
    the others get the tokenizer's EOS appended unless ``append_eos`` is False.
    """
    t0 = time.perf_counter()
    if txt_split not in TXT_SPLITS:
        raise ConfigError(f"--txt-split {txt_split!r} is not valid; choose one of {format_choices(TXT_SPLITS)}")
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    checked = check_inputs(inputs)
    tok = load_tokenizer(tokenizer_dir)
    eos = eos_id(tok) if append_eos else None
    dtype = best_dtype(len(tok))
    prefix = os.fspath(output_prefix)
    out_dir = Path(prefix).resolve().parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create output folder {out_dir}: {e.strerror}") from e
    skipped = 0
    with (
        tempfile.TemporaryDirectory(prefix=".mpformer-preprocess-", dir=out_dir) as cache_dir,
        IndexedDatasetBuilder(prefix, dtype) as builder,
    ):
        for g, (kind, files) in enumerate(_group_consecutive(checked)):
            ds, column = _load_group(kind, files, json_key=json_key, txt_split=txt_split, cache_dir=cache_dir)
            num_proc = min(workers, len(ds))
            with _no_tokenizer_threads(num_proc > 1):
                mapped = ds.map(
                    _tokenize_batch,
                    batched=True,
                    remove_columns=ds.column_names,
                    fn_kwargs={"tokenizer": tok.backend_tokenizer, "column": column, "eos": eos},
                    num_proc=num_proc if num_proc > 1 else None,
                    new_fingerprint=f"mpformer-tokenize-{g}",  # skips hashing the tokenizer; cache is private
                    desc="tokenizing",
                )
            skipped += _write(mapped, builder)
            del ds, mapped  # release the memory maps before the cache folder goes
        if builder.num_documents == 0:
            raise ConfigError(f"no non-empty documents in {format_choices(str(p) for _, p in checked)}")
        builder.finalize()
        documents, tokens = builder.num_documents, builder.num_tokens
    return PreprocessResult(prefix, documents, tokens, skipped, np.dtype(dtype).name, time.perf_counter() - t0)


def _write(mapped, builder: IndexedDatasetBuilder) -> int:
    """Append the tokenized documents in order; returns how many were empty (and skipped)."""
    import pyarrow.compute as pc

    skipped = 0
    for table in mapped.with_format("arrow").iter(batch_size=10_000):
        column = table.column("input_ids").combine_chunks()
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = column.flatten().to_numpy(zero_copy_only=False)
        nonempty = lengths > 0
        skipped += int((~nonempty).sum())
        builder.add_documents(flat, lengths[nonempty])
    return skipped
