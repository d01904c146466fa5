"""layers/expert_gemm.py: the grouped, padded and loop expert MLPs agree, in values and gradients."""

from __future__ import annotations

import pytest
import torch

from mpformer.layers.expert_gemm import choose_method, expert_mlp, grouped_ok

COUNTS = {"uneven": [5, 0, 17, 1, 0, 9], "all empty": [0] * 6, "one expert": [0, 0, 23, 0, 0, 0]}


def _inputs(counts: list[int], h: int = 8, f: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = torch.randn(sum(counts), h, generator=g, dtype=torch.float64).float()
    w_up = (torch.randn(E, 2 * f, h, generator=g) / h ** 0.5)
    # w_down as a transposed view of an [E, f, h] tensor: plain tensors, possibly views
    w_down = (torch.randn(E, f, h, generator=g) / f ** 0.5).transpose(1, 2)
    dy = torch.randn(sum(counts), h, generator=g)
    return x, w_up, w_down, dy


def _run(method: str, counts, x, w_up, w_down, dy, *, sum_loss: bool = False):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w_up, w_down)]
    y = expert_mlp(leaves[0], counts, leaves[1], leaves[2], method=method)
    (y.sum() if sum_loss else (y * dy).sum()).backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return y.detach(), grads


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-6) -> None:
    assert a.shape == b.shape
    if b.numel() == 0:
        return
    scale = max(b.abs().max().item(), 1e-30)
    assert (a - b).abs().max().item() <= rel * scale, f"{(a - b).abs().max().item() / scale:.2e}"


@pytest.mark.parametrize("case", list(COUNTS))
@pytest.mark.parametrize("method", ["grouped", "padded"])
def test_methods_equal_the_loop(method: str, case: str) -> None:
    counts = COUNTS[case]
    args = _inputs(counts)
    y_ref, g_ref = _run("loop", counts, *args)
    y, g = _run(method, counts, *args)
    _close(y, y_ref)
    for a, b in zip(g, g_ref):
        _close(a, b)
    if not sum(counts):  # no rows: every weight gradient is zero
        assert all(t.abs().max().item() == 0 for t in g[1:])


def test_grouped_backward_takes_an_expanded_gradient() -> None:
    counts = COUNTS["uneven"]
    args = _inputs(counts)
    _, g_ref = _run("loop", counts, *args, sum_loss=True)
    _, g = _run("grouped", counts, *args, sum_loss=True)  # y.sum()'s gradient has stride 0
    for a, b in zip(g, g_ref):
        _close(a, b)


def test_grouped_takes_counts_as_a_tensor() -> None:
    counts = COUNTS["uneven"]
    x, w_up, w_down, _ = _inputs(counts)
    y = expert_mlp(x, torch.tensor(counts), w_up, w_down, method="grouped")
    _close(y, expert_mlp(x, counts, w_up, w_down, method="loop"))


def test_grouped_ok_and_fallback() -> None:
    assert grouped_ok("cpu", torch.float32, 8, 12)
    assert grouped_ok("cpu", torch.bfloat16, 16, 24)
    assert not grouped_ok("cpu", torch.float32, 6, 12)       # 24-byte rows
    assert not grouped_ok("cpu", torch.float32, 8, 10)
    assert not grouped_ok("cpu", torch.bfloat16, 12, 16)      # bf16 needs multiples of 8
    assert not grouped_ok("cpu", torch.float64, 8, 12)        # the CPU kernel refuses fp64
    assert grouped_ok("cuda", torch.bfloat16, 8, 16) and not grouped_ok("cuda", torch.float32, 8, 16)
    assert grouped_ok("meta", torch.bfloat16, 8, 16) and not grouped_ok("meta", torch.float32, 8, 16)
    assert choose_method("cpu", torch.float32, 6, 12) == "loop"
    assert choose_method("cuda", torch.float32, 8, 16) == "loop"
    assert choose_method("cuda", torch.bfloat16, 8, 16) == "grouped"
    assert choose_method("cpu", torch.float32, 8, 12) == "loop"  # measured: the loop is faster on CPU
    counts = [3, 0, 4]
    x, w_up, w_down, _ = _inputs(counts, h=6, f=10)
    with pytest.raises(ValueError, match="16-byte"):
        expert_mlp(x, counts, w_up, w_down, method="grouped")
    y = expert_mlp(x, counts, w_up, w_down, method=choose_method("cpu", x.dtype, 6, 10))
    assert y.shape == (7, 6)
    with pytest.raises(ValueError, match="not one of"):
        expert_mlp(x, counts, w_up, w_down, method="bmm")
    with pytest.raises(ValueError, match="sum to"):
        expert_mlp(x, [3, 0, 3], w_up, w_down, method="loop")


def test_grouped_on_meta_bf16() -> None:
    E, h, f, counts = 4, 16, 32, [5, 0, 2, 9]
    kw = {"device": "meta", "dtype": torch.bfloat16}
    x = torch.empty(sum(counts), h, **kw, requires_grad=True)
    w_up = torch.empty(E, 2 * f, h, **kw, requires_grad=True)
    w_down = torch.empty(E, f, h, **kw).transpose(1, 2).requires_grad_(True)
    y = expert_mlp(x, counts, w_up, w_down, method="grouped")
    assert y.shape == (16, h) and y.device.type == "meta"
    y.sum().backward()
    assert x.grad.shape == x.shape and w_up.grad.shape == w_up.shape and w_down.grad.shape == (E, h, f)
    with pytest.raises(ValueError):  # fp32 is refused by the meta kernel: grouped_ok says so first
        expert_mlp(x.detach().float(), counts, w_up.detach().float(), w_down.detach().float(), method="grouped")
