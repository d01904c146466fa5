"""The routed experts' GEMMs in float8 (issue 35): each expert's fused gate/up and down projection,
forward, dgrad and wgrad, over rows already grouped by expert (layers/expert_gemm.py's layout).

Shapes, per expert e with its rows (tokens) r_e, padded (below) to P_e rows; Mp = sum P_e::

    forward   y  [Mp, n] : y[r_e]  = x[r_e]  [P_e, k] @ w[e]^T [k, n]
    dgrad     dx [Mp, k] : dx[r_e] = dy[r_e] [P_e, n] @ w[e]   [n, k]
    wgrad     dw [E, n, k]: dw[e]  = dy[r_e]^T [n, P_e] @ x[r_e] [P_e, k]

Two ways to run them (``choose_fp8_method``), one set of operands:

    grouped  ``torch._scaled_grouped_mm`` (CUDA sm90, one launch for every expert). Its rules in torch 2.13
             (``torch/_meta_registrations.py`` ``_meta_grouped_mm_common``, the CUDA kernel's checks): both
             operands float8_e4m3fn (no e5m2: a grouped dY is e4m3), a row-major, b column-major, 16-byte
             strides, fp32 scales *per row of a and per column of b* (forward/dgrad: a 1-D [Mp] and b [E, n];
             wgrad, 2-D x 2-D over ``offs``: [E*n] and [E*k]), bf16 out. There is no CPU kernel in torch
             2.13 (``NotImplementedError ... 'CPU' backend``, measured), and no e5m2.
    loop     ``torch._scaled_mm`` per expert on the same float8 operands and scales (one scale per expert for
             tensorwise and delayed, the rowwise vectors otherwise): CPU, and CUDA where the grouped kernel
             cannot take the recipe (e5m2 gradients: ``train.fp8.grad_dtype=auto`` under tensorwise and delayed).

Scales, so that each element is cast as one process without expert parallelism casts it (an expert's rows
after dispatch are the same tokens wherever the expert runs):
- tensorwise: one scale per expert weight and one per expert's token block (x, the activation, dy);
- rowwise: per token row and per weight output column for forward and dgrad (amax along the contraction),
  per (expert, feature) over the expert's tokens for wgrad; every GEMM re-casts, as layers/fp8.py says;
- delayed: ``ExpertScalingState``, one amax history per expert and role (DelayedScalingState's rules,
  vectorised over experts), for each of the two projections.
A per-tensor scale reaches the grouped kernel as its row and column vectors filled with that scale: the
same products, so the two methods give the same float8 operands.

Padding: ``_scaled_mm``/``_scaled_grouped_mm`` on CUDA need K and N of every GEMM in multiples of 16, and
the wgrad contracts over an expert's tokens, which the router makes any number (the grouped kernel also
wants each group's rows 16-aligned). Every expert's block is padded with zero rows to a multiple of 16
once, before the up projection (Megatron-Core's and Transformer Engine's fp8 grouped GEMMs do the same):
zero rows have amax 0 (no scale changes), stay zero through silu(gate) * up, give zero output rows
(dropped) and zero gradients, so they add nothing to any sum. An expert with no tokens keeps 0 rows; its
weight gradient is zero by definition.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mpformer.core.shards import Shard
from mpformer.layers.fp8 import ALIGN, ROLES, Float8Recipe, cast_to_fp8, scale_from_amax
from mpformer.layers.fp8_linear import ONE, Fp8Shards, scaled_mm
from mpformer.parallel.device import autocast_dtype, host_tensor, kernel_device, no_autocast

E4M3 = torch.float8_e4m3fn
FP8_METHODS = ("grouped", "loop")


def fp8_grouped_ok(device_type: str, recipe: Float8Recipe, h: int, f: int,
                   out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs this recipe: CUDA (or a rehearsal's meta), e4m3 gradients,
    h and f multiples of 16, bf16 out."""
    return (device_type in ("cuda", "meta") and hasattr(torch, "_scaled_grouped_mm") and recipe.grad == "e4m3"
            and h % ALIGN == 0 and f % ALIGN == 0 and out_dtype == torch.bfloat16)


def choose_fp8_method(device_type: str, recipe: Float8Recipe, h: int, f: int,
                      out_dtype: torch.dtype = torch.bfloat16) -> str:
    """``grouped`` where the fused kernel runs (see ``fp8_grouped_ok``), else ``loop`` (CPU: no kernel)."""
    return "grouped" if fp8_grouped_ok(device_type, recipe, h, f, out_dtype) else "loop"


@dataclass(frozen=True)
class Groups:
    """The padded rows' layout: ``counts`` rows per expert (host ints, multiples of ALIGN), ``ids`` [Mp]
    each row's expert and ``offs`` [E] int32 the groups' ends (on the device, built from host ints)."""

    counts: tuple[int, ...]
    ids: torch.Tensor
    offs: torch.Tensor

    @staticmethod
    def of(counts: list[int], device: torch.device) -> Groups:
        ends, total = [], 0
        for c in counts:
            total += c
            ends.append(total)
        e = torch.arange(len(counts), device=device)
        ids = torch.repeat_interleave(e, host_tensor(counts, torch.int64, device), output_size=total)
        return Groups(tuple(counts), ids, host_tensor(ends, torch.int32, device))

    @property
    def bounds(self) -> list[tuple[int, int, int]]:
        """(expert, first row, end row) of every expert with rows."""
        out, at = [], 0
        for e, c in enumerate(self.counts):
            if c:
                out.append((e, at, at + c))
            at += c
        return out

    def amax(self, t: torch.Tensor) -> torch.Tensor:
        """[E]: each group's amax of |t| (t [Mp, n]); 0 for a group of no rows."""
        rows = t.detach().abs().amax(-1).float() if t.shape[-1] else t.new_zeros(t.shape[0], dtype=torch.float32)
        out = torch.zeros(len(self.counts), device=t.device)
        return out.scatter_reduce(0, self.ids, rows, "amax")

    def col_amax(self, t: torch.Tensor) -> torch.Tensor:
        """[E, n]: each group's amax of |t| per column (t [Mp, n]), the amax along the group's rows."""
        out = torch.zeros(len(self.counts), t.shape[1], device=t.device)
        index = self.ids[:, None].expand(-1, t.shape[1])
        return out.scatter_reduce(0, index, t.detach().abs().float(), "amax")


def pad_rows(x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, Groups, torch.Tensor | None]:
    """``x`` [N, k] grouped by ``counts`` -> ([Mp, k] with every group zero-padded to a multiple of ALIGN,
    its Groups, the padded row of each of x's rows or None where nothing was padded). Differentiable."""
    padded = [-(-c // ALIGN) * ALIGN for c in counts]
    groups = Groups.of(padded, x.device)
    if padded == counts:
        return x, groups, None
    n, starts, pstarts, a, p = x.shape[0], [], [], 0, 0
    for c, pc in zip(counts, padded, strict=True):
        starts.append(a)
        pstarts.append(p)
        a, p = a + c, p + pc
    expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                     host_tensor(counts, torch.int64, x.device), output_size=n)
    shift = host_tensor([q - s for q, s in zip(pstarts, starts, strict=True)], torch.int64, x.device)
    dest = torch.arange(n, device=x.device) + shift[expert]
    return _Scatter.apply(x, dest, p), groups, dest


class _Scatter(torch.autograd.Function):
    """Rows of x [N, k] into zeros [P, k] at ``dest``; backward gathers them. Tensor.index_copy's autograd
    would keep ``x`` itself (it reads the source's shape), the whole bf16 [N, h] input, beside the float8
    copy the GEMM keeps; this keeps only the int64 ``dest``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(dest)
        return x.new_zeros(rows, x.shape[1]).index_copy_(0, dest, x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (dest,) = ctx.saved_tensors
        return g.index_select(0, dest), None, None


class ExpertScalingState:
    """Delayed scaling for E experts of one projection: ``amax_history`` [E, 3, H] (roles in ROLES order,
    newest at index 0) and ``scales`` [E, 3], views of the Experts module's buffers. Per expert, the rules of
    layers/fp8.py DelayedScalingState: a role's first use (history all zero) is scaled from its own amax,
    a non-finite amax is recorded as 0, the next scale is the history's max."""

    def __init__(self, recipe: Float8Recipe, amax_history: torch.Tensor, scales: torch.Tensor,
                 stash: collections.deque[torch.Tensor] | None = None,
                 replay: collections.deque[torch.Tensor] | None = None) -> None:
        self.recipe, self.amax_history, self.scales = recipe, amax_history, scales
        # inside a recomputed region (layers/fp8_layer.py recompute_contexts): the first forward appends
        # its forward scales to ``stash``, the recompute takes them from ``replay`` and records nothing
        self.stash, self.replay = stash, replay

    def scale_for(self, role: str, amax: torch.Tensor) -> torch.Tensor:
        """[E] scales this use of ``role`` casts with, given its per-expert amaxes [E]."""
        i = ROLES.index(role)
        fresh = scale_from_amax(torch.nan_to_num(amax.detach().float(), posinf=0.0), self.recipe.dtype(role),
                                self.recipe.margin)
        return torch.where(self.amax_history[:, i].amax(-1) > 0, self.scales[:, i], fresh)

    def record(self, role: str, amax: torch.Tensor) -> None:
        i = ROLES.index(role)
        with torch.no_grad():
            rows = self.amax_history[:, i]
            rows.copy_(torch.roll(rows, 1, dims=-1))
            a = amax.detach().float()
            rows[:, 0] = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
            self.scales[:, i] = scale_from_amax(rows.amax(-1), self.recipe.dtype(role), self.recipe.margin)


def absmax(t: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 max of |t| along ``dim`` as max(max t, -min t): two reductions, no |t| copy of an expert weight."""
    t = t.detach()
    return torch.maximum(t.amax(dim), t.amin(dim).neg()).float()


def cast_experts(w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w [E, n, k] cast expert by expert into one float8 tensor (``scales`` [E, ., .] broadcasting per
    expert): the eager cast's fp32 temporaries (layers/fp8.py cast_to_fp8: 8 bytes an element at its
    height) are one expert's, not all E_l experts' (Mixtral's 8 experts' up weights: 3.8 GB at once)."""
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    for e in range(w.shape[0]):
        out[e] = cast_to_fp8(w[e], scales[e], dtype)
    return out


def _per_tensor(amax: Callable[[], torch.Tensor], role: str, dtype: torch.dtype,
                recipe: Float8Recipe, state: ExpertScalingState | None, record: bool) -> torch.Tensor:
    """[E] scales of one tensor per expert from its amaxes [E] (``amax()``, taken over the shards): its own
    (tensorwise) or the history's; a recompute replays the first forward's (no amax, nothing recorded)."""
    forward = role != "grad_output"
    if state is not None and forward and state.replay is not None:
        return state.replay.popleft()
    a = amax()
    if state is None:
        return scale_from_amax(a, dtype, recipe.margin)
    scale = state.scale_for(role, a)
    if record:
        state.record(role, a)
        if forward and state.stash is not None:
            state.stash.append(scale)
    return scale


def mm_rows(a8: torch.Tensor, sa: torch.Tensor, b8: torch.Tensor, sb: torch.Tensor, g: Groups, method: str,
            out_dtype: torch.dtype) -> torch.Tensor:
    """[Mp, N]: a8[rows of e] [P_e, K] @ b8[e] [K, N] for every e, scales ``sa`` [E] or [Mp] (per row) and
    ``sb`` [E] or [E, N] (per column)."""
    per_tensor = sb.dim() == 1
    if method == "grouped":  # a row-major, b column-major; a per-tensor scale as its row and column vectors
        if per_tensor:
            sa, sb = sa[g.ids], sb[:, None].expand(-1, b8.shape[-1])
        b8 = b8.transpose(-2, -1).contiguous().transpose(-2, -1)
        return torch._scaled_grouped_mm(a8.contiguous(), b8, sa.contiguous(), sb.contiguous(), offs=g.offs,
                                        out_dtype=out_dtype)
    outs = []
    for e, s, t in g.bounds:
        ls, rs = (sa[e], sb[e]) if per_tensor else (sa[s:t, None], sb[e][None, :])
        outs.append(scaled_mm(a8[s:t], b8[e], ls, rs, out_dtype))
    return torch.cat(outs) if outs else a8.new_zeros(0, b8.shape[-1], dtype=out_dtype)


def mm_wgrad(dy8: torch.Tensor, sa: torch.Tensor, x8: torch.Tensor, sb: torch.Tensor, g: Groups, method: str,
             out_dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K]: dy8[rows of e]^T [N, P_e] @ x8[rows of e] [P_e, K], scales [E] each (per tensor) or
    ``sa`` [E, N] and ``sb`` [E, K] (per feature over the group's rows). Zero for a group of no rows."""
    E, n, k = len(g.counts), dy8.shape[1], x8.shape[1]
    if method == "grouped":  # 2-D x 2-D over offs: a [N, Mp] row-major, b [Mp, K] column-major
        sa = sa[:, None].expand(E, n) if sa.dim() == 1 else sa
        sb = sb[:, None].expand(E, k) if sb.dim() == 1 else sb
        dw = torch._scaled_grouped_mm(dy8.t().contiguous(), x8.t().contiguous().t(), sa.reshape(-1).contiguous(),
                                      sb.reshape(-1).contiguous(), offs=g.offs, out_dtype=out_dtype)
        for e, c in enumerate(g.counts):  # a view per expert: no index tensor, no host sync
            if c == 0:
                dw[e].zero_()
        return dw
    dw = torch.zeros(E, n, k, dtype=out_dtype, device=dy8.device)
    for e, s, t in g.bounds:
        ls, rs = (sa[e], sb[e]) if sa.dim() == 1 else (sa[e][:, None], sb[e][None, :])
        dw[e] = scaled_mm(dy8[s:t].t(), x8[s:t], ls, rs, out_dtype)
    return dw


class _Fp8GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ w[e]^T, its three GEMMs in float8 (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, g: Groups, recipe: Float8Recipe,
                state: ExpertScalingState | None, method: str, out_dtype: torch.dtype, record: bool,
                shards: Fp8Shards) -> torch.Tensor:
        if recipe.name == "rowwise":  # amaxes along K: split over the down projection's etp
            sx = scale_from_amax(shards.max(absmax(x, -1), "k"), E4M3, recipe.margin)  # [Mp]
            sw = scale_from_amax(shards.max(absmax(w, -1), "k"), E4M3, recipe.margin)  # [E, n]
            x8, w8 = cast_to_fp8(x, sx[:, None], E4M3), cast_experts(w, sw[..., None], E4M3)
            ctx.save_for_backward(x, w)
        else:
            sx = _per_tensor(lambda: shards.max(g.amax(x), "tokens", "k"), "input", E4M3, recipe, state, record)
            sw = _per_tensor(lambda: shards.max(absmax(w.flatten(1), -1), "k", "n"),
                             "weight", E4M3, recipe, state, record)
            x8, w8 = cast_to_fp8(x, sx[g.ids, None], E4M3), cast_experts(w, sw[:, None, None], E4M3)
            ctx.save_for_backward(x8, sx, w8, sw)
        ctx.g, ctx.recipe, ctx.state, ctx.method, ctx.out_dtype = g, recipe, state, method, out_dtype
        ctx.shards = shards
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return mm_rows(x8, sx, w8.transpose(-2, -1), sw, g, method, out_dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        g, recipe, method, out, shards = ctx.g, ctx.recipe, ctx.method, ctx.out_dtype, ctx.shards
        gdt = recipe.dtype("grad_output")  # e4m3 where the method is grouped (fp8_grouped_linear's rule)
        dy = dy.contiguous()
        dx = dw = None
        if recipe.name == "rowwise":
            x, w = ctx.saved_tensors
            if ctx.needs_input_grad[0]:  # amaxes along n: split over the up projection's etp
                sdy = scale_from_amax(shards.max(absmax(dy, -1), "n"), gdt, recipe.margin)  # [Mp]
                sw = scale_from_amax(shards.max(absmax(w, 1), "n"), E4M3, recipe.margin)
                dx = mm_rows(cast_to_fp8(dy, sdy[:, None], gdt), sdy, cast_experts(w, sw[:, None, :], E4M3), sw,
                             g, method, out)  # sw [E, k]
            if ctx.needs_input_grad[1]:  # amaxes along the group's rows: split over the token peers
                sdy = scale_from_amax(shards.max(g.col_amax(dy), "tokens"), gdt, recipe.margin)  # [E, n]
                sx = scale_from_amax(shards.max(g.col_amax(x), "tokens"), E4M3, recipe.margin)  # [E, k]
                dw = mm_wgrad(cast_to_fp8(dy, sdy[g.ids], gdt), sdy, cast_to_fp8(x, sx[g.ids], E4M3), sx,
                              g, method, out)
        else:
            x8, sx, w8, sw = ctx.saved_tensors
            sdy = _per_tensor(lambda: shards.max(g.amax(dy), "tokens", "n"), "grad_output", gdt, recipe,
                              ctx.state, True)
            dy8 = cast_to_fp8(dy, sdy[g.ids, None], gdt)
            if ctx.needs_input_grad[0]:
                dx = mm_rows(dy8, sdy, w8, sw, g, method, out)
            if ctx.needs_input_grad[1]:
                dw = mm_wgrad(dy8, sdy, x8, sx, g, method, out)
        dx = dx.to(ctx.x_dtype) if dx is not None else None
        dw = dw.to(ctx.w_dtype) if dw is not None else None
        return dx, dw, None, None, None, None, None, None, None


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, g: Groups, recipe: Float8Recipe,
                       state: ExpertScalingState | None = None, *, method: str = "loop",
                       out_dtype: torch.dtype = torch.bfloat16, shards: Fp8Shards = ONE) -> torch.Tensor:
    """x [Mp, k] (rows padded per ``g``) @ w[e]^T per expert (w [E, n, k]) -> [Mp, n], in float8 by ``recipe``
    (``state``: delayed scaling's, None otherwise) through ``method`` (FP8_METHODS). ``shards``: the groups
    splitting the operands, as layers/fp8_linear.py's (``tokens``: other ranks' rows of the same experts;
    ``n``/``k``: etp's split of the up / down projection); every amax is all-reduced (max) over them."""
    if (recipe.name == "delayed") != (state is not None):
        raise ValueError(f"fp8_grouped_linear: recipe {recipe.name!r} with state={type(state).__name__}: the "
                         "delayed recipe needs an ExpertScalingState, the others take none")
    if method not in FP8_METHODS:
        raise ValueError(f"fp8_grouped_linear: method {method!r} is not one of {FP8_METHODS}")
    if method == "grouped" and (recipe.grad != "e4m3" or out_dtype != torch.bfloat16):
        raise ValueError("fp8_grouped_linear: torch._scaled_grouped_mm takes e4m3 gradients and gives bf16 "
                         f"(recipe grad {recipe.grad!r}, out_dtype {out_dtype}); use method='loop'")
    record = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)  # as layers/fp8_linear.py
    return _Fp8GroupedLinear.apply(x, w, g, recipe, state, method, out_dtype, record, shards)


def _swiglu(y: torch.Tensor, f: int) -> torch.Tensor:
    gate, up = y.split(f, dim=-1)  # as layers/expert_gemm.py: split, not two slices
    return torch.nn.functional.silu(gate) * up


def fp8_expert_mlp(x_mh: torch.Tensor, counts: list[int], w_up: torch.Tensor, w_down: torch.Tensor,
                   recipe: Float8Recipe, states: tuple[ExpertScalingState, ExpertScalingState] | None = None, *,
                   method: str, out_dtype: torch.dtype = torch.bfloat16,
                   shards: tuple[Fp8Shards, Fp8Shards] = (ONE, ONE)) -> torch.Tensor:
    """layers/expert_gemm.py ``expert_mlp`` with both projections in float8: ``down_e(silu(gate_e) * up_e)``
    on each expert's rows of ``x_mh`` [N, h] (sorted by expert, ``counts`` host ints), [N, h] in
    ``out_dtype``. ``states``: the up and down projections' delayed-scaling states (delayed recipe only);
    ``shards``: the up and down projections' (fp8_grouped_linear)."""
    E, two_f, h = w_up.shape
    f = two_f // 2
    if w_down.shape != (E, h, f) or x_mh.dim() != 2 or x_mh.shape[1] != h or len(counts) != E:
        raise ValueError(f"fp8_expert_mlp: x {tuple(x_mh.shape)}, {len(counts)} counts, w_up {tuple(w_up.shape)} "
                         f"and w_down {tuple(w_down.shape)} are not [N, h], E, [E, 2f, h], [E, h, f]")
    counts = [int(c) for c in counts]
    if sum(counts) != x_mh.shape[0]:
        raise ValueError(f"fp8_expert_mlp: counts sum to {sum(counts)}, x has {x_mh.shape[0]} rows")
    up_state, down_state = states if states is not None else (None, None)
    xp, g, dest = pad_rows(x_mh.to(out_dtype), counts)
    a = _swiglu(fp8_grouped_linear(xp, w_up, g, recipe, up_state, method=method, out_dtype=out_dtype,
                                   shards=shards[0]), f)
    y = fp8_grouped_linear(a, w_down, g, recipe, down_state, method=method, out_dtype=out_dtype, shards=shards[1])
    return y if dest is None else y.index_select(0, dest)


PROJECTIONS = ("up", "down")  # the experts' two GEMMs: buffers [E, 2, 3, H] and [E, 2, 3] in this order


def expert_scaling_buffers(recipe: Float8Recipe, n: int, device: torch.device | str | None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh delayed-scaling state of ``n`` experts: amax histories [n, 2, 3, H] (zero: nothing seen) and
    scales [n, 2, 3] (1), per expert, projection (PROJECTIONS) and role (ROLES)."""
    return (torch.zeros(n, len(PROJECTIONS), len(ROLES), recipe.history_len, device=device),
            torch.ones(n, len(PROJECTIONS), len(ROLES), device=device))


def expert_states(recipe: Float8Recipe, history: torch.Tensor, scales: torch.Tensor,
                  stash: collections.deque[torch.Tensor] | None = None,
                  replay: collections.deque[torch.Tensor] | None = None
                  ) -> tuple[ExpertScalingState, ExpertScalingState]:
    """The two projections' states as views of the buffers (updates land in them); ``stash``/``replay``:
    one deque for both (their forward scales in call order)."""
    up, down = (ExpertScalingState(recipe, history[:, i], scales[:, i], stash, replay)
                for i in range(len(PROJECTIONS)))
    return up, down


def rescale(recipe: Float8Recipe, history: torch.Tensor, scales: torch.Tensor) -> None:
    """Every scale recomputed from its history (after the histories were all-reduced)."""
    with torch.no_grad():
        for i, role in enumerate(ROLES):
            scales[..., i] = scale_from_amax(history[..., i, :].amax(-1), recipe.dtype(role), recipe.margin)


def expert_fp8_shards(prefix: str, local: range, history: torch.Tensor, scales: torch.Tensor) -> dict[str, Shard]:
    """Delayed scaling's buffers by canonical name, per expert under the names a dense float8 linear's have
    (``{prefix}.{e}.up|down.fp8_amax_history`` [3, H], ``.fp8_scale`` [3]; ``up`` the fused gate/up GEMM,
    as models/fp8.py names ``mlp.up``): layout-free, whichever ep rank holds expert ``e``."""
    return {f"{prefix}.{e}.{p}.{b}": Shard.full(t[i, j]) for i, e in enumerate(local)
            for j, p in enumerate(PROJECTIONS) for b, t in (("fp8_amax_history", history), ("fp8_scale", scales))}


def experts_forward(x_mh: torch.Tensor, counts: list[int], w_up: torch.Tensor, w_down: torch.Tensor,
                    recipe: Float8Recipe, states: tuple[ExpertScalingState, ExpertScalingState] | None,
                    shards: tuple[Fp8Shards, Fp8Shards] = (ONE, ONE)) -> torch.Tensor:
    """layers/moe.py Experts' float8 forward: out in autocast's dtype (bf16 under train.precision=fp8), the
    method the device runs, delayed scaling's ``states`` (expert_states over the module's buffers)."""
    want = autocast_dtype(x_mh) or (x_mh.dtype if x_mh.dtype == torch.float32 else torch.bfloat16)
    out = torch.bfloat16 if recipe.name == "rowwise" else want  # CUDA's rowwise kernels write bf16 only
    # the device the GEMMs run on: a rehearsal's meta rows stand for a GPU's, and take its grouped kernel
    method = choose_fp8_method(kernel_device(x_mh), recipe, w_up.shape[-1], w_down.shape[-1], out)
    with no_autocast(x_mh):  # the casts and scales are the recipe's, not autocast's
        y = fp8_expert_mlp(x_mh, counts, w_up, w_down, recipe, states, method=method, out_dtype=out, shards=shards)
    return y if y.dtype == want else y.to(want)
