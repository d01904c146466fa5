"""A demo corpus that needs no download: the Python standard library's own ``.py`` sources.

    python -m mpformer.data.demo_corpus --out demo_data [--max-bytes 8000000] [--vocab-size 8192]

writes ``DIR/corpus.jsonl`` (one {"text": source} record per file), trains a byte-level BPE
tokenizer into ``DIR/tokenizer`` and preprocesses into ``DIR/stdlib_text_document.{bin,idx}``,
the paths ``configs/data/demo.yaml`` points at. Steps whose outputs exist are skipped, so
re-running is cheap; delete DIR to rebuild. The corpus is deterministic for a given Python
version (sorted file order), not across versions.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from mpformer.core.errors import ArgumentParser, ConfigError, user_errors_to_exit

# Path components that mark test suites (test/, tests/, idlelib/idle_test/) or installed packages.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
CORPUS_NAME = "corpus.jsonl"
TOKENIZER_NAME = "tokenizer"
PREFIX_NAME = "stdlib_text_document"


def stdlib_sources(stdlib_dir: str | os.PathLike | None = None) -> Iterator[Path]:
    """The standard library's ``.py`` files in sorted (relative path) order, tests excluded."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ConfigError(f"Python standard library folder {root} does not exist")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found += [Path(dirpath, f).relative_to(root) for f in filenames if f.endswith(".py")]
    for rel in sorted(found, key=lambda p: p.as_posix()):
        yield root / rel


def build_stdlib_corpus(out_jsonl: str, max_bytes: int = 8_000_000) -> dict:
    """Write the stdlib sources as JSON lines ``{"text": ...}``, stopping before ``max_bytes`` of
    UTF-8 text would be exceeded. Returns counts: files, bytes, skipped_not_utf8, skipped_empty."""
    if max_bytes < 1:
        raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
    out = Path(out_jsonl)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    counts = {"files": 0, "bytes": 0, "skipped_not_utf8": 0, "skipped_empty": 0}
    with open(tmp, "w", encoding="utf-8") as f:
        for path in stdlib_sources():
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                counts["skipped_not_utf8"] += 1
                continue
            if not text.strip():
                counts["skipped_empty"] += 1
                continue
            if counts["bytes"] + len(raw) > max_bytes:
                break
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            counts["files"] += 1
            counts["bytes"] += len(raw)
    os.replace(tmp, out)
    return counts


def _iter_jsonl_texts(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def build_demo(out_dir: str | os.PathLike, *, max_bytes: int = 8_000_000, vocab_size: int = 8192) -> dict:
    """Corpus, tokenizer and indexed dataset under ``out_dir``; returns per-step timings and sizes."""
    from mpformer.data.indexed import check_data_prefix, data_paths
    from mpformer.data.preprocess import default_workers, preprocess
    from mpformer.data.tokenizer import train_byte_level_bpe

    out = Path(out_dir)
    corpus, tok_dir, prefix = out / CORPUS_NAME, out / TOKENIZER_NAME, out / PREFIX_NAME
    report: dict = {}
    t = time.perf_counter()
    if corpus.is_file():
        report["corpus"] = "exists"
    else:
        report["corpus"] = build_stdlib_corpus(str(corpus), max_bytes)
    report["corpus_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if (tok_dir / "tokenizer.json").is_file():
        report["tokenizer"] = "exists"
    else:
        train_byte_level_bpe(_iter_jsonl_texts(corpus), tok_dir, vocab_size=vocab_size)
        report["tokenizer"] = str(tok_dir)
    report["tokenizer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    bin_path, idx_path = data_paths(prefix)
    if bin_path.is_file() and idx_path.is_file():
        check_data_prefix(prefix)  # an existing but broken pair is an error, not a skip
        report["dataset"] = "exists"
    else:
        report["dataset"] = preprocess([corpus], tok_dir, prefix, workers=default_workers()).summary()
    report["dataset_s"] = time.perf_counter() - t
    return report


@user_errors_to_exit
def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m mpformer.data.demo_corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size cap in bytes (default 8e6)")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    args = p.parse_args(argv)
    import datasets

    datasets.disable_progress_bars()  # this is a process of its own; one line per step is enough
    report = build_demo(args.out, max_bytes=args.max_bytes, vocab_size=args.vocab_size)
    for step in ("corpus", "tokenizer", "dataset"):
        print(f"{step}: {report[step]} ({report[step + '_s']:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
