"""One list of parallel fields: ParallelLayout's, and the two config classes written out beside it
(``parallel.*`` and ``autoconfig.fixed.*``), held equal here in names, types and defaults."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import get_type_hints

import pytest

from mpformer.autoconfig.candidates import NOT_SEARCHED, PINNABLE, PLAN_FIELDS
from mpformer.autoconfig.search import search
from mpformer.core.config import FixedPlan, ParallelConfig
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout

LAYOUT = {f.name: f for f in fields(ParallelLayout)}
AS_YAML = {"pp_split": list[int] | None}  # YAML gives a list where the layout keeps a tuple


def _missing(cls: type, extra: set[str]) -> set[str]:
    return set(LAYOUT) ^ ({f.name for f in fields(cls)} - extra)


def test_parallel_config_has_every_layout_field_with_its_type_and_default():
    assert not _missing(ParallelConfig, {"auto"}), "parallel.* and ParallelLayout list different fields"
    hints, layout_hints = get_type_hints(ParallelConfig), get_type_hints(ParallelLayout)
    for name, f in LAYOUT.items():
        assert hints[name] == AS_YAML.get(name, layout_hints[name]), name
        assert ParallelConfig.__dataclass_fields__[name].default == f.default, name
    assert ParallelConfig().layout() == ParallelLayout()
    assert ParallelConfig(pp_split=[3, 1], pp=2).layout().pp_split == (3, 1)


def test_fixed_plan_pins_every_layout_field_and_the_micro_batch():
    assert not _missing(FixedPlan, {"micro_batch_size"}), "autoconfig.fixed and ParallelLayout list different fields"
    hints, layout_hints = get_type_hints(FixedPlan), get_type_hints(ParallelLayout)
    for name in LAYOUT:
        want = AS_YAML.get(name, layout_hints[name])
        assert hints[name] == want | None, name  # optional: None means searched (or the run's value)
    assert all(f.default is None and f.default_factory is MISSING for f in fields(FixedPlan))
    assert set(PINNABLE) == {*PLAN_FIELDS, *NOT_SEARCHED, "pp_partition"}


def test_a_missing_field_is_caught():
    """The check above is not vacuous: a config class without one layout field fails it."""

    @dataclass
    class Short:
        dp: int = -1

    assert "tp" in _missing(Short, set())


def test_the_fields_the_search_does_not_choose_are_priced_as_pinned():
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.memory import Workload
    from mpformer.core.model_config import ModelConfig

    model = ModelConfig(hidden_size=256, num_layers=4, num_attention_heads=8, vocab_size=1024,
                        max_position_embeddings=512)
    cluster = load_cluster("dgx-h100", nodes=1)
    w = Workload(global_batch_size=16, micro_batch_size=1, seq_length=512, precision="bf16")
    res = search(model, cluster, w, fixed={"grad_reduce_dtype": "bf16", "pp_partition": "balanced", "pp": 2},
                 top_k=3)
    assert res.top and all(c.layout.grad_reduce_dtype == "bf16" and c.layout.pp_partition == "balanced"
                           for c in res.top)
    with pytest.raises(ConfigError, match="pp_split cannot be pinned"):
        search(model, cluster, w, fixed={"pp_split": [2, 2]})
    with pytest.raises(ConfigError, match="unknown fields"):
        search(model, cluster, w, fixed={"pipeline": 2})
