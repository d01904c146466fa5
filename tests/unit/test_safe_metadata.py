"""Checkpoint metadata is read without running code: DCP's ``.metadata`` is a pickle, and a crafted
one must be refused (naming the global it asked for) before anything in it is called."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import pickletools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

import mpformer.checkpoint.io as ckpt_io
import mpformer.checkpoint.saving as ckpt_save
from mpformer.checkpoint.checkpointer import Checkpointer, CheckpointPart
from mpformer.checkpoint.manifest import MANIFEST, check_files, read_manifest
from mpformer.checkpoint.safe_metadata import ALLOWED, METADATA, MetadataUnpickler, read_checkpoint_metadata
from mpformer.core.errors import ConfigError
from mpformer.core.model_config import ModelConfig
from mpformer.core.shards import Shard
from mpformer.models import Transformer
from mpformer.optim.engine import GradEngine, Reduction
from mpformer.parallel.comm import Comm, CommLedger

CFG = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                  ffn_hidden_size=64, vocab_size=50)
REFUSED = "which is not a checkpoint metadata type; refusing to load it (it could run code)"


@pytest.fixture(autouse=True)
def _no_plain_pickle(monkeypatch):
    """torch's own read_metadata is plain pickle.load: nothing in mpformer may reach it."""
    def plain(*a, **k):
        raise AssertionError("FileSystemReader.read_metadata (plain pickle) was called")

    monkeypatch.setattr(FileSystemReader, "read_metadata", plain)


def _engine(seed: int) -> GradEngine:
    model = Transformer(CFG, seed=seed)
    return GradEngine(model, Reduction(Comm(None, CommLedger(), "dp.")), stage=0,
                      groups=[{"params": list(model.parameters())}],
                      make_optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2))


def _trained_engine() -> GradEngine:
    e = _engine(3)
    t = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    e.model(t[:, :-1], t[:, 1:]).backward()
    e.finish()
    e.step()
    return e


def _checkpointer(save_dir: Path, engine: GradEngine) -> Checkpointer:
    """The trainer's model part: engine.tensors to save, engine.load (-> io.load_tensors) to restore."""
    return Checkpointer(save_dir, [CheckpointPart("model", tensors=engine.tensors,
                                        load_tensors=lambda d, m: engine.load(d, optimizer=True))],
                        rank=0, extra=lambda: {"model": CFG.to_dict(), "has_optimizer": True})


@pytest.fixture
def saved(tmp_path) -> tuple[GradEngine, Path]:
    engine = _trained_engine()
    return engine, _checkpointer(tmp_path / "ckpt", engine).save(2)


def _globals(data: bytes) -> set[tuple[str, str]]:
    """Every global a pickle stream names, from its opcodes (GLOBAL, STACK_GLOBAL)."""
    out, pushed, memo = set(), [], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("PROTO", "FRAME"):
            continue
        if op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1]
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        elif op.name == "GLOBAL":
            out.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            out.add((pushed[-2], pushed[-1]))
        else:
            assert op.name not in ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"), op.name
            pushed.append(arg if isinstance(arg, str) else None)
    return out


def _resolved(data: bytes) -> set[tuple[str, str]]:
    """Every global an unrestricted unpickler looks up for ``data`` (the cross-check of _globals)."""
    seen: set[tuple[str, str]] = set()

    class Logging(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Logging(io.BytesIO(data)).load()
    return seen


def test_the_allow_list_is_exactly_what_dcp_metadata_names(saved, tmp_path):
    _, step = saved
    dtypes = (torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool)
    other = ckpt_save.save_checkpoint(tmp_path / "dtypes", 1, {f"model.x{i}": Shard.full(torch.ones(3, 2, dtype=dt))
                                                           for i, dt in enumerate(dtypes)}, {"model": CFG.to_dict()})
    raw = tmp_path / "raw"  # DCP's default planner with nested state, bytes and objects (the converter's save)
    dcp.save({"sd": Transformer(CFG).state_dict(), "n": 3, "blob": io.BytesIO(b"abc"), "obj": {"lr": 0.1}},
             checkpoint_id=raw, no_dist=True)
    names: set[tuple[str, str]] = set()
    for d in (step, other, raw):
        data = (d / METADATA).read_bytes()
        assert _globals(data) == _resolved(data)
        names |= _globals(data)
    seen_dtypes = {n for n in names if n[0] == "torch" and isinstance(vars(torch).get(n[1]), torch.dtype)}
    assert {getattr(torch, n) for _, n in seen_dtypes} == {torch.float32, *dtypes}
    assert names - seen_dtypes == set(ALLOWED), "every entry is needed, and nothing else is"


@pytest.mark.parametrize("module,name", [
    ("builtins", "eval"), ("builtins", "exec"), ("builtins", "getattr"), ("builtins", "__import__"),
    ("posix", "system"), ("os", "system"), ("subprocess", "Popen"), ("torch", "load"), ("torch", "ops"),
    ("torch.serialization", "load"), ("torch", "memory_format"), ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.metadata", "os"), ("pathlib", "Path.touch"),
])
def test_nothing_broad_is_admitted(module, name):
    with pytest.raises(ConfigError, match=f"names {module}.{name}, which"):
        MetadataUnpickler(io.BytesIO(b""), "ck").find_class(module, name)


def test_a_checkpoint_loads_through_the_safe_reader(saved, tmp_path):
    engine, step = saved
    manifest = read_manifest(step.parent)
    check_files(manifest, checksums=True)  # what preflight does
    fresh = _engine(9)
    _checkpointer(tmp_path / "unused", fresh).load(manifest)  # what the trainer does
    assert fresh.steps_taken == engine.steps_taken == 1
    for (name, p), q in zip(engine.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(p, q), name
    for a, b in zip(engine.shards, fresh.shards):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(engine.optimizer.state[a.master][key], fresh.optimizer.state[b.master][key])
    m = Transformer(CFG, seed=5)
    ckpt_io.load_checkpoint(step, m)
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), m.parameters()))
    weights = ckpt_io.read_all_tensors(step)
    q = "layers.0.attn.q.weight"
    assert torch.equal(weights[q], engine.model.canonical_shards()[q].local)
    assert ckpt_io.stored_metadata(step)["optim.step"] == ((1,), torch.float32)
    assert read_checkpoint_metadata(step).storage_meta.load_id  # as torch's reader sets it


class _Run:
    """A pickle that calls ``fn(*args)`` when loaded."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _craft(step: Path, payload: object) -> None:
    """Replace the checkpoint's .metadata with the real one carrying ``payload``, and make the
    manifest agree with it (sizes and checksums), as a crafted checkpoint would."""
    md = pickle.loads((step / METADATA).read_bytes())  # our own file, written just now
    md.planner_data = payload
    data = pickle.dumps(md)
    (step / METADATA).write_bytes(data)
    _rehash(step, data)


def _rehash(step: Path, data: bytes) -> None:
    m = json.loads((step / MANIFEST).read_text())
    m["files"][METADATA] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (step / MANIFEST).write_text(json.dumps(m))


PAYLOADS = {
    "posix.system": lambda marker: _Run(os.system, f"touch {marker}"),
    "builtins.exec": lambda marker: _Run(exec, f"open({str(marker)!r}, 'w').close()"),
    "pathlib.Path.touch": lambda marker: _Run(Path.touch, marker),
}


@pytest.mark.parametrize("refused", list(PAYLOADS))
def test_a_crafted_metadata_is_refused_before_it_runs(saved, tmp_path, monkeypatch, refused):
    _, step = saved
    marker = tmp_path / "pwned"
    checked = ckpt_io.stored_metadata(step)  # what the shape check saw before the file was swapped
    _craft(step, PAYLOADS[refused](marker))
    assert refused in {f"{m}.{n}" for m, n in _globals((step / METADATA).read_bytes())}
    model = Transformer(CFG, seed=5)
    before = [p.detach().clone() for p in model.parameters()]
    attempts = {
        "stored_metadata": lambda: ckpt_io.stored_metadata(step),
        "load_tensors": lambda: ckpt_io.load_tensors(step, ckpt_io.model_state(model)),
        "read_all_tensors": lambda: ckpt_io.read_all_tensors(step),
        "load_checkpoint": lambda: ckpt_io.load_checkpoint(step.parent, model),
        "preflight": lambda: check_files(read_manifest(step.parent), checksums=True),
        "trainer": lambda: _checkpointer(tmp_path / "unused", _engine(9)).load(read_manifest(step.parent)),
        "dcp.load after the check": lambda: (monkeypatch.setattr(ckpt_io, "stored_metadata", lambda d: checked),
                                             ckpt_io.load_tensors(step, ckpt_io.model_state(model))),
    }
    for where, attempt in attempts.items():  # the last one reaches dcp.load itself, which reads .metadata again
        with pytest.raises(ConfigError) as e:
            attempt()
        msg = str(e.value)
        assert msg == f"checkpoint {step}: {METADATA} names {refused}, {REFUSED}", where
        assert not marker.exists(), f"{where}: the crafted pickle ran"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # The test can fail: a plain unpickler runs the payload.
    pickle.loads((step / METADATA).read_bytes())
    assert marker.exists()


@pytest.mark.parametrize("garble", ["truncated", "noise", "empty", "a dict", "outside"])
def test_a_garbled_metadata_is_one_line_naming_the_file(saved, garble):
    _, step = saved
    good = (step / METADATA).read_bytes()
    md = pickle.loads(good)  # a well-formed index whose data file lies outside the checkpoint
    next(iter(md.storage_data.values())).relative_path = "../../etc/passwd"
    data = {"truncated": good[: len(good) // 2], "noise": bytes(range(256)) * 4, "empty": b"",
            "a dict": pickle.dumps({"state_dict_metadata": {}}), "outside": pickle.dumps(md)}[garble]
    (step / METADATA).write_bytes(data)
    for attempt in (lambda: ckpt_io.stored_metadata(step), lambda: ckpt_io.read_all_tensors(step),
                    lambda: ckpt_io.load_tensors(step, ckpt_io.model_state(Transformer(CFG)))):
        with pytest.raises(ConfigError) as e:
            attempt()
        msg = str(e.value)
        assert msg.startswith(f"checkpoint {step}: {METADATA} is truncated or garbled (") and "\n" not in msg, msg
    _rehash(step, data)  # even when the manifest agrees with it, preflight says the same
    with pytest.raises(ConfigError, match="is truncated or garbled") as e:
        check_files(read_manifest(step.parent), checksums=True)
    assert "\n" not in str(e.value)


def test_a_missing_metadata_is_a_config_error(saved):
    _, step = saved
    (step / METADATA).unlink()
    with pytest.raises(ConfigError, match=f"checkpoint {step}: {METADATA} is missing"):
        ckpt_io.stored_metadata(step)
