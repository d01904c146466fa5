"""Which routed experts go float8 (models/fp8.py apply_expert_fp8), their checkpointed per-expert
delayed-scaling state, and the layouts they train on."""

from __future__ import annotations

import pytest
import yaml

from mpformer.core.errors import ConfigError
from mpformer.core.fp8_config import DEFAULT_KEEP_BF16, Fp8Options
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


@pytest.mark.parametrize("over", [("parallel.tp=2", "parallel.etp=2", "parallel.sequence_parallel=true"),
                                  ("parallel.cp=2",), ("parallel.cp=2", "parallel.ep=2"),
                                  ("parallel.recompute=selective", "train.fp8.recipe=delayed"),
                                  ("parallel.recompute=full", "train.fp8.recipe=delayed")])
def test_float8_experts_train_on_every_layout(over):
    """Experts split over etp, tokens split over cp (and tp under SP), and delayed scaling with recompute
    are valid fp8 runs (their amaxes span the splits; the recompute replays the first forward's scales)."""
    from mpformer.cli.compose import compose_config
    from mpformer.core.config import check_training_config

    cfg = compose_config(["model=tiny-llama", "model.arch=mixtral", "model.num_experts=4", "model.mlp_kind=moe",
                          "model.num_experts_per_tok=2", "model.moe_ffn_hidden_size=32", "train.precision=fp8",
                          *over]).cfg
    check_training_config(cfg)
