"""Tokenizer training and the preprocessing CLI, end to end on a few KB of text."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpformer.cli.preprocess import main
from mpformer.core.errors import ConfigError
from mpformer.data.demo_corpus import build_stdlib_corpus, stdlib_sources
from mpformer.data.indexed import IndexedDataset
from mpformer.data.tokenizer import eos_id, load_tokenizer, train_byte_level_bpe

REPO = Path(__file__).resolve().parents[2]

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "Héllo wörld — unicode, tabs\tand  double spaces. 🎉\n\nSecond paragraph.",
    "",  # empty: must be skipped
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "x" * 500,
    "  leading spaces and a trailing newline\n",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    words = "the quick brown fox jumps over the lazy dog def return class self import".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=40)) + "\n" for _ in range(100)] + DOCS  # ~ 25 KB
    return train_byte_level_bpe(texts, tmp_path_factory.mktemp("tok") / "tokenizer", vocab_size=300)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("in") / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(DOCS * 5):
            f.write(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n")
    return path


def _docs_of(prefix) -> list[np.ndarray]:
    ds = IndexedDataset(prefix)
    return [np.asarray(ds.get(i)) for i in range(len(ds))]


def test_trained_tokenizer_loads_with_auto_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert len(tok) == 300
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert eos_id(load_tokenizer(tokenizer_dir)) == tok.eos_token_id == 0
    for text in DOCS:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_jsonl_round_trip(tokenizer_dir, jsonl, tmp_path, capsys):
    prefix = tmp_path / "out" / "corpus"
    assert main(["--input", str(jsonl), "--tokenizer", str(tokenizer_dir), "--output-prefix", str(prefix)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and "25 documents" in summary[0] and "5 empty skipped" in summary[0]
    tok = load_tokenizer(tokenizer_dir)
    docs = _docs_of(prefix)
    expected = [t for t in DOCS * 5 if t]
    assert len(docs) == len(expected)
    for ids, text in zip(docs, expected, strict=True):
        assert ids[-1] == tok.eos_token_id
        assert tok.decode(ids[:-1].tolist()) == text
    assert IndexedDataset(prefix).dtype == np.uint16
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["corpus.bin", "corpus.idx"]  # cache removed


def test_workers_do_not_change_the_bytes(tokenizer_dir, jsonl, tmp_path):
    outs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        args = ["--input", str(jsonl), "--tokenizer", str(tokenizer_dir), "--output-prefix", str(prefix)]
        assert main([*args, "--workers", str(workers)]) == 0
        outs.append([(tmp_path / f"w{workers}{ext}").read_bytes() for ext in (".bin", ".idx")])
    assert outs[0] == outs[1]


def test_txt_inputs_and_splits(tokenizer_dir, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first line\nsecond line\n\nnew paragraph\n", encoding="utf-8")
    b.write_text(DOCS[1], encoding="utf-8")
    tok = load_tokenizer(tokenizer_dir)
    base = ["--input", str(a), "--input", str(b), "--tokenizer", str(tokenizer_dir)]
    assert main([*base, "--output-prefix", str(tmp_path / "doc")]) == 0
    docs = _docs_of(tmp_path / "doc")
    assert [tok.decode(d[:-1].tolist()) for d in docs] == [a.read_text(), b.read_text()]  # one doc per file
    assert main([*base, "--output-prefix", str(tmp_path / "line"), "--txt-split", "line"]) == 0
    lines = [tok.decode(d[:-1].tolist()) for d in _docs_of(tmp_path / "line")]
    assert lines[:3] == ["first line", "second line", "new paragraph"]  # blank line skipped
    assert main([*base, "--output-prefix", str(tmp_path / "noeos"), "--no-append-eos"]) == 0
    assert [tok.decode(d.tolist()) for d in _docs_of(tmp_path / "noeos")] == [a.read_text(), b.read_text()]


def test_mixed_inputs_keep_the_given_order(tokenizer_dir, jsonl, tmp_path):
    t = tmp_path / "t.txt"
    t.write_text("plain text file", encoding="utf-8")
    args = ["--input", str(t), "--input", str(jsonl), "--input", str(t), "--tokenizer", str(tokenizer_dir)]
    assert main([*args, "--output-prefix", str(tmp_path / "mix")]) == 0
    tok = load_tokenizer(tokenizer_dir)
    texts = [tok.decode(d[:-1].tolist()) for d in _docs_of(tmp_path / "mix")]
    assert texts[0] == texts[-1] == "plain text file" and texts[1] == DOCS[0] and len(texts) == 27


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing_input", "input file .*nope.jsonl does not exist"),
        ("bad_extension", "unknown extension '.csv'; supported: .jsonl, .json, .txt"),
        ("missing_key", "json key 'body' not found in .*keys present: id, text"),
        ("missing_tokenizer", "tokenizer folder .*absent does not exist"),
        ("no_tokenizer_json", "has no tokenizer.json"),
        ("bad_json", "cannot read .*bad.jsonl as json: ArrowInvalid"),
    ],
)
def test_bad_inputs_are_one_line_errors(tokenizer_dir, jsonl, tmp_path, capsys, case, match):
    args = {"input": str(jsonl), "tokenizer": str(tokenizer_dir), "extra": []}
    if case == "missing_input":
        args["input"] = str(tmp_path / "nope.jsonl")
    elif case == "bad_extension":
        (tmp_path / "x.csv").write_text("a,b\n")
        args["input"] = str(tmp_path / "x.csv")
    elif case == "missing_key":
        args["extra"] = ["--json-key", "body"]
    elif case == "missing_tokenizer":
        args["tokenizer"] = str(tmp_path / "absent")
    elif case == "bad_json":
        (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
        args["input"] = str(tmp_path / "bad.jsonl")
    else:
        (tmp_path / "empty_tok").mkdir()
        args["tokenizer"] = str(tmp_path / "empty_tok")
    argv = ["--input", args["input"], "--tokenizer", args["tokenizer"], "--output-prefix", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        main([*argv, *args["extra"]])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert re.search(match, err[0]), err[0]
    assert not (tmp_path / "o.bin").exists() and not (tmp_path / "o.idx").exists()


def test_train_rejects_mixed_sources(tmp_path):
    with pytest.raises(ConfigError, match="only Path objects or only str"):
        train_byte_level_bpe(iter([tmp_path / "a.txt", "text"]), tmp_path / "t", vocab_size=300)


def test_script_exits_2_with_one_error_line(tokenizer_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(tmp_path / "missing.jsonl")]
    cmd += ["--tokenizer", str(tokenizer_dir), "--output-prefix", str(tmp_path / "o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "missing.jsonl" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_stdlib_corpus_is_deterministic_and_skips_tests(tmp_path):
    sources = [p.as_posix() for p in stdlib_sources()]
    assert sources == sorted(sources) and len(sources) > 100
    assert not any(part in ("test", "tests", "idle_test", "site-packages") for s in sources for part in s.split("/"))
    a = build_stdlib_corpus(str(tmp_path / "a.jsonl"), max_bytes=300_000)
    b = build_stdlib_corpus(str(tmp_path / "b.jsonl"), max_bytes=300_000)
    assert a == b and 0 < a["bytes"] <= 300_000 and a["files"] > 3
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(records) == a["files"] and sum(len(r["text"].encode()) for r in records) == a["bytes"]
