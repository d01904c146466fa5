"""train.precision=fp8's keys and rules (core/fp8_config.py, models/fp8.py): each mistake one line naming
what is valid; the model's float8 layers chosen by canonical name."""

from __future__ import annotations

import pytest
import yaml

from mpformer.cli.compose import compose_config
from mpformer.core.config import check_training_config
from mpformer.core.errors import ConfigError
from mpformer.core.fp8_config import DEFAULT_KEEP_BF16, Fp8Options
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions
from mpformer.models.transformer import Transformer


def _cfg(*overrides: str):
    return compose_config(["model=tiny-llama", *overrides]).cfg


def _fails(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        check_training_config(_cfg(*overrides))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_defaults():
    cfg = _cfg("train.precision=fp8")
    check_training_config(cfg)
    f = cfg.train.fp8
    assert (f.recipe, f.grad_dtype, f.amax_history_len, f.margin) == ("tensorwise", "auto", 16, 0)
    assert tuple(f.keep_bf16) == DEFAULT_KEEP_BF16
    assert ModelOptions.for_run(cfg.parallel.layout(), cfg.train, None).fp8 == Fp8Options()
    assert ModelOptions.for_run(cfg.parallel.layout(), _cfg().train, None).fp8 is None


@pytest.mark.parametrize("recipe,given,built", [("tensorwise", "auto", "e5m2"), ("delayed", "auto", "e5m2"),
                                                ("rowwise", "auto", "e4m3"), ("rowwise", "e5m2", "e5m2"),
                                                ("tensorwise", "e4m3", "e4m3")])
def test_grad_format_auto_follows_the_recipe(recipe, given, built):
    """auto: e5m2 under one scale per tensor, e4m3 under rowwise scales (torchao's recipes); a format
    given by name is kept; the model's options never hold "auto"."""
    cfg = _cfg("train.precision=fp8", f"train.fp8.recipe={recipe}", f"train.fp8.grad_dtype={given}")
    check_training_config(cfg)
    o = ModelOptions.for_run(cfg.parallel.layout(), cfg.train, None).fp8
    assert o.grad_dtype == built == Fp8Options(recipe=recipe, grad_dtype=given).grad_dtype
    from mpformer.layers.fp8 import Float8Recipe

    assert Float8Recipe(recipe, given).grad == built  # the numerics' own default is the same rule


def test_unknown_key_is_an_error():
    with pytest.raises(ConfigError, match=r"train\.fp8\.recipee"):
        _cfg("train.precision=fp8", "+train.fp8.recipee=delayed")
    with pytest.raises(ConfigError, match="recipee"):
        _cfg("train.precision=fp8", "train.fp8.recipee=delayed")


@pytest.mark.parametrize("overrides, words", [
    (("train.fp8.recipe=blockwise",), "tensorwise, rowwise, delayed"),
    (("train.fp8.grad_dtype=e3m4",), "auto, e4m3, e5m2"),
    (("train.fp8.amax_history_len=0",), "amax_history_len=0 must be >= 1"),
])
def test_fp8_rules(overrides, words):
    assert words in _fails("train.precision=fp8", *overrides)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fp8_keys_need_precision_fp8(precision):
    msg = _fails(f"train.precision={precision}", "train.fp8.recipe=delayed")
    assert f"train.fp8.recipe='delayed' with train.precision={precision}" in msg and "valid: train.precision=fp8" in msg


def test_dp_with_every_zero_stage_passes():
    for zero in (0, 1, 2, 3):  # ZeRO-3 gathers float8 layers' weights in float8 (optim/fp8_gather.py)
        check_training_config(_cfg("train.precision=fp8", "parallel.dp=2", f"parallel.zero={zero}"))


def _model(**over) -> ModelConfig:
    return ModelConfig(**{**yaml.safe_load(open("configs/model/tiny-llama.yaml")), **over})


def test_layers_by_canonical_name():
    m = Transformer(_model(), ModelOptions(fp8=Fp8Options(keep_bf16=(*DEFAULT_KEEP_BF16, "layers.1.*", "*.o"))),
                    device="meta", seed=None)
    assert m.fp8_layers == ["layers.0.attn.qkv", "layers.0.mlp.up", "layers.0.mlp.down"]
    kept_by_part = Transformer(_model(), ModelOptions(fp8=Fp8Options(keep_bf16=("layers.0.attn.k",))),
                               device="meta", seed=None)
    assert "layers.0.attn.qkv" not in kept_by_part.fp8_layers  # a fused projection is kept whole
    delayed = Transformer(_model(), ModelOptions(fp8=Fp8Options(recipe="delayed")), device="meta", seed=None)
    assert sorted(delayed.canonical_buffers())[:2] == ["layers.0.attn.o.fp8_amax_history", "layers.0.attn.o.fp8_scale"]


def test_pattern_matching_nothing_is_an_error():
    with pytest.raises(ConfigError, match=r"'layers.9.\*' matches no layer of this model; valid: .*layers.\*.attn.qkv"):
        Transformer(_model(), ModelOptions(fp8=Fp8Options(keep_bf16=("layers.9.*",))), device="meta", seed=None)


def test_unaligned_layer_names_itself_and_keep_bf16():
    want = r"layer layers.0.mlp.up has out_features=360.*keep_bf16=\[.*,layers.0.mlp.up\]"
    with pytest.raises(ConfigError, match=want):
        Transformer(_model(ffn_hidden_size=180), ModelOptions(fp8=Fp8Options()), device="meta", seed=None)


def test_tokens_per_micro_batch_must_align():
    msg = _fails("train.precision=fp8", "train.micro_batch_size=1", "train.seq_length=40")
    assert "40 tokens per micro-batch" in msg and "multiple of 16" in msg and "\n" not in msg
    check_training_config(_cfg("train.precision=fp8", "train.micro_batch_size=2", "train.seq_length=40"))
    msg = _fails("train.precision=fp8", "train.micro_batch_size=1", "train.seq_length=64", "parallel.pp=2",
                 "parallel.pp_token_slices=8")  # a pipeline's token slice is a GEMM's M of its own
    assert "8 tokens per micro-batch" in msg and "parallel.pp_token_slices=8" in msg


def test_delayed_scaling_composes_with_recompute_and_overlapped_validation():
    """Once refused (a step's amaxes recorded twice): the recompute replays its scales and a step run again
    takes back its records (tests/distributed/test_fp8_training.py runs both)."""
    check_training_config(_cfg("train.precision=fp8", "train.fp8.recipe=delayed", "parallel.recompute=full"))
    check_training_config(_cfg("train.precision=fp8", "train.fp8.recipe=delayed", "train.post_validation=true",
                               "train.overlap_validation=true"))


def test_float8_needs_compute_capability_8_9(monkeypatch):
    """The early device check: a live CUDA device below sm_89 has no float8 GEMMs (torch.cuda faked)."""
    import torch

    from mpformer.parallel.device import Device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cuda = Device("cuda")
    assert not cuda.supports_dtype(torch.float8_e4m3fn) and cuda.supports_dtype(torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert cuda.supports_dtype(torch.float8_e4m3fn)
    assert Device("cpu").supports_dtype(torch.float8_e4m3fn)
    assert Device("cuda", rehearsal=True).supports_dtype(torch.float8_e5m2)  # a rehearsal touches no runtime
