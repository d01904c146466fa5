"""pretrain/pretrain_gpt.py as a user runs it: resume exactness, wandb resume, and bad input.

Bad input must exit non-zero within seconds, before any process group starts, with exactly one
line on stderr that names the problem (and the valid values), and no traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mpformer.testing.cli import run_cli, run_clis

PRETRAIN = "pretrain/pretrain_gpt.py"


def _args(data: str, run_dir: Path, *extra: str) -> list[str]:
    # Dropout on: resume exactness then also needs every rank's RNG state restored.
    return [PRETRAIN, "model=tiny-llama", "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
            f"data.paths=[{data}]", "train.seq_length=32", "train.steps=20",
            "train.global_batch_size=4", "train.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=3",
            "train.device=cpu", "logging.progress=false", f"hydra.run.dir={run_dir}", *extra]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def resumed(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    full = run_cli(_args(tiny_data, root / "full"))
    assert full.returncode == 0, full.stderr[-3000:]
    wandb = ["logging.wandb.mode=offline", "logging.wandb.project=test"]
    first = run_cli(_args(tiny_data, root / "first", "train.stop_at=10", *wandb))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(_args(tiny_data, root / "second", f"checkpoint.load={root / 'first' / 'checkpoints'}", *wandb))
    assert second.returncode == 0, second.stderr[-3000:]
    return root


def test_resume_is_bit_identical(resumed):
    full, first, second = (_metrics(resumed / n) for n in ("full", "first", "second"))
    assert [m["step"] for m in first] == list(range(1, 11))
    assert [m["step"] for m in second] == list(range(11, 21))
    assert [m["loss"] for m in first] == [m["loss"] for m in full[:10]]
    assert [m["loss"] for m in second] == [m["loss"] for m in full[10:]]  # exact, not approximate
    assert [m["grad_norm"] for m in second] == [m["grad_norm"] for m in full[10:]]
    assert full[-1]["loss"] < full[0]["loss"]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"):
        assert key in full[0]
    assert (resumed / "full" / "resolved_config.yaml").is_file()


def test_checkpoints_are_atomic_and_keep_the_wandb_run(resumed):
    ck = resumed / "first" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_0000010"
    m1 = json.loads((ck / "step_0000010" / "manifest.json").read_text())
    m2 = json.loads((resumed / "second" / "checkpoints" / "step_0000020" / "manifest.json").read_text())
    assert m1["trainer"]["wandb_run_id"] and m1["trainer"]["wandb_run_id"] == m2["trainer"]["wandb_run_id"]
    assert not list(ck.glob("*.tmp"))
    assert all(len(f["sha256"]) == 64 for f in m1["files"].values())
    runs = list((resumed / "second" / "wandb").glob(f"offline-run-*-{m1['trainer']['wandb_run_id']}"))
    assert runs, "the resumed run logs to the same wandb run id"


def _one_line_error(res, *needles: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


BAD_INPUTS = {
    "unknown key": (["train.foo=1"], ["train.foo", "valid keys under train"]),
    "world size": (["parallel.dp=2"], ["world size is 1", "parallel.dp=1"]),
    "heads vs tp": (["parallel.tp=3"], ["num_attention_heads=4", "valid tp for this model: 1, 2, 4"]),
    "layers vs pp": (["model.num_layers=4", "parallel.pp=3"], ["num_layers=4", "valid pp: 1, 2, 4"]),
    "batch": (["train.global_batch_size=10", "train.micro_batch_size=4"], ["global_batch_size=10", "multiples of 4"]),
    "cp sequence split": (["parallel.cp=2", "model.attention_dropout=0", "train.seq_length=30"],
                          ["train.seq_length=30", "valid: multiples of 4"]),
    "cp kind": (["parallel.cp=2", "model.attention_dropout=0", "parallel.cp_kind=p2p"],
                ["parallel.cp_kind='p2p' is unknown", "valid: ring, allgather, ulysses, hybrid"]),
    "ulysses degree": (["parallel.cp=8", "parallel.cp_kind=ulysses", "model.attention_dropout=0",
                        "train.seq_length=64"], ["parallel.cp=8 with cp_kind=ulysses", "valid Ulysses degrees: 2, 4"]),
    "hybrid degree": (["parallel.cp=4", "parallel.cp_kind=hybrid", "parallel.cp_ulysses=4",
                       "model.attention_dropout=0"], ["parallel.cp_ulysses=4 at cp=4", "valid: 2"]),
    "cp attention dropout": (["parallel.cp=2"], ["model.attention_dropout=0.1 with parallel.cp=2",
                                                 "valid: model.attention_dropout=0"]),
    "document mask without eos": (["data.document_mask=true"], ["data.document_mask=true needs",
                                                               "data.eos_token_id=ID"]),
    "zero3 with pp": (["parallel.zero=3", "parallel.pp=2"], ["parallel.zero=3 cannot run with parallel.pp=2",
                                                           "valid with pipeline parallelism: zero=0 or 1"]),
    "optimizer zero cannot wrap": (["parallel.zero=1", "optim.name=adafactor"],
                                   ["optim.name=adafactor cannot be wrapped",
                                    "valid with zero > 0 or 16-bit: adamw, adam, sgd"]),
    "fp16": (["train.precision=fp16", "train.initial_loss_scale=0"], ["fp16 loss scaling needs"]),
    "overlap without post-validation": (["train.overlap_validation=true"],
                                        ["train.overlap_validation=true with train.post_validation=false",
                                         "valid: train.post_validation=true with precision fp32|bf16"]),
    "unknown schedule": (["parallel.schedule=zb-h3"],
                         ["parallel.schedule='zb-h3' is unknown",
                          "valid: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipev"]),
    "offload without a pipeline": (["parallel.offload=all"], ["parallel.offload=all", "valid at pp=1: offload=none"]),
    "token slices without a pipeline": (["parallel.pp_token_slices=2"],
                                        ["parallel.pp_token_slices=2", "valid at pp=1: pp_token_slices=1"]),
    "unknown preset": (["model=llama-9000"], ["valid: gpt2"]),
    "unknown cluster": (["cluster=dgx-z"], ["unknown cluster 'dgx-z'", "valid: dgx-a100-80gb"]),
    "auto with a layer split": (["parallel=auto", "parallel.pp_split=[4,4]"],
                                ["parallel.pp_split cannot be combined with parallel=auto"]),
    "auto pin unknown": (["parallel=auto", "autoconfig.fixed.tq=2"], ["autoconfig.fixed.tq", "valid keys"]),
    "on_nan": (["train.on_nan=ignore"], ["train.on_nan='ignore' is unknown", "valid: skip, halt, rollback"]),
    "heartbeat": (["train.heartbeat_timeout_s=-1"], ["train.heartbeat_timeout_s=-1", "must be >= 0"]),
    "skip range": (["data.skip_ranges=[[8,4]]"], ["data.skip_ranges entry [8, 4]", "0 <= start < end"]),
    "async save value": (["checkpoint.async=2"], ["checkpoint.async='2'", "valid: true, false"]),
    "auto fits nowhere": (["parallel=auto", "model.hidden_size=16384", "model.ffn_hidden_size=65536",
                           "model.num_attention_heads=128", "model.num_kv_heads=8"],
                          ["no layout fits local-cpu x 1 node(s)", "the smallest need is", "parallel.dp=1"]),
}


def test_bad_input_fails_fast_in_one_line(tiny_data, tmp_path):
    """Every case of BAD_INPUTS, two processes at a time; the failures listed together."""
    names = list(BAD_INPUTS)
    results = run_clis([_args(tiny_data, tmp_path / name.replace(" ", "_"), *BAD_INPUTS[name][0]) for name in names],
                       timeout=60)
    failures = []
    for name, (res, took) in zip(names, results):
        try:
            _one_line_error(res, *BAD_INPUTS[name][1])
            assert took < 20, f"took {took:.1f} s"
            assert not (tmp_path / name.replace(" ", "_")).exists(), "nothing is written before validation passes"
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)


def test_bad_data_and_checkpoints(tiny_data, resumed, tmp_path):
    _one_line_error(run_cli(_args("/nonexistent/corpus", tmp_path / "r1")), "/nonexistent/corpus")
    trunc = tmp_path / "trunc"
    for ext in (".bin", ".idx"):
        shutil.copy(tiny_data + ext, str(trunc) + ext)
    idx = Path(str(trunc) + ".idx")
    idx.write_bytes(idx.read_bytes()[:-5])
    _one_line_error(run_cli(_args(str(trunc), tmp_path / "r2")), ".idx")
    ckpt = resumed / "first" / "checkpoints"
    line = _one_line_error(run_cli(_args(tiny_data, tmp_path / "r3", "model=tiny-gpt2", f"checkpoint.load={ckpt}")))
    assert "another model shape" in line and "arch" in line
    _one_line_error(run_cli(_args(tiny_data, tmp_path / "r4", "checkpoint.load=/nonexistent/ckpt")), "no such")
    line = _one_line_error(run_cli(_args(tiny_data, tmp_path / "r5", f"checkpoint.load={ckpt}", "train.seed=7")))
    assert "seed was 1234, now 7" in line and "checkpoint.finetune=true" in line
    _one_line_error(run_cli(_args(tiny_data, tmp_path / "r6", "model.vocab_size=100")), "vocab_size=100",
                    "tiny_text_document.bin, tokens [")  # names the file the sample came from
    short = tmp_path / "short"
    for ext in (".bin", ".idx"):
        shutil.copy(tiny_data + ext, str(short) + ext)
    data = Path(str(short) + ".bin")
    data.write_bytes(data.read_bytes()[:-2])
    _one_line_error(run_cli(_args(str(short), tmp_path / "r7")), "short.bin", "truncated or mismatched")


def test_bad_input_under_torchrun_is_said_once(tiny_data, tmp_path):
    res = run_cli(_args(tiny_data, tmp_path / "run", "train.foo=1"), torchrun=2, timeout=60)
    assert res.returncode != 0
    errors = [x for x in res.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "train.foo" in errors[0], res.stderr[-2000:]
    assert "mpformer/" not in res.stderr, "no traceback from our code, only torchrun's summary"


def test_checkpoint_model_overrides_apply_on_top_of_the_checkpoint(resumed):
    """checkpoint.load without model=...: the checkpoint's config, plus the model.<key> overrides."""
    from mpformer.cli.compose import compose_config
    from mpformer.training.preflight import adopt_checkpoint_model

    ckpt = resumed / "first" / "checkpoints"
    composed = compose_config([f"checkpoint.load={ckpt}", "model.hidden_dropout=0.0"])
    assert composed.cfg.model.num_layers == 8  # the default preset (llama-tiny) before adoption
    model, _ = adopt_checkpoint_model(composed)  # a new model config: the composed one is not rewritten
    assert model.num_layers == 2 and model.hidden_dropout == 0.0
    assert model.attention_dropout == 0.1  # from the checkpoint
