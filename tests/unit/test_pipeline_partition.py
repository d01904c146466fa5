"""Layers -> stages: uniform, explicit split, and the balanced DP against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from mpformer.core.errors import ConfigError
from mpformer.core.partition import (
    balanced,
    from_split,
    max_stage_cost,
    rank_layers,
    stage_layers,
    uniform,
)


def brute_force(costs: list[float], stages: int, first: float = 0.0, last: float = 0.0) -> float:
    """Smallest max-stage cost over every split of the chain into ``stages`` non-empty parts."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        split = [bounds[i + 1] - bounds[i] for i in range(stages)]
        best = min(best, max_stage_cost(split, costs, first_extra=first, last_extra=last))
    return best


def test_uniform():
    assert uniform(12, 4) == [3, 3, 3, 3]
    assert uniform(5, 1) == [5]
    with pytest.raises(ConfigError, match=r"num_layers=10 cannot be split into 4 equal stages.*valid stage "
                                          r"counts: 1, 2, 5, 10"):
        uniform(10, 4)
    with pytest.raises(ConfigError, match=r"exceeds num_layers=3.*valid stage counts: 1\.\.3"):
        uniform(3, 4)


def test_from_split():
    assert from_split([1, 3, 3, 1], 8, 4) == [1, 3, 3, 1]
    for bad in ([2, 2, 2], [0, 4, 2, 2], [2, 2, 2, 3], [2.0, 2, 2, 2], [True, 3, 2, 2]):
        with pytest.raises(ConfigError, match=r"parallel\.pp_split=.* is malformed: it needs pp\*vpp=4 positive") as e:
            from_split(bad, 8, 4)
        assert "e.g. [2, 2, 2, 2]" in str(e.value) and "\n" not in str(e.value)


def test_layer_ranges_follow_the_interleaved_layout():
    split = [1, 2, 3, 2]  # pp=2, vpp=2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    assert stage_layers(split, 2) == range(3, 6)
    assert rank_layers(split, 2, 0) == [range(0, 1), range(3, 6)]
    assert rank_layers(split, 2, 1) == [range(1, 3), range(6, 8)]
    with pytest.raises(ConfigError, match=r"pp\*vpp entries"):
        rank_layers(split, 3, 0)


def test_balanced_examples():
    assert balanced([1.0] * 8, 4) == [2, 2, 2, 2]
    assert balanced([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    # The LM head on the last stage pushes layers towards the front.
    assert balanced([1.0] * 8, 2, last_extra=2.0) == [5, 3]
    with pytest.raises(ConfigError, match="exceeds num_layers=2"):
        balanced([1.0, 1.0], 3)


def test_balanced_equals_brute_force_on_random_cases():
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, min(4, n))
        costs = [rng.choice([rng.random() * 10, float(rng.randint(1, 4))]) for _ in range(n)]
        first, last = (rng.random() * 3, rng.random() * 3) if rng.random() < 0.3 else (0.0, 0.0)
        split = balanced(costs, stages, first_extra=first, last_extra=last)
        assert len(split) == stages and sum(split) == n and min(split) >= 1
        got = max_stage_cost(split, costs, first_extra=first, last_extra=last)
        assert got == pytest.approx(brute_force(costs, stages, first, last)), (costs, stages)


def test_model_costs_by_hand_and_a_large_vocabulary_shortens_the_last_stage():
    from mpformer.core.model_config import ModelConfig
    from mpformer.core.partition import balanced_for, model_costs

    # h=64, 8 heads of 8, 2 kv heads, swiglu ffn 192, s=16: GEMM weights 64*8*(8+4) + 64*64 + 64*576
    # = 6144 + 4096 + 36864 = 47104, FLOPs 2 * 47104 = 94208, attention 4 * 16 * 8 * 8 = 4096.
    m = ModelConfig(arch="llama", num_layers=8, hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                    ffn_hidden_size=192, vocab_size=100)
    layers, first, last = model_costs(m, 16)
    assert layers == [94208 + 4096] * 8 and first == 0 and last == 2 * 64 * 100
    assert balanced_for(m, 2, 16) == [4, 4]  # a 12.8k-FLOP head is a tenth of a layer
    big = ModelConfig(arch="llama", num_layers=8, hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                      ffn_hidden_size=192, vocab_size=2300)  # head 294k FLOPs ~ 3 layers
    assert balanced_for(big, 2, 16) == [5, 3]  # max(5, 3 + 2.99) beats max(6, 2 + 2.99)
    assert balanced_for(big, 3, 16) == [3, 4, 1]  # slowest stage 4 layers; [4, 3, 1] ties, the earliest cut wins
