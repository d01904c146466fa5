"""Float8 operands of a sharded linear = the matching slices of one process's, bit for bit (issue 35).

Oracle: the one-device float8 ``Linear`` on one process with the whole x [M, K], W [N, K] and dY [M, N].
On two gloo ranks each rank runs the model's own layer on its block, switched to float8 as models/fp8.py
does (``ColumnParallelLinear``: N split; the same with sequence parallelism, x arriving as its sequence
shard and gathered in float8; ``RowParallelLinear``: K split; a ``Linear`` under context parallelism: the
tokens M split) and every ``_scaled_mm`` call's float8 operands and scales (forward, dgrad, wgrad) are
compared with the one-process call's, sliced where the rank holds a block. The tensors have one large
element on one rank's block only, so a scale taken from a rank's own block instead of the whole tensor
(no amax all-reduce) fails the comparison. Delayed scaling: the rank's amax history equals one process's.

The gathers' bytes are the formula (ledger): under sequence parallelism x moves as float8 (1 byte an
element) in forward and again in backward (tensorwise, delayed), rowwise adds the rows' fp32 scales in
forward and gathers the high-precision x in backward (its wgrad scales x's columns over the tokens); each
amax all-reduce is 4 bytes per scale.

The routed experts' grouped GEMMs (layers/fp8_expert_gemm.py ``fp8_grouped_linear``), the same way: 4
experts (one with no rows) given one process's x [Mp, K], w [E, N, K] and dY blocks, split as expert tensor
parallelism splits the up projection (N: W's rows, dY's columns) and the down projection (K: x's and W's
columns), and as context parallelism (or tp's sequence chunks with whole experts) splits an expert's rows:
every grouped GEMM's float8 operands and scales (per expert or per row/feature) equal one process's slices.
"""

from __future__ import annotations

import pytest
import torch

from mpformer.parallel.spawn import run_distributed

RECIPES = ("tensorwise", "rowwise", "delayed")
S, B, K, N = 16, 4, 64, 64  # M = S * B = 64 tokens; every block a multiple of 16
T = 2
Slices = tuple[tuple[slice, slice], tuple[slice, slice]]  # (a8's rows, cols), (b8's rows, cols)


def _blocks(rank: int) -> tuple[slice, slice, slice]:
    m, k, n = S * B // T, K // T, N // T
    return slice(rank * m, (rank + 1) * m), slice(rank * k, (rank + 1) * k), slice(rank * n, (rank + 1) * n)


def _slices(layout: str, rank: int) -> list[Slices]:
    """Per GEMM (forward, dgrad, wgrad), which block of one process's operands this rank's are."""
    mb, kb, nb = _blocks(rank)
    a = slice(None)
    if layout in ("column", "column_sp"):  # W rows, dY columns split
        return [((a, a), (a, nb)), ((a, nb), (nb, a)), ((nb, a), (a, a))]
    if layout == "row":  # x and W columns split
        return [((a, kb), (kb, a)), ((a, a), (a, kb)), ((a, a), (a, kb))]
    return [((mb, a), (a, a)), ((mb, a), (a, a)), ((a, mb), (mb, a))]  # cp: the tokens split


def _tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, K, generator=g) * torch.logspace(-2, 1, K)  # columns of different ranges
    w = torch.randn(N, K, generator=g) * 0.05
    dy = torch.randn(S, B, N, generator=g) * 1e-3
    x[S - 1, B - 1, K - 1] = 300.0  # the last rank's block only (tokens, K): its amax is the whole tensor's
    w[N - 1, K - 1] = 2.0
    dy[S - 1, B - 1, N - 1] = 0.5
    return x, w, dy


def _layer(kind: str, comm, recipe_name: str, w: torch.Tensor):
    """The model's own layer for ``kind``, switched to float8 as models/fp8.py does (its ``fp8_split``)."""
    from mpformer.layers.fp8 import Float8Recipe
    from mpformer.layers.linear import Linear
    from mpformer.layers.parallel import ColumnParallelLinear, RowParallelLinear
    from mpformer.parallel.tensor_parallel import Part, TPContext

    tokens = ()
    if kind in ("column", "column_sp"):
        m = ColumnParallelLinear(K, [Part("w", N)], TPContext(comm, sequence_parallel=kind == "column_sp"), bias=False)
    elif kind == "row":
        m = RowParallelLinear(K, N, TPContext(comm), bias=False)
    else:  # one device, or context parallelism: the tokens split over ``comm``
        m = Linear(K, N, bias=False)
        tokens = (comm,) if kind == "cp" else ()
    with torch.no_grad():
        m.weight.copy_(w)
    m.enable_fp8(Float8Recipe(recipe_name), tokens)
    return m


def _run(m, x: torch.Tensor, dy: torch.Tensor) -> list:
    """Every _scaled_mm call (forward, dgrad, wgrad) of ``m``'s forward and backward, its operands cloned."""
    calls, real = [], torch._scaled_mm

    def capture(a, b, scale_a, scale_b, out_dtype):
        calls.append(tuple(t.clone() for t in (a, b, scale_a, scale_b)))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    torch._scaled_mm = capture
    try:
        m(x.clone().requires_grad_()).backward(dy)
    finally:
        torch._scaled_mm = real
    assert len(calls) == 3
    return calls


def _worker(recipe_name: str) -> dict:
    import torch.distributed as dist

    from mpformer.parallel.comm import Comm, CommLedger

    rank = dist.get_rank()
    x, w, dy = _tensors()
    one = _layer("one", None, recipe_name, w)
    ref = _run(one, x, dy)
    _, kb, nb = _blocks(rank)
    sb = slice(rank * S // T, (rank + 1) * S // T)  # the sequence shard (dim 0 of [S, B, K])
    out: dict = {"mismatch": [], "ledger": {}}
    for layout in ("column", "column_sp", "row", "cp"):
        ledger = CommLedger()
        comm = Comm(dist.group.WORLD, ledger)
        wx, xx, dyx = {"column": (w[nb], x, dy[..., nb]), "column_sp": (w[nb], x[sb], dy[..., nb]),
                       "row": (w[:, kb], x[..., kb], dy), "cp": (w, x[sb], dy[sb])}[layout]
        m = _layer(layout, comm, recipe_name, wx)
        got = _run(m, xx, dyx)
        out["ledger"][layout] = ledger.take()
        for gemm, (mine, theirs, (sa, sb_)) in enumerate(zip(got, ref, _slices(layout, rank), strict=True)):
            a8, b8, scale_a, scale_b = mine
            ra8, rb8, rsa, rsb = theirs
            want = [ra8[sa], rb8[sb_], rsa[sa[0]] if rsa.dim() == 2 else rsa, rsb[:, sb_[1]] if rsb.dim() == 2 else rsb]
            for name, g, r in zip(("a8", "b8", "scale_a", "scale_b"), (a8, b8, scale_a, scale_b), want, strict=True):
                same = g.shape == r.shape and torch.equal(g.contiguous().view(torch.uint8) if g.element_size() == 1
                                                          else g, r.contiguous().view(torch.uint8)
                                                          if r.element_size() == 1 else r)
                if not same:
                    out["mismatch"].append(f"{layout} gemm {gemm} {name}")
        if recipe_name == "delayed" and not torch.equal(m.fp8_amax_history, one.fp8_amax_history):
            out["mismatch"].append(f"{layout} amax history")
    return out


EXPERT_ROWS = (32, 64, 0, 32)  # per expert, one process; each rank holds half of each expert's rows (cp)


def _expert_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    m, e = sum(EXPERT_ROWS), len(EXPERT_ROWS)
    x = torch.randn(m, K, generator=g) * torch.logspace(-2, 1, K)
    w = torch.randn(e, N, K, generator=g) * 0.05
    dy = torch.randn(m, N, generator=g) * 1e-3
    x[95, K - 1] = 300.0  # expert 1's last row (rank 1's half of its rows), the last rank's K block
    w[1, N - 1, K - 1] = 2.0  # the last rank's N and K blocks
    dy[95, N - 1] = 0.5
    return x, w, dy


def _expert_rows(rank: int) -> torch.Tensor:
    """One process's rows that this rank holds when each expert's rows are split in two (cp)."""
    out, at = [], 0
    for c in EXPERT_ROWS:
        out += list(range(at + rank * c // T, at + (rank + 1) * c // T))
        at += c
    return torch.tensor(out, dtype=torch.long)


def _run_experts(x, w, dy, counts, recipe_name: str, shards) -> tuple[list, torch.Tensor | None]:
    """Every grouped GEMM's (forward, dgrad, wgrad) float8 operands and scales, and the delayed history."""
    import mpformer.layers.fp8_expert_gemm as fp8x
    from mpformer.layers.fp8 import Float8Recipe

    recipe = Float8Recipe(recipe_name)
    state = None
    if recipe_name == "delayed":
        state = fp8x.expert_states(recipe, *fp8x.expert_scaling_buffers(recipe, w.shape[0], "cpu"))[0]
    calls, rows, wgrad = [], fp8x.mm_rows, fp8x.mm_wgrad

    def cap(real):
        def f(a8, sa, b8, sb, g, method, out_dtype):
            calls.append(tuple(t.clone() for t in (a8, sa, b8, sb)))
            return real(a8, sa, b8, sb, g, method, out_dtype)
        return f

    fp8x.mm_rows, fp8x.mm_wgrad = cap(rows), cap(wgrad)
    try:
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        g = fp8x.Groups.of(list(counts), x.device)
        fp8x.fp8_grouped_linear(xx, ww, g, recipe, state, out_dtype=torch.float32 if recipe_name != "rowwise"
                                else torch.bfloat16, shards=shards).backward(dy.to(torch.float32 if recipe_name
                                                                                  != "rowwise" else torch.bfloat16))
    finally:
        fp8x.mm_rows, fp8x.mm_wgrad = rows, wgrad
    assert len(calls) == 3
    return calls, state.amax_history.clone() if state is not None else None


def _expert_slices(layout: str, rank: int) -> list[list]:
    """Per GEMM, how each of (a8, scale_a, b8, scale_b) of this rank is cut from one process's: an index
    per dim (None: whole), the scales' by their rank in the recipe (rows [Mp], per-feature [E, n], [E])."""
    _, kb, nb = _blocks(rank)
    mb, a = _expert_rows(rank), slice(None)
    if layout == "n":  # the up projection under etp: W's rows (N), dY's columns
        return [[(a, a), "same", (a, a, nb), ("feat", nb)], [(a, nb), "same", (a, nb, a), "same"],
                [(a, nb), ("feat", nb), (a, a), "same"]]
    if layout == "k":  # the down projection under etp: x's and W's columns (K)
        return [[(a, kb), "same", (a, kb, a), "same"], [(a, a), "same", (a, a, kb), ("feat", kb)],
                [(a, a), "same", (a, kb), ("feat", kb)]]
    return [[(mb, a), ("rows", mb), (a, a, a), "same"], [(mb, a), ("rows", mb), (a, a, a), "same"],
            [(mb, a), "same", (mb, a), "same"]]  # tokens: an expert's rows split


def _cut(t: torch.Tensor, how) -> torch.Tensor:
    if isinstance(how, tuple) and how and how[0] in ("feat", "rows"):
        if how[0] == "rows":
            return t[how[1]] if t.dim() == 1 and t.shape[0] == sum(EXPERT_ROWS) else t
        return t[:, how[1]] if t.dim() == 2 else t
    if how == "same":
        return t
    for d, i in enumerate(how):
        t = t.index_select(d, i) if isinstance(i, torch.Tensor) else t[(slice(None),) * d + (i,)]
    return t


def _expert_worker(recipe_name: str) -> list[str]:
    import torch.distributed as dist

    from mpformer.layers.fp8_linear import Fp8Shards
    from mpformer.parallel.comm import Comm, CommLedger

    rank = dist.get_rank()
    x, w, dy = _expert_tensors()
    ref, ref_hist = _run_experts(x, w, dy, EXPERT_ROWS, recipe_name, Fp8Shards())
    _, kb, nb = _blocks(rank)
    comm = Comm(dist.group.WORLD, CommLedger())
    mismatch = []
    for layout in ("n", "k", "tokens"):
        mb = _expert_rows(rank)
        xx, ww, dyx, counts, shards = {
            "n": (x, w[:, nb], dy[:, nb], EXPERT_ROWS, Fp8Shards(n=comm)),
            "k": (x[:, kb], w[:, :, kb], dy, EXPERT_ROWS, Fp8Shards(k=comm)),
            "tokens": (x[mb], w, dy[mb], [c // T for c in EXPERT_ROWS], Fp8Shards(tokens=(comm,)))}[layout]
        got, hist = _run_experts(xx.contiguous(), ww.contiguous(), dyx.contiguous(), counts, recipe_name, shards)
        for gemm, (mine, theirs, cuts) in enumerate(zip(got, ref, _expert_slices(layout, rank), strict=True)):
            for name, g, r, how in zip(("a8", "scale_a", "b8", "scale_b"), mine, theirs, cuts, strict=True):
                r = _cut(r, how)
                if g.shape != r.shape or not torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                                                         r.contiguous().view(torch.uint8) if r.element_size() == 1
                                                         else r.contiguous()):
                    mismatch.append(f"experts {layout} gemm {gemm} {name}")
        if hist is not None and not torch.equal(hist, ref_hist):
            mismatch.append(f"experts {layout} amax history")
    return mismatch


def _all_recipes() -> dict:
    return {r: {**_worker(r), "experts": _expert_worker(r)} for r in RECIPES}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_recipes, T, timeout=300)


@pytest.mark.parametrize("recipe", RECIPES)
def test_sharded_operands_equal_one_process_slices(results, recipe):
    for rank in range(T):
        assert results[rank][recipe]["mismatch"] == [], (rank, results[rank][recipe]["mismatch"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_expert_operands_equal_one_process_slices(results, recipe):
    for rank in range(T):
        assert results[rank][recipe]["experts"] == [], (rank, results[rank][recipe]["experts"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_gather_bytes_are_the_formula(results, recipe):
    """Sequence parallelism's gathers and the amax all-reduces, in bytes sent per rank (ring: (t-1)/t)."""
    m, f = S * B, (T - 1) / T
    ledger = results[0][recipe]["ledger"]["column_sp"]
    if recipe == "rowwise":  # float8 x + its rows' scales forward, the fp32 x again in backward
        gathers = (m * K * 1 + m * 4) * f + m * K * 4 * f
        reduces = 2 * f * (m + K) * 4  # dgrad: dY rows and W columns, amaxes along N (split)
    else:  # float8 x forward and backward; amaxes of x (over seq), W and dY (over N)
        gathers = 2 * m * K * 1 * f
        reduces = 3 * 2 * f * 4
    assert ledger.get("all_gather", 0) == gathers, ledger
    assert ledger.get("all_reduce", 0) == reduces, ledger
    out = 2 if recipe == "rowwise" else 4  # dX in the GEMM's output dtype: rowwise bf16, else x's fp32 here
    assert ledger.get("reduce_scatter", 0) == m * K * out * f, ledger  # dX back to the sequence shards
