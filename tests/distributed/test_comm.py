"""The autograd collective pairs on 2 gloo ranks: forward values, backward = the dual collective,
and the ledger's ring-adjusted byte counts. Oracle: the same math on the concatenated full tensors."""

from __future__ import annotations

import torch

from mpformer.parallel.spawn import run_distributed


def _pairs() -> dict:
    import torch.distributed as dist

    from mpformer.parallel import comm as C

    rank, n = dist.get_rank(), dist.get_world_size()
    ledger = C.CommLedger()
    cm = C.Comm(dist.group.WORLD, ledger)
    full = torch.arange(4 * 6 * 2, dtype=torch.float32).reshape(4, 6, 2)  # same on every rank
    mine = full.chunk(n, dim=0)[rank]
    out = {}

    x = (mine * (rank + 1)).requires_grad_()
    y = C.all_gather_seq(x, cm)  # fwd all-gather, bwd reduce-scatter
    expect = torch.cat([full.chunk(n, 0)[r] * (r + 1) for r in range(n)])
    out["ag"] = torch.equal(y, expect)
    (y * 2).sum().backward()
    out["ag_grad"] = torch.equal(x.grad, torch.full_like(x, 2.0 * n))  # n ranks each sent 2s

    x = full.clone().requires_grad_()
    y = C.reduce_scatter_seq(x, cm)  # fwd reduce-scatter, bwd all-gather
    out["rs"] = torch.equal(y, n * mine)
    y.sum().backward()
    out["rs_grad"] = torch.equal(x.grad, torch.ones_like(full))

    x = full.clone().requires_grad_()
    y = C.scatter_to_region(x, cm, dim=1)  # keep own chunk along dim 1
    out["scatter"] = torch.equal(y, full.chunk(n, 1)[rank])
    y.sum().backward()
    out["scatter_grad"] = torch.equal(x.grad, torch.ones_like(full))  # all-gathered ones

    x = full.chunk(n, 1)[rank].clone().requires_grad_()
    y = C.gather_from_region(x, cm, dim=1)
    out["gather"] = torch.equal(y, full)
    (y * torch.arange(6.0).view(1, 6, 1)).sum().backward()
    out["gather_grad"] = torch.equal(x.grad, torch.arange(6.0).view(1, 6, 1).chunk(n, 1)[rank].expand_as(x))

    x = (full * (rank + 1)).requires_grad_()
    y = C.all_to_all(x, cm, scatter_dim=1, gather_dim=0)  # Ulysses: split heads, gather sequence
    expect = torch.cat([(full * (r + 1)).chunk(n, 1)[rank] for r in range(n)], dim=0)
    out["a2a"] = torch.equal(y, expect)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank))
    y.backward(g)
    gs = [torch.randn(y.shape, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    want = torch.cat([gs[r].chunk(n, 0)[rank] for r in range(n)], dim=1)  # the dual all-to-all
    out["a2a_grad"] = torch.equal(x.grad, want)

    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = C.reduce_from_region(x, cm)  # fwd all-reduce, bwd identity
    out["reduce"] = torch.equal(y, torch.full((3,), float(sum(range(1, n + 1)))))
    (y * 5).sum().backward()
    out["reduce_grad"] = torch.equal(x.grad, torch.full((3,), 5.0))

    x = torch.ones(3, requires_grad=True)
    y = C.copy_to_region(x, cm)
    (y * (rank + 1)).sum().backward()
    out["copy_grad"] = torch.equal(x.grad, torch.full((3,), float(sum(range(1, n + 1)))))
    ledger.take()
    t = torch.zeros(1000)
    cm.all_reduce(t)
    cm.all_gather(torch.zeros(500))
    cm.reduce_scatter(torch.zeros(1000))
    cm.all_to_all(torch.zeros(10, 100), 0, 1)
    out["bytes"] = ledger.take()
    return out


def test_autograd_pairs_and_ledger():
    res = run_distributed(_pairs, 2, timeout=60)
    for r in res:
        byts = r.pop("bytes")
        assert all(r.values()), r
        # Ring over 2 ranks: all-reduce 2 (n-1)/n = 1 x its 4000 bytes; all-gather (n-1)/n of its 4000 output
        # bytes; reduce-scatter (n-1)/n of its 4000 input bytes; all-to-all (n-1)/n of its 4000 bytes.
        assert byts == {"all_reduce": 4000, "all_gather": 2000, "reduce_scatter": 2000, "all_to_all": 2000}
