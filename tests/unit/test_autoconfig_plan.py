"""parallel=auto's pieces without processes: pins from the command line, the cluster cut to the world,
the chosen plan written into the config, and one-line errors."""

from __future__ import annotations

import pytest

from mpformer.autoconfig.plan import apply_plan, choose_layout, pinned_fields, predict, run_cluster
from mpformer.cli.compose import compose_config
from mpformer.core.errors import ConfigError
from mpformer.core.layout import validate

TINY = ["model=tiny-llama", "train.seq_length=32", "train.global_batch_size=8", "train.device=cpu"]


def test_command_line_layout_keys_are_pinned():
    c = compose_config([*TINY, "parallel=auto", "parallel.tp=2", "parallel.dp=-1", "train.micro_batch_size=2",
                        "autoconfig.fixed.zero=1"])
    assert c.cfg.parallel.auto
    assert pinned_fields(c) == {"tp": 2, "micro_batch_size": 2, "zero": 1}  # dp=-1 means "what is left"
    with pytest.raises(ConfigError, match=r"parallel\.pp_split cannot be combined with parallel=auto"):
        pinned_fields(compose_config([*TINY, "parallel=auto", "parallel.pp_split=[4,4]"]))


def test_cluster_is_cut_to_the_world(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    c = run_cluster(None, 2, "cpu")
    assert (c.name, c.devices_per_node, c.nodes) == ("local-cpu", 2, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    c = run_cluster("dgx-h100", 32, "cuda")
    assert (c.devices_per_node, c.nodes) == (8, 4)
    with pytest.raises(ConfigError, match="parallel=auto on GPUs needs the hardware to plan for: cluster=NAME"):
        run_cluster(None, 8, "cuda")
    with pytest.raises(ConfigError, match="world size 12 is not a whole number of nodes of 8"):
        run_cluster("dgx-h100", 12, "cuda")


def test_the_chosen_plan_is_written_into_the_config_and_validates(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    c = compose_config([*TINY, "parallel=auto", "parallel.pp=2"])
    pred = choose_layout(c.cfg, c, 4)
    cfg = apply_plan(c.cfg, c, pred)  # preflight's new config; the composed one stays as validated
    p, t = cfg.parallel, cfg.train
    plan = pred.candidate.plan()
    assert p.pp == 2 and (p.dp, p.tp, p.zero, p.schedule, t.micro_batch_size) == (
        plan["dp"], plan["tp"], plan["zero"], plan["schedule"], plan["micro_batch_size"])
    layout = validate(p.layout(), cfg.model, 4, global_batch_size=t.global_batch_size,
                      micro_batch_size=t.micro_batch_size, seq_length=t.seq_length)
    assert layout.dp * layout.tp * layout.pp == 4
    again = predict(cfg, layout, 4)  # the same plan, timed on its own, predicts the same step time
    assert again.step_time_s == pytest.approx(pred.step_time_s, rel=1e-9)
    d = pred.to_dict()
    assert d["plan"] == plan and d["candidates_evaluated"] > 1 and d["predicted"]["iteration_time_s"] > 0
    assert "auto-configurator chose parallel.dp=" in pred.summary()


def test_parallel_auto_explains_its_choice_when_asked(monkeypatch):
    """autoconfig.explain=true under parallel=auto: the banner says why (the chosen plan against the
    runner-up and a person's first plan, term by term) and autoconfig.json carries it; off by default."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    c = compose_config([*TINY, "parallel=auto"])
    plain = choose_layout(c.cfg, c, 4)
    assert plain.explanation is None and "explain" not in plain.to_dict()
    c = compose_config([*TINY, "parallel=auto", "autoconfig.explain=true", "autoconfig.top_k=1"])
    pred = choose_layout(c.cfg, c, 4)
    d = pred.to_dict()["explain"]
    assert d == pred.explanation.to_dict() and {x["label"] for x in d["comparisons"]} == {"runner-up", "baseline"}
    text = pred.summary()
    assert text.startswith("auto-configurator chose") and "runner-up" in text


def test_parallel_auto_may_choose_fp8_on_a_gpu_cluster(monkeypatch):
    """autoconfig.precisions=[bf16,fp8] on DGX H100s: parallel=auto searches both and the run takes the
    faster plan's precision with its layout (one the training config's rules accept); fp8 alone on an A100
    cluster fails in one line (no float8 tensor cores)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    base = ["model=llama-1b", "train.seq_length=2048", "train.global_batch_size=64", "parallel=auto"]
    c = compose_config([*base, "autoconfig.cluster=dgx-h100", "autoconfig.precisions=[fp8]"])
    pred = choose_layout(c.cfg, c, 8)
    cfg = apply_plan(c.cfg, c, pred)
    assert cfg.train.precision == "fp8" and cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp == 8
    from mpformer.core.config import check_training_config

    check_training_config(cfg)
    c = compose_config([*base, "autoconfig.cluster=dgx-h100", "autoconfig.precisions=[bf16,fp8]"])
    pred = choose_layout(c.cfg, c, 8)
    assert apply_plan(c.cfg, c, pred).train.precision == pred.candidate.precision
    c = compose_config([*base, "autoconfig.cluster=dgx-a100-80gb", "train.precision=fp8"])
    with pytest.raises(ConfigError, match="cluster dgx-a100-80gb has no fp8 rate"):
        choose_layout(c.cfg, c, 8)
