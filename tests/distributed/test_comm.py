"""The autograd collective pairs on 2 gloo ranks: forward values, backward = the dual collective,
and the ledger's ring-adjusted byte counts. Oracle: the same math on the concatenated full tensors."""

from __future__ import annotations

import pytest
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


def _pairwise_against_gloo() -> dict:
    """The pairwise reduce-scatter / all-gather (parallel/pairwise.py) against gloo's own, sync and async,
    fp32 and bf16, in place and not; the reduce-scatter sums in rank order, so it equals the rank-order
    sum of every rank's (seeded) input bit for bit."""
    import torch.distributed as dist

    from mpformer.parallel import comm as C
    from mpformer.parallel import pairwise

    rank, n = dist.get_rank(), dist.get_world_size()
    cm = C.Comm(dist.group.WORLD, C.CommLedger())
    out = {"used": cm.pairwise}
    for dtype in (torch.float32, torch.bfloat16):
        xs = [torch.randn(n * 1000, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(n)]
        want = xs[0].clone()
        for x in xs[1:]:
            want += x
        mine = torch.empty(1000, dtype=dtype)
        work = cm.reduce_scatter_into(mine, xs[rank].clone(), async_op=True)
        work.wait()
        out[f"rs {dtype}"] = torch.equal(mine, want.view(n, 1000)[rank])
        out[f"rs sync {dtype}"] = torch.equal(cm.reduce_scatter(xs[rank].view(n * 10, 100)),
                                              want.view(n * 10, 100).chunk(n)[rank])
        native = torch.empty(1000, dtype=dtype)
        dist.reduce_scatter_tensor(native, xs[rank].clone())
        # gloo sums in its own order: equal at 2 ranks (a + b = b + a); at 4 the two orders' n-1 roundings
        # differ by at most n-1 half-units in the last place of the largest partial sum each: 2^-24 (fp32)
        # or 2^-8 (bf16) of max |sum|, doubled for partial sums above the final one.
        eps = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
        tol = 0.0 if n == 2 else 2 * (n - 1) * eps * float(want.abs().max())
        out[f"rs close to gloo {dtype}"] = torch.allclose(mine.float(), native.float(), rtol=0, atol=tol)
        full = torch.zeros(n * 1000, dtype=dtype)
        full.view(n, 1000)[rank].copy_(xs[rank][:1000])
        cm.all_gather_into(full, full.view(n, 1000)[rank], async_op=True).wait()  # in place, as ZeRO's buckets
        out[f"ag {dtype}"] = torch.equal(full, torch.cat([x[:1000] for x in xs]))
        out[f"ag sync {dtype}"] = torch.equal(cm.all_gather(xs[rank][:1000].view(10, 100), dim=1),
                                              torch.cat([x[:1000].view(10, 100) for x in xs], dim=1))
    # Two in flight at once on the same pairs: matched in posting order.
    a, b = torch.empty(1000), torch.empty(1000)
    w1 = cm.reduce_scatter_into(a, torch.full((n * 1000,), 1.0), async_op=True)
    w2 = cm.reduce_scatter_into(b, torch.full((n * 1000,), 2.0), async_op=True)
    w2.wait()
    w1.wait()
    out["two in flight"] = torch.equal(a, torch.full((1000,), float(n))) and torch.equal(b, torch.full_like(b, 2.0 * n))
    native_comm = C.Comm(dist.group.WORLD, C.CommLedger())
    native_comm.pairwise = False  # gloo's own all-gather in place: comm.py hands it a copy of the shard
    full = torch.zeros(n * 1000)
    full.view(n, 1000)[rank].fill_(rank + 1.0)
    native_comm.all_gather_into(full, full.view(n, 1000)[rank], async_op=True).wait()
    out["native in place"] = torch.equal(full, torch.arange(1.0, n + 1).repeat_interleave(1000))
    out["one rank group: native"] = not pairwise.usable(None)
    return out


def test_pairwise_collectives_match_gloo_at_2_and_4_ranks():
    for world in (2, 4):
        for r in run_distributed(_pairwise_against_gloo, world, timeout=60):
            assert all(r.values()), (world, {k: v for k, v in r.items() if not v})


def _ok_then_teardown_crash(crash_rank: int) -> int:
    import atexit
    import os

    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == crash_rank:  # as "terminate called without an active exception" after the result
        atexit.register(os._exit, 134)
    return rank


def _error_on(bad_rank: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError("rank failed before its result")
    return dist.get_rank()


def test_harness_takes_a_teardown_crash_after_an_ok_result_but_not_a_failure():
    """run_distributed: a rank dying in teardown after writing its result is not a failed run; a rank
    that raised is, and names itself."""
    assert run_distributed(_ok_then_teardown_crash, 2, args=(1,), timeout=60) == [0, 1]
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_distributed(_error_on, 2, args=(1,), timeout=60)
