"""The all-to-all and all-gather token dispatchers on 2 and 4 gloo ranks, one spawn each.

Oracle: one process applying f_e(x) = x * w_e + e (w_e = e + 1) to every slot with its global expert id,
on the all-gathered tokens and choices. Checked: the per-slot outputs exactly, the gradients of the
tokens and of the per-expert weight (1e-6), the ledger against layers/moe_dispatch.py's formulas, and,
at 4 ranks, the ep and expert_data views of ProcessGroups (core/topology.py expert_groups)."""

from __future__ import annotations

import pytest

from mpformer.parallel.spawn import run_distributed

T, K, H = 8, 2, 3  # tokens per rank, slots per token, hidden; T*K divisible by E (the uniform case)
CASES = ("random", "one_rank", "uniform")


def _routing(case: str, n: int, E: int, gen) -> object:
    """[n, T, K] expert ids of every rank (the same on all ranks)."""
    import torch

    if case == "random":  # expert E-1 gets no token; rank 0 routes nothing to expert 0
        ids = torch.randint(0, E - 1, (n, T, K), generator=gen)
        ids[0] = torch.randint(1, E - 1, (T, K), generator=gen)
    elif case == "one_rank":  # only rank 0's experts: the others receive nothing and send only there
        ids = torch.randint(0, E // n, (n, T, K), generator=gen)
    else:  # every rank sends S/ep slots to every rank
        ids = torch.stack([(torch.arange(T * K) + r) % E for r in range(n)]).view(n, T, K)
    return ids


def _check_dispatchers(comm, case: str, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    from mpformer.layers.moe_dispatch import AllGatherDispatcher, AllToAllDispatcher, alltoall_bytes, dispatch_bytes

    n, me = comm.size, comm.rank
    E, El = 2 * n, 2
    gen = torch.Generator().manual_seed(seed)
    x_own = torch.randn(T, H, generator=torch.Generator().manual_seed(seed * 100 + dist.get_rank()),
                        dtype=torch.float64)
    ids_own = _routing(case, n, E, gen)[me].contiguous()
    g_own = torch.randn(T * K, H, generator=torch.Generator().manual_seed(seed * 100 + 50 + dist.get_rank()),
                        dtype=torch.float64)
    # The reference's inputs: every ep rank's tokens, choices and upstream gradients, all-gathered.
    xs, idss, gs = ([torch.empty_like(t) for _ in range(n)] for t in (x_own, ids_own, g_own))
    for out, t in ((xs, x_own), (idss, ids_own), (gs, g_own)):
        dist.all_gather(out, t, group=comm.group)
    X, IDS, G = torch.cat(xs), torch.cat(idss).view(-1), torch.cat(gs)
    w0 = (torch.arange(E, dtype=torch.float64) + 1).unsqueeze(1).expand(E, H).contiguous()
    ref_x, ref_w = X.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = ref_x.repeat_interleave(K, 0) * ref_w[IDS] + IDS.unsqueeze(1)
    ref.backward(G)
    rows = slice(me * T * K, (me + 1) * T * K)
    mine = slice(me * El, (me + 1) * El)
    send = [int(((ids_own // El) == j).sum()) for j in range(n)]
    recv = [int(((idss[s] // El) == me).sum()) for s in range(n)]
    out: dict = {"send": send, "recv": recv, "own": torch.bincount(ids_own.view(-1), minlength=E).tolist(),
                 "all": torch.bincount(IDS, minlength=E).tolist()}
    outs = {}
    for cls in (AllToAllDispatcher, AllGatherDispatcher):
        name = cls.__name__
        comm.ledger.take()
        d = cls(comm, E)
        x, w = x_own.clone().requires_grad_(), w0.clone().requires_grad_()
        x_mh, counts = d.dispatch(x, ids_own)
        e_m = d.first_expert + torch.repeat_interleave(torch.arange(El), torch.tensor(counts, dtype=torch.int64))
        y = d.combine(x_mh * w[e_m] + e_m.unsqueeze(1).to(x_mh.dtype))
        fwd = comm.ledger.take()
        y.backward(g_own)
        bwd = comm.ledger.take()
        outs[name] = (x_mh.detach(), counts)
        out[name] = {
            "values": torch.equal(y.detach(), ref.detach()[rows]),
            "counts": counts == torch.bincount(IDS, minlength=E)[mine].tolist(),
            "grad_x": (x.grad - ref_x.grad[me * T:(me + 1) * T]).abs().max().item(),
            "grad_w": (w.grad[mine] - ref_w.grad[mine]).abs().max().item(),
            "grad_w_elsewhere": w.grad[torch.arange(E) // El != me].abs().max().item(),
            "fwd": fwd, "bwd": bwd,
        }
        if name == "AllToAllDispatcher":
            want_f = alltoall_bytes(send, H, 8, rank=me) + alltoall_bytes(recv, H, 8, rank=me) + (n - 1) * El * 8
            want = {"fwd": want_f, "bwd": alltoall_bytes(recv, H, 8, rank=me) + alltoall_bytes(send, H, 8, rank=me)}
            kind = "alltoall"
        else:
            kind = "allgather"
            want = {}
        uni = dispatch_bytes(kind, T, K, H, n, 8, num_experts=E)
        if kind == "allgather" or case == "uniform":  # the uniform formula is exact here
            want = {"fwd": uni["forward"], "bwd": uni["backward"]}
        out[name]["ledger"] = (sum(fwd.values()) == want["fwd"] and sum(bwd.values()) == want["bwd"], fwd, bwd, want)
    a, g = outs["AllToAllDispatcher"], outs["AllGatherDispatcher"]
    out["same_rows"] = torch.equal(a[0], g[0]) and a[1] == g[1]
    return out


def _view_members() -> dict:
    import torch
    import torch.distributed as dist

    from mpformer.core.layout import ParallelLayout
    from mpformer.core.topology import expert_groups
    from mpformer.parallel.device import resolve_device
    from mpformer.parallel.groups import ProcessGroups

    rank, out = dist.get_rank(), {}
    for layout in (ParallelLayout(dp=4, ep=2), ParallelLayout(dp=2, cp=2, ep=2), ParallelLayout(tp=2, dp=2, ep=2)):
        groups = ProcessGroups.build(layout, resolve_device("cpu"))
        ep_lists, edp_lists = expert_groups(layout.topology, layout.ep)
        got = {}
        for name, lists in (("ep", ep_lists), ("expert_data", edp_lists)):
            comm = groups.view(name)
            members = [rank] if comm.group is None else sorted(dist.get_process_group_ranks(comm.group))
            t = torch.tensor([float(rank)])
            comm.all_reduce(t)
            expect = next(g for g in lists if rank in g)
            got[name] = (members == expect, comm.size == len(expect), t.item() == sum(expect), members)
        got["tags"] = (groups.view("ep").tag, groups.view("expert_data").tag)
        out[(layout.tp, layout.cp, layout.dp)] = got
        if layout.tp == 1 and layout.cp == 1:  # the dispatchers over an ep view (two groups side by side)
            out["ep_view"] = _check_dispatchers(groups.view("ep"), "random", seed=7)
    return out


def _worker() -> dict:
    import torch.distributed as dist

    from mpformer.parallel.comm import Comm, CommLedger

    comm = Comm(dist.group.WORLD, CommLedger(), tag="ep.")
    out = {case: _check_dispatchers(comm, case, seed=i + 1) for i, case in enumerate(CASES)}
    if dist.get_world_size() == 4:
        out["views"] = _view_members()
    return out


def _assert_dispatch(res: dict, where: str) -> None:
    for name in ("AllToAllDispatcher", "AllGatherDispatcher"):
        r = res[name]
        assert r["values"] and r["counts"], (where, name)
        assert r["grad_x"] < 1e-6 and r["grad_w"] < 1e-6 and r["grad_w_elsewhere"] == 0, (where, name, r)
        assert r["ledger"][0], (where, name, r["ledger"])
    assert res["same_rows"], where


@pytest.mark.parametrize("world", [2, 4])
def test_dispatchers_match_one_process(world):
    results = run_distributed(_worker, world, timeout=90)
    for rank, res in enumerate(results):
        for case in CASES:
            _assert_dispatch(res[case], f"rank {rank} {case}")
        one = res["one_rank"]
        if rank > 0:  # nothing reaches this rank's experts, and it sends to rank 0 only
            assert one["recv"] == [0] * world and one["send"][1:] == [0] * (world - 1)
        rnd = res["random"]
        assert rnd["all"][-1] == 0 and (rank > 0 or rnd["own"][0] == 0)  # an idle expert; rank 0 skips expert 0
        if world == 4:
            views = res["views"]
            for key in ((1, 1, 4), (1, 2, 2), (2, 1, 2)):
                for name in ("ep", "expert_data"):
                    assert all(views[key][name][:3]), (rank, key, name, views[key][name])
                assert views[key]["tags"] == ("ep.", "edp."), key
            _assert_dispatch(views["ep_view"], f"rank {rank} ep view")
    assert results[0]["random"]["recv"] != [0] * world  # the random case moves rows
