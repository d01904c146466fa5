"""train.seq_length beyond model.max_position_embeddings fails at config validation, as Megatron's
arguments check does: learned positions have no row past the table, and RoPE models are held to the
same limit (raise the field to train longer). One line, exit 2, before torch or a process group loads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mpformer.core.config import Config, TrainConfig, check_training_config
from mpformer.core.errors import ConfigError
from mpformer.core.model_config import ModelConfig
from mpformer.testing.cli import run_cli


@pytest.mark.parametrize("arch, kind", [("llama", "rotary positions"), ("gpt2", "learned positions")])
def test_check_names_both_keys_and_the_valid_range(arch, kind):
    extra = {"activation": "gelu_tanh", "attention_bias": True, "mlp_bias": True} if arch == "gpt2" else {}
    model = ModelConfig(arch=arch, max_position_embeddings=2048, **extra)
    check_training_config(Config(model=model, train=TrainConfig(seq_length=2048)))  # the limit itself runs
    with pytest.raises(ConfigError) as e:
        check_training_config(Config(model=model, train=TrainConfig(seq_length=100000)))
    msg = str(e.value)
    assert "\n" not in msg and kind in msg
    assert "train.seq_length=100000" in msg and "model.max_position_embeddings=2048" in msg
    assert "valid: 1 <= train.seq_length <= 2048" in msg


@pytest.mark.parametrize("model, limit", [("llama-tiny", 2048), ("tiny-gpt2", 512)])
def test_pretrain_cli_refuses_in_one_line(tmp_path: Path, model, limit):
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    res = run_cli(["pretrain/pretrain_gpt.py", f"model={model}", "data=demo", "train.seq_length=100000",
                   "train.device=cpu", f"hydra.run.dir={run_dir}"], timeout=60)
    took = time.perf_counter() - t0
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith("error: train.seq_length=100000 exceeds "
                               f"model.max_position_embeddings={limit}"), lines[0]
    assert f"valid: 1 <= train.seq_length <= {limit}" in lines[0]
    assert took < 10, f"took {took:.1f} s"
    assert not run_dir.exists(), "nothing is written before validation passes"


def test_refused_before_torch_loads():
    code = ("import sys\nfrom mpformer.cli.pretrain import main\n"
            "try:\n    main(['model=llama-tiny', 'data=demo', 'train.seq_length=100000'])\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n")
    res = run_cli(["-c", code], timeout=60)
    assert res.stdout.strip() == "exit 2 False", (res.stdout, res.stderr[-2000:])


def test_autoconfig_cli_refuses_too():
    res = run_cli(["tools/autoconfig.py", "model=tiny-llama", "cluster=dgx-h100", "train.global_batch_size=64",
                   "train.seq_length=4096"], timeout=60)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "train.seq_length=4096 exceeds model.max_position_embeddings=512" in lines[0]


