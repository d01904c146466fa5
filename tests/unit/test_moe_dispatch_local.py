"""LocalDispatcher (ep = 1): dispatch is exactly a stable permutation of the slots by expert, combine its
inverse, gradients flow through both; and the byte formulas of layers/moe_dispatch.py."""

from __future__ import annotations

import pytest
import torch

from mpformer.layers.moe_dispatch import LocalDispatcher, alltoall_bytes, build_dispatcher, dispatch_bytes
from mpformer.parallel.comm import Comm, CommLedger

T, K, H, E = 7, 2, 5, 4


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, E - 1, (T, K), generator=g)  # expert E-1 gets no token
    return x, ids


def test_dispatch_is_a_stable_permutation_and_combine_its_inverse():
    x, ids = _inputs()
    d = LocalDispatcher(E)
    x_mh, counts = d.dispatch(x, ids)
    assert counts == torch.bincount(ids.reshape(-1), minlength=E).tolist() and counts[-1] == 0
    expect = [x[s // K] for e in range(E) for s in range(T * K) if ids.reshape(-1)[s] == e]  # by hand, stable
    assert torch.equal(x_mh, torch.stack(expect))
    y = d.combine(x_mh)
    assert torch.equal(y, x.repeat_interleave(K, 0))  # row t*k + j: token t's slot j
    assert isinstance(d, LocalDispatcher) and isinstance(build_dispatcher("alltoall", Comm(None, CommLedger()), E),
                                                         LocalDispatcher)


def test_per_expert_function_and_gradients():
    x, ids = _inputs(1)
    w = torch.randn(E, H, dtype=torch.float64, requires_grad=True)  # a per-expert weight
    xr = x.clone().requires_grad_()
    d = LocalDispatcher(E)
    x_mh, counts = d.dispatch(xr, ids)
    e_m = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    y = d.combine(x_mh * w[e_m] + e_m.unsqueeze(1))
    flat = ids.reshape(-1)
    ref_x = x.clone().requires_grad_()
    ref = ref_x.repeat_interleave(K, 0) * w[flat] + flat.unsqueeze(1)
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (xr, w), g)
    rx, rw = torch.autograd.grad(ref, (ref_x, w), g)
    torch.testing.assert_close(gx, rx, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-12)
    x32 = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    ids3 = torch.tensor([[2, 0], [1, 2], [0, 0]])

    def f(v):
        dd = LocalDispatcher(3)
        return dd.combine(dd.dispatch(v, ids3)[0] * 3.0)

    assert torch.autograd.gradcheck(f, (x32,))


def test_bad_ids_and_shapes():
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\]"):
        LocalDispatcher(4).dispatch(torch.zeros(2, 3), torch.tensor([[0], [5]]))
    with pytest.raises(ValueError, match="x_th"):
        LocalDispatcher(4).dispatch(torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="ep_dispatcher"):
        build_dispatcher("deepep", Comm(None, CommLedger()), 4)


def test_byte_formulas():
    a = dispatch_bytes("alltoall", tokens=8, k=2, hidden=4, ep=4, itemsize=2, num_experts=8)
    assert a["combine"] == 16 * 3 / 4 * 8 and a["dispatch"] == a["combine"] + 3 * 2 * 8
    assert a["backward"] == 2 * a["combine"] and a["forward"] == a["dispatch"] + a["combine"]
    g = dispatch_bytes("allgather", tokens=8, k=2, hidden=4, ep=4, itemsize=2)
    assert g == {"dispatch": 3 * (8 * 8 + 16 * 8), "combine": 3 * 16 * 8, "forward": 3 * (64 + 128 + 128),
                 "backward": 3 * (8 + 16) * 8}
    assert dispatch_bytes("alltoall", 8, 2, 4, 1, 2)["forward"] == 0 == dispatch_bytes("allgather", 8, 2, 4, 1, 2)[
        "backward"]
    assert alltoall_bytes([3, 0, 5], hidden=4, itemsize=4, rank=0) == 5 * 16
    assert alltoall_bytes([3, 0, 5], hidden=4, itemsize=4, rank=2) == 3 * 16
    with pytest.raises(ValueError, match="kind"):
        dispatch_bytes("ring", 1, 1, 1, 2, 4)


def test_dropped_slots_go_nowhere_and_come_back_zero():
    """Id E marks a slot the capacity factor dropped: not dispatched, a zero row from combine."""
    d = LocalDispatcher(4)
    x = torch.randn(3, 2, requires_grad=True)
    ids = torch.tensor([[0, 4], [4, 1], [1, 0]])
    rows, counts = d.dispatch(x, ids)
    assert counts == [2, 2, 0, 0] and rows.shape == (4, 2)
    out = d.combine(rows * 2.0)
    want = torch.zeros(6, 2)
    for slot, e in enumerate(ids.reshape(-1).tolist()):
        if e < 4:
            want[slot] = 2.0 * x[slot // 2].detach()
    assert torch.equal(out.detach(), want)
    out.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[2.0, 2.0], [2.0, 2.0], [4.0, 4.0]]))
