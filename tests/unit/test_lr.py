import math

import pytest

from mpformer.optim.lr import LRSchedule


def test_warmup_then_cosine_to_min():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, decay="cosine")
    assert s(0) == pytest.approx(0.1)
    assert s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == pytest.approx(0.1)
    assert s(500) == pytest.approx(0.1)


def test_linear_and_constant():
    lin = LRSchedule(lr=2.0, min_lr=0.0, warmup_steps=0, decay_steps=4, decay="linear")
    assert [lin(i) for i in range(5)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])
    const = LRSchedule(lr=0.5, min_lr=0.0, warmup_steps=2, decay_steps=10, decay="constant")
    assert [const(i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.5, 0.5])
