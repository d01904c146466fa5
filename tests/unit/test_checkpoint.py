"""Checkpoint directories: atomic saves, the latest pointer, pruning, optimizer state by canonical name."""

from __future__ import annotations

import json

import pytest
import torch

import mpformer.checkpoint.io as ckpt_io
import mpformer.checkpoint.saving as ckpt_save
from mpformer.checkpoint.manifest import check_files, read_manifest
from mpformer.core.errors import ConfigError
from mpformer.core.model_config import ModelConfig
from mpformer.models import Transformer

CFG = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                  ffn_hidden_size=64, vocab_size=50)


def _trained() -> tuple[Transformer, torch.optim.Optimizer]:
    m = Transformer(CFG, seed=3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    t = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        m(t[:, :-1], t[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _save(m, opt, d, step, **kw):
    tensors = {**ckpt_io.model_state(m), **ckpt_io.optimizer_state(m, opt)}
    return ckpt_save.save_checkpoint(d, step, tensors, {"model": CFG.to_dict(), "has_optimizer": True}, **kw)


def test_roundtrip_weights_and_adam_state(tmp_path):
    m, opt = _trained()
    _save(m, opt, tmp_path, 2)
    m2 = Transformer(CFG, seed=9)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    manifest = ckpt_io.load_checkpoint(tmp_path, m2, opt2)
    assert manifest["step"] == 2 and manifest["loaded_optimizer"]
    for (name, p), q in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), (name, key)
    check_files(read_manifest(tmp_path), checksums=True)


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    m, opt = _trained()
    _save(m, opt, tmp_path, 1)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_save, "write_manifest", boom)
    with pytest.raises(ConfigError, match=r"save of step 2 .* failed .disk full.; the previous checkpoint"):
        _save(m, opt, tmp_path, 2)
    assert (tmp_path / "latest").read_text().strip() == "step_0000001"
    assert not (tmp_path / "step_0000002").exists()
    assert read_manifest(tmp_path)["step"] == 1
    monkeypatch.undo()
    _save(m, opt, tmp_path, 2)  # the leftover temp dir of the crash does not get in the way
    assert read_manifest(tmp_path)["step"] == 2


def test_a_full_disk_fails_the_save_in_one_line_and_keeps_the_previous(tmp_path, monkeypatch):
    """ENOSPC from DCP's tensor writes and from the rank files: a ConfigError naming it, nothing left behind."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    m, opt = _trained()
    _save(m, opt, tmp_path, 1)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    for target, name in ((FileSystemWriter, "write_data"), (torch, "save")):
        with monkeypatch.context() as mp:
            mp.setattr(target, name, full)
            with pytest.raises(ConfigError) as e:
                _save(m, opt, tmp_path, 2, rank_files={"rng/rank_00000.pt": {"x": 1}})
        line = str(e.value)
        assert "\n" not in line and "No space left on device" in line and "step_0000002" in line, line
        assert (tmp_path / "latest").read_text().strip() == "step_0000001"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000001"]
        check_files(read_manifest(tmp_path), checksums=True)


def test_keep_prunes_only_this_runs_checkpoints(tmp_path):
    m, opt = _trained()
    _save(m, opt, tmp_path, 1, keep=1, owner="another-run")
    _save(m, opt, tmp_path, 2)  # written before runs had ids: never pruned either
    for step in (3, 4, 5):
        _save(m, opt, tmp_path, step, keep=2, owner="this-run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000001", "step_0000002",
                                                          "step_0000004", "step_0000005"]
    assert read_manifest(tmp_path / "step_0000005")["owner"] == "this-run"


def test_keep_prunes_old_steps_and_corruption_is_caught(tmp_path):
    m, opt = _trained()
    for step in (1, 2, 3):
        _save(m, opt, tmp_path, step, keep=2, owner="run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000002", "step_0000003"]
    manifest = read_manifest(tmp_path)
    victim = next(p for p in (tmp_path / "step_0000003").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    check_files(manifest)  # sizes still agree
    with pytest.raises(ConfigError, match="sha256"):
        check_files(manifest, checksums=True)
    (tmp_path / "step_0000003" / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ConfigError, match="is not mpformer-checkpoint"):
        read_manifest(tmp_path)


def test_frozen_parameters_are_skipped_in_optimizer_state(tmp_path):
    m = Transformer(CFG, seed=3)
    m.embed.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    state = ckpt_io.optimizer_state(m, opt)
    assert "optim.exp_avg.embedding.word.weight" not in state
    assert "optim.exp_avg.layers.0.attn.q.weight" in state


def test_digests_taken_while_writing_are_the_files_sha256(tmp_path):
    """The writer's digests against hashlib over the files on disk; a file not written through ``write``
    alone (here: writelines, which bypasses the hash) is hashed again from disk, never listed wrong."""
    import hashlib

    from mpformer.checkpoint.hashed_writer import HashingFileSystemWriter

    writer = HashingFileSystemWriter(tmp_path)
    with writer.fs.create_stream(tmp_path / "__0_0.distcp", "wb") as f:
        f.write(b"abc")
        f.write(memoryview(torch.arange(10, dtype=torch.float32).numpy()))
    with writer.fs.create_stream(tmp_path / "__1_0.distcp", "wb") as f:
        f.write(b"x")
        f.writelines([b"yz"])
    got = writer.digests(tmp_path)
    for name in ("__0_0.distcp", "__1_0.distcp"):
        data = (tmp_path / name).read_bytes()
        assert got[name] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
