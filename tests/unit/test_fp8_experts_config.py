"""Which routed experts go float8 (models/fp8.py apply_expert_fp8), their checkpointed per-expert
delayed-scaling state, and the one-line refusal of experts split over tensor parallelism (etp > 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from mpformer.core.errors import ConfigError
from mpformer.core.fp8_config import DEFAULT_KEEP_BF16, Fp8Config, Fp8Options, check_fp8_config
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions
from mpformer.models.transformer import Transformer

MOE = {"arch": "mixtral", "num_experts": 4, "num_experts_per_tok": 2, "mlp_kind": "moe", "moe_ffn_hidden_size": 32}


def _moe(**over) -> ModelConfig:
    return ModelConfig(**{**yaml.safe_load(open("configs/model/tiny-llama.yaml")), **MOE, **over})


def _model(cfg: ModelConfig, **fp8) -> Transformer:
    return Transformer(cfg, ModelOptions(fp8=Fp8Options(**fp8)), device="meta", seed=None)


def test_routed_experts_go_float8_unless_kept():
    m = _model(_moe())
    assert "layers.0.mlp.experts" in m.fp8_layers and "layers.1.mlp.experts" in m.fp8_layers
    kept = _model(_moe(), keep_bf16=(*DEFAULT_KEEP_BF16, "layers.*.mlp.experts"))
    assert not [n for n in kept.fp8_layers if n.endswith("experts")] and kept.fp8_layers  # the dense ones stay
    one = _model(_moe(), keep_bf16=(*DEFAULT_KEEP_BF16, "layers.1.mlp.experts"))
    assert [n for n in one.fp8_layers if n.endswith("experts")] == ["layers.0.mlp.experts"]


def test_delayed_state_is_per_expert_under_canonical_names():
    m = _model(_moe(), recipe="delayed", amax_history_len=8)
    bufs = m.canonical_buffers()
    for e in range(4):
        for p in ("up", "down"):
            assert tuple(bufs[f"layers.1.mlp.experts.{e}.{p}.fp8_amax_history"].global_shape) == (3, 8)
            assert tuple(bufs[f"layers.1.mlp.experts.{e}.{p}.fp8_scale"].global_shape) == (3,)


def test_unaligned_expert_width_names_the_layer_and_keep_bf16():
    with pytest.raises(ConfigError, match=r"layers.0.mlp.experts has out_features=24.*layers.\*.mlp.experts\]"):
        _model(_moe(moe_ffn_hidden_size=24))


def _parallel(**over):
    return SimpleNamespace(**{"tp": 1, "etp": None, "cp": 1, "pp": 1, "zero": 0, "recompute": "none", **over})


def test_experts_split_over_tensor_parallel_are_refused_in_one_line():
    c = Fp8Config()
    with pytest.raises(ConfigError, match=r"parallel.etp=2>1 is not yet supported.*valid: parallel.etp=1") as e:
        check_fp8_config("fp8", c, _parallel(etp=2), False, moe_layers=range(12))
    assert "\n" not in str(e.value)
    check_fp8_config("fp8", c, _parallel(etp=2), False, moe_layers=())  # a dense model has no experts
    check_fp8_config("fp8", c, _parallel(etp=1), False, moe_layers=range(12))
    kept = Fp8Config(keep_bf16=[*DEFAULT_KEEP_BF16, "layers.*.mlp.experts"])
    check_fp8_config("fp8", kept, _parallel(etp=2), False, moe_layers=range(12))  # experts kept bf16: nothing to split
    # a pattern is read against each layer's name: "?" keeps layers 0-9 only, layers 10 and 11 go float8
    with pytest.raises(ConfigError, match=r"parallel.etp=2>1"):
        check_fp8_config("fp8", Fp8Config(keep_bf16=["layers.?.mlp.experts"]), _parallel(etp=2), False,
                         moe_layers=range(12))
    check_fp8_config("fp8", Fp8Config(keep_bf16=["layers.[0-9]*.mlp.experts"]), _parallel(etp=2), False,
                     moe_layers=range(12))
    check_fp8_config("fp8", Fp8Config(keep_bf16=["layers.1.mlp.experts"]), _parallel(etp=2), False, moe_layers=[1])


def test_delayed_experts_refuse_selective_recompute():
    """Selective recompute re-runs the experts' forward in backward: under delayed scaling it would cast with
    the scales the first forward moved (and record twice)."""
    delayed = Fp8Config(recipe="delayed")
    with pytest.raises(ConfigError, match=r"recipe=delayed with parallel.recompute=selective .* routed experts"):
        check_fp8_config("fp8", delayed, _parallel(recompute="selective"), False, moe_layers=range(12))
    check_fp8_config("fp8", Fp8Config(), _parallel(recompute="selective"), False, moe_layers=range(12))  # tensorwise
    check_fp8_config("fp8", delayed, _parallel(recompute="selective"), False, moe_layers=())
