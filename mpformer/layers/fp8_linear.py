"""y = x W^T (+ b) with its three GEMMs in float8 through ``torch._scaled_mm`` (issue 35).

Shapes (x flattened to 2-D)::

    forward   y  [M, N] = x  [M, K] @ W^T [K, N]
    dgrad     dX [M, K] = dY [M, N] @ W   [N, K]
    wgrad     dW [N, K] = dY^T [N, M] @ x [M, K]

``_scaled_mm(a, b)`` on CUDA takes ``a`` row-major and ``b`` column-major, K and N multiples of 16;
each GEMM below passes its operands in that layout (a transposed view where the data already lies that
way, an fp8 copy where it does not: one byte an element). The CPU kernel takes any layout and size; the
same layouts run here so that the tested code is the GPU's.

Which casts are shared: under tensorwise and delayed scaling one scale covers a whole tensor, so x and W
are cast once in forward and saved in fp8 (half of bf16's bytes), and dY is cast once for both backward
GEMMs. Under rowwise scaling each GEMM contracts over a different dimension and the scales must lie
along the other two, so backward re-casts from the high-precision x, W and dY (x and W are saved as given).

Sharded operands (``Fp8Shards``): under tensor, sequence or context parallelism a rank holds a block of
x, W or dY. A scale is a function of an amax, so every amax is all-reduced (max) over the ranks holding
the other blocks of the same tensor (or of the same rows / columns, for rowwise scales): each element is
then cast exactly as one process casting the whole tensor would (Transformer Engine reduces its amaxes
over the tensor-parallel group the same way). Which dimension is split over which group:

    tokens (M)   context parallelism (every operand that has tokens: x, dY)
    K            a row-parallel layer's tp (x's columns, W's columns)
    N            a column-parallel layer's tp (W's rows, dY's columns)
    seq          sequence parallelism before a column-parallel layer: x arrives as this rank's sequence
                 shard (M / tp rows). It is cast here and all-gathered in float8 (half of bf16's bytes,
                 plus the rows' scales under rowwise), the float8 shard is what backward keeps and it is
                 gathered again there under the input-gradient GEMM; dX is reduce-scattered back to the
                 shard under the weight-gradient GEMM (layers/linear.py's ``_SplitLinear`` in bf16).
                 Rowwise backward needs x's columns scaled over the tokens, which a row-scaled float8 x
                 cannot give: it keeps and gathers the high-precision shard instead.

The split backward of the zero-bubble schedules: given a ``WeightGradStore`` that is capturing, backward
returns dX and queues the weight-gradient GEMM (its cast operands held by the job) for
``WeightGradStore.run``. ZeRO-3: given a gradient sink (layers/grad_store.py), dW and db are added into
the sink's buffer; a weight gathered in float8 (``set_fp8_weight``: the gathered float8 tensor and its
scale, tensorwise and delayed recipes) is used as it is, not cast again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpformer.layers.fp8 import ALIGN, DelayedScalingState, Float8Recipe, cast_to_fp8, scale_from_amax
from mpformer.layers.grad_store import GradSink, WeightGradStore, accumulate
from mpformer.parallel.comm import Comm

E4M3 = torch.float8_e4m3fn
_FP8_WEIGHT = "_mpformer_fp8_weight"


@dataclass(frozen=True)
class Fp8Shards:
    """Which groups split a linear's operands (see the module docstring): ``tokens`` split M, ``k`` K
    (row-parallel), ``n`` N (column-parallel); ``seq``: x arrives as this rank's sequence shard, gathered
    in float8 here. A group of one is the same as none."""

    tokens: tuple[Comm, ...] = ()
    k: Comm | None = None
    n: Comm | None = None
    seq: Comm | None = None

    def max(self, a: torch.Tensor, *dims: str) -> torch.Tensor:
        """Amaxes ``a`` all-reduced (max) over the groups splitting ``dims``."""
        return all_reduce_max(a, self.over(*dims))

    def over(self, *dims: str) -> tuple[Comm, ...]:
        """The groups of more than one rank splitting ``dims`` (of "tokens", "k", "n", "seq")."""
        out: list[Comm | None] = []
        for d in dims:
            out += list(self.tokens) if d == "tokens" else [getattr(self, d)]
        return tuple(c for c in out if c is not None and c.size > 1)


ONE = Fp8Shards()
# the groups each tensor's (tensorwise or delayed) amax spans
_ROLE_DIMS = {"input": ("tokens", "k", "seq"), "weight": ("k", "n"), "grad_output": ("tokens", "n")}


def set_fp8_weight(p: torch.Tensor, cast: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """``p`` is gathered in float8 (ZeRO-3): ``cast`` is (the float8 weight, its 0-d scale), None when freed."""
    setattr(p, _FP8_WEIGHT, cast)


def fp8_weight(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    return getattr(p, _FP8_WEIGHT, None)


def all_reduce_max(a: torch.Tensor, comms: tuple[Comm, ...]) -> torch.Tensor:
    """Amaxes ``a`` (fp32) all-reduced (max) over ``comms``: over the ranks holding the tensor's other blocks."""
    a = a.contiguous()
    for c in comms:
        c.all_reduce(a, op=dist.ReduceOp.MAX)
    return a


def amax(t: torch.Tensor, comms: tuple[Comm, ...], dim: int | None = None) -> torch.Tensor:
    """fp32 amax of ``t`` (along ``dim``, kept as a dim of 1; whole tensor: 0-d) all-reduced (max) over
    ``comms``: the amax of the whole tensor whose blocks those ranks hold."""
    a = t.detach().abs()
    return all_reduce_max((a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float(), comms)


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a8 * scale_a) @ (b8 * scale_b) in ``out_dtype``: a8 [M, K], b8 [K, N] float8, scales 0-d or
    [M, 1] / [1, N] fp32. Lays a8 out row-major and b8 column-major (no copy where they already are)."""
    a8 = a8.contiguous()
    b8 = b8.t().contiguous().t()
    return torch._scaled_mm(a8, b8, scale_a=scale_a.reshape(()) if scale_a.numel() == 1 else scale_a,
                            scale_b=scale_b.reshape(()) if scale_b.numel() == 1 else scale_b,
                            out_dtype=out_dtype)


def cast(t: torch.Tensor, role: str, recipe: Float8Recipe, state: DelayedScalingState | None,
         record: bool = True, comms: tuple[Comm, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for all of ``t`` (tensorwise, or delayed: the state's scale, then this amax recorded),
    its amax taken over ``comms`` too."""
    dtype = recipe.dtype(role)
    forward = role != "grad_output"
    if recipe.name == "delayed" and forward and state is not None and state.replay is not None:  # recomputed
        scale = state.replay.popleft()  # the first forward's, nothing recorded (every shard replays alike)
        return cast_to_fp8(t, scale, dtype), scale
    a = amax(t, comms)
    if recipe.name == "delayed":
        assert state is not None, "delayed scaling needs the layer's DelayedScalingState"
        scale = state.scale_for(role, a)
        t8 = cast_to_fp8(t, scale, dtype)
        if record:
            state.record(role, a)
            if forward and state.stash is not None:
                state.stash.append(scale)
        return t8, scale
    scale = scale_from_amax(a, dtype, recipe.margin)
    return cast_to_fp8(t, scale, dtype), scale


def rowwise_scale(t: torch.Tensor, dim: int, dtype: torch.dtype, margin: int,
                  comms: tuple[Comm, ...] = ()) -> torch.Tensor:
    """Scales of ``t`` (2-D) from its amaxes along ``dim`` (the contraction dimension; [M, 1] for ``dim=1``
    of a left operand, [1, N] for ``dim=0`` of a right one), over ``comms`` too."""
    return scale_from_amax(amax(t, comms, dim), dtype, margin).contiguous()


def rowwise_gemm(a: torch.Tensor, b: torch.Tensor, dtype_a: torch.dtype, dtype_b: torch.dtype, margin: int,
                 out_dtype: torch.dtype, comms: tuple[Comm, ...] = ()) -> torch.Tensor:
    """a [M, K] @ b [K, N] with a scaled per row and b per column (amaxes along K, split over ``comms``).
    Both scales first, then the casts: an amax's |t| temporary is gone before a float8 copy exists."""
    sa, sb = rowwise_scale(a, 1, dtype_a, margin, comms), rowwise_scale(b, 0, dtype_b, margin, comms)
    return scaled_mm(cast_to_fp8(a, sa, dtype_a), cast_to_fp8(b, sb, dtype_b), sa, sb, out_dtype)


def weight_grad(x8: torch.Tensor, x_scale: torch.Tensor, dy8: torch.Tensor, dy_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """dW [N, K] = dY^T @ x from operands cast with one scale each (tensorwise or delayed):
    x8 [M, K], dy8 [M, N]."""
    return scaled_mm(dy8.t(), x8, dy_scale, x_scale, out_dtype)


def weight_grad_rowwise(x2: torch.Tensor, dy2: torch.Tensor, recipe: Float8Recipe, out_dtype: torch.dtype,
                        comms: tuple[Comm, ...] = ()) -> torch.Tensor:
    """dW [N, K] = dY^T @ x under rowwise scaling: dY^T per row (an output feature's amax over the tokens),
    x per column (an input feature's amax over the tokens; ``comms`` split the tokens)."""
    return rowwise_gemm(dy2.t(), x2, recipe.dtype("grad_output"), E4M3, recipe.margin, out_dtype, comms)


def _check_tokens(m: int, k: int) -> None:
    # K and N are checked when the layer is built (fp8.check_fp8_dims); M is the wgrad GEMM's K.
    if m % ALIGN:
        raise ValueError(f"train.precision=fp8: a linear layer's input has {m} tokens (rows of [{m}, {k}]); "
                         f"float8 GEMMs need a multiple of {ALIGN} (micro_batch_size * seq_length / cp)")


def _gather8(t8: torch.Tensor, seq: Comm) -> torch.Tensor:
    """Every rank's float8 rows (dim 0), moved as bytes (collectives take no float8 dtype)."""
    return seq.all_gather(t8.view(torch.uint8), 0).view(t8.dtype)


def _into(sink: GradSink, p: torch.Tensor, g: torch.Tensor) -> None:
    sink.grad_buffer(p).add_(g)
    sink.grad_arrived(p)


class _Fp8Linear(torch.autograd.Function):
    """See the module docstring; ``out_dtype`` is every GEMM's output dtype (dX is returned in x's dtype,
    dW and db in the parameters')."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Float8Recipe,
                state: DelayedScalingState | None, out_dtype: torch.dtype, store: WeightGradStore | None,
                record: bool, shards: Fp8Shards, sink: GradSink | None) -> torch.Tensor:
        k, n, seq = x.shape[-1], weight.shape[0], shards.seq if shards.over("seq") else None
        x2 = x.reshape(-1, k)
        rows = x2.shape[0] * (seq.size if seq is not None else 1)
        _check_tokens(rows, k)
        if recipe.name == "rowwise":  # amaxes along K: split over a row-parallel layer's tp
            sx = rowwise_scale(x2, 1, E4M3, recipe.margin, shards.over("k"))
            sw = rowwise_scale(weight.t(), 0, E4M3, recipe.margin, shards.over("k"))
            x8 = cast_to_fp8(x2, sx, E4M3)
            if seq is not None:
                x8, sx = _gather8(x8, seq), seq.all_gather(sx, 0)
            y = scaled_mm(x8, cast_to_fp8(weight.t(), sw, E4M3), sx, sw, out_dtype)
            ctx.save_for_backward(x2, weight)
        else:
            x8, sx = cast(x2, "input", recipe, state, record, shards.over(*_ROLE_DIMS["input"]))
            pre = fp8_weight(weight)
            w8, sw = pre if pre is not None else cast(weight, "weight", recipe, state, record,
                                                      shards.over(*_ROLE_DIMS["weight"]))
            y = scaled_mm(x8 if seq is None else _gather8(x8, seq), w8.t(), sx, sw, out_dtype)
            ctx.save_for_backward(x8, sx, w8, sw)  # x8: the shard under sequence parallelism
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.recipe, ctx.state, ctx.out_dtype, ctx.store, ctx.sink = recipe, state, out_dtype, store, sink
        ctx.shards, ctx.seq = shards, seq
        ctx.params, ctx.x_dtype, ctx.x_shape = (weight, bias), x.dtype, x.shape
        lead = (x.shape[0] * seq.size, *x.shape[1:-1]) if seq is not None else x.shape[:-1]
        return y.reshape(*lead, n)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        recipe, out_dtype, shards, seq = ctx.recipe, ctx.out_dtype, ctx.shards, ctx.seq
        weight, bias = ctx.params
        dy2 = dy.reshape(-1, dy.shape[-1])
        gdt = recipe.dtype("grad_output")
        saved = ctx.saved_tensors
        gathering = xg = None
        if seq is not None:  # x's shard gathered again, under the input-gradient GEMM
            shard = saved[0].contiguous()
            shard = shard.view(torch.uint8) if shard.element_size() == 1 else shard
            xg = torch.empty((seq.size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
            gathering = seq.all_gather_into(xg, shard, async_op=True)
            xg = xg.view(saved[0].dtype)
        dx = dy8 = sdy = None
        if recipe.name == "rowwise":
            w = saved[1]
            if ctx.needs_input_grad[0]:  # amaxes along N: split over a column-parallel layer's tp
                dx = rowwise_gemm(dy2, w, gdt, E4M3, recipe.margin, out_dtype, shards.over("n"))
        else:
            w8, sw = saved[2], saved[3]
            dy8, sdy = cast(dy2, "grad_output", recipe, ctx.state, True, shards.over(*_ROLE_DIMS["grad_output"]))
            if ctx.needs_input_grad[0]:
                dx = scaled_mm(dy8, w8, sdy, sw, out_dtype)
        scattering = None
        if dx is not None:
            if seq is not None:  # dX's sequence shards summed over tp (in the GEMM's dtype), under the wgrad GEMM
                full, dx = dx, torch.empty((dx.shape[0] // seq.size, dx.shape[1]), dtype=dx.dtype, device=dx.device)
                scattering = seq.reduce_scatter_into(dx, full, async_op=True)
            else:
                dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        if gathering is not None:
            gathering.wait()
        x_full = xg if seq is not None else saved[0]
        tokens = shards.over("tokens")

        def wgrad() -> torch.Tensor:
            if recipe.name == "rowwise":
                return weight_grad_rowwise(x_full, dy2, recipe, out_dtype, tokens)
            return weight_grad(x_full, saved[1], dy8, sdy, out_dtype)

        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]

        def weight_grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            dw = wgrad().to(weight.dtype) if want_w else None
            db = dy2.float().sum(0).to(bias.dtype) if want_b else None
            return dw, db

        grads: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if ctx.sink is not None:  # ZeRO-3: into the unit's gradient buffer, autograd sees none
            for p, g in zip((weight, bias), weight_grads(), strict=True):
                if g is not None:
                    _into(ctx.sink, p, g)
        elif ctx.store is None or ctx.store.capturing is None:
            grads = weight_grads()
        else:  # zero-bubble BI: dX now, dW when the schedule runs BW
            def job() -> list[torch.Tensor]:
                done = [(p, g) for p, g in zip((weight, bias), weight_grads(), strict=True) if g is not None]
                for p, g in done:
                    accumulate(p, g)
                return [p for p, _ in done]

            ctx.store.capturing.append(job)
        if scattering is not None:
            scattering.wait()
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        return (dx, *grads, None, None, None, None, None, None, None)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe,
               state: DelayedScalingState | None = None, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16, store: WeightGradStore | None = None,
               shards: Fp8Shards = ONE, sink: GradSink | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in ``out_dtype``, forward, dX and dW in float8 per
    ``recipe``. ``state``: the layer's DelayedScalingState (delayed recipe only; the forward records the
    input's and weight's amaxes, the backward the output gradient's). ``store``: a zero-bubble
    WeightGradStore whose captures defer dW (and db); ``weight`` must then be a leaf. ``shards``: the
    groups splitting the operands (module docstring; under ``shards.seq`` x is the sequence shard
    [s/t, ...] and the output covers the whole sequence [s, ..., N]). ``sink``: ZeRO-3's gradient sink
    of ``weight`` (and ``bias``)."""
    if (recipe.name == "delayed") != (state is not None):
        raise ValueError(f"fp8_linear: recipe {recipe.name!r} with state={type(state).__name__}: the delayed "
                         "recipe needs a DelayedScalingState, the others take none")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_linear: out_dtype={out_dtype}; valid: torch.bfloat16, torch.float32")
    if recipe.name == "rowwise" and out_dtype != torch.bfloat16:  # CUDA's rowwise kernel writes bf16 only
        raise ValueError(f"fp8_linear: the rowwise recipe gives bf16 (CUDA's rowwise-scaled GEMM has no "
                         f"{out_dtype} output); valid: out_dtype=torch.bfloat16")
    assert store is None or sink is None, "a deferred weight gradient has no ZeRO-3 unit buffer to go to"
    # A forward under no_grad (validation, evaluation) does not train the delayed scales: only a training
    # forward records (read here: inside the Function's forward grad mode is always off)
    record = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _Fp8Linear.apply(x, weight, bias, recipe, state, out_dtype, store, record, shards, sink)
