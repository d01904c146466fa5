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
are cast once in forward and saved in fp8 (a quarter of fp32's bytes), and dY is cast once for both
backward GEMMs. Under rowwise scaling each GEMM contracts over a different dimension and the scales must
lie along the other two, so backward re-casts from the high-precision x, W and dY (x and W are saved as
given).

The split backward of the zero-bubble schedules: given a ``WeightGradStore`` that is capturing, backward
returns dX and queues the weight-gradient GEMM (its cast operands held by the job) for
``WeightGradStore.run``, as ``layers.linear._SplitLinear`` does for bf16; ``weight_grad`` and
``weight_grad_rowwise`` are that GEMM on its own.
"""

from __future__ import annotations

import torch

from mpformer.layers.fp8 import (
    ALIGN,
    DelayedScalingState,
    Float8Recipe,
    cast_to_fp8,
    rowwise_scale,
    tensorwise_scale,
)
from mpformer.layers.grad_store import WeightGradStore, accumulate

E4M3 = torch.float8_e4m3fn


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a8 * scale_a) @ (b8 * scale_b) in ``out_dtype``: a8 [M, K], b8 [K, N] float8, scales 0-d or
    [M, 1] / [1, N] fp32. Lays a8 out row-major and b8 column-major (no copy where they already are)."""
    a8 = a8.contiguous()
    b8 = b8.t().contiguous().t()
    return torch._scaled_mm(a8, b8, scale_a=scale_a.reshape(()) if scale_a.numel() == 1 else scale_a,
                            scale_b=scale_b.reshape(()) if scale_b.numel() == 1 else scale_b,
                            out_dtype=out_dtype)


def _cast(t: torch.Tensor, role: str, recipe: Float8Recipe, state: DelayedScalingState | None,
          record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for all of ``t`` (tensorwise, or delayed: the state's scale, then this amax recorded)."""
    dtype = recipe.dtype(role)
    if recipe.name == "delayed":
        assert state is not None, "delayed scaling needs the layer's DelayedScalingState"
        amax = t.detach().abs().amax()
        scale = state.scale_for(role, amax)
        t8 = cast_to_fp8(t, scale, dtype)
        if record:
            state.record(role, amax)
        return t8, scale
    scale = tensorwise_scale(t, dtype, recipe.margin)
    return cast_to_fp8(t, scale, dtype), scale


def rowwise_gemm(a: torch.Tensor, b: torch.Tensor, dtype_a: torch.dtype, dtype_b: torch.dtype, margin: int,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [K, N] with a scaled per row and b per column (amaxes along K)."""
    sa, sb = rowwise_scale(a, 1, dtype_a, margin), rowwise_scale(b, 0, dtype_b, margin)
    return scaled_mm(cast_to_fp8(a, sa, dtype_a), cast_to_fp8(b, sb, dtype_b), sa, sb, out_dtype)


def weight_grad(x8: torch.Tensor, x_scale: torch.Tensor, dy8: torch.Tensor, dy_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """dW [N, K] = dY^T @ x from operands cast with one scale each (tensorwise or delayed):
    x8 [M, K], dy8 [M, N]."""
    return scaled_mm(dy8.t(), x8, dy_scale, x_scale, out_dtype)


def weight_grad_rowwise(x2: torch.Tensor, dy2: torch.Tensor, recipe: Float8Recipe,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """dW [N, K] = dY^T @ x under rowwise scaling: dY^T per row (an output feature's amax over the tokens),
    x per column (an input feature's amax over the tokens)."""
    return rowwise_gemm(dy2.t(), x2, recipe.dtype("grad_output"), E4M3, recipe.margin, out_dtype)


def _check_tokens(m: int, k: int) -> None:
    # K and N are checked when the layer is built (fp8.check_fp8_dims); M is the wgrad GEMM's K.
    if m % ALIGN:
        raise ValueError(f"train.precision=fp8: a linear layer's input has {m} tokens (rows of [{m}, {k}]); "
                         f"float8 GEMMs need a multiple of {ALIGN} (micro_batch_size * seq_length / tp)")


class _Fp8Linear(torch.autograd.Function):
    """See the module docstring; ``out_dtype`` is every GEMM's output dtype (dX is returned in x's dtype,
    dW and db in the parameters')."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Float8Recipe,
                state: DelayedScalingState | None, out_dtype: torch.dtype,
                store: WeightGradStore | None, record: bool = True) -> torch.Tensor:
        k, n = x.shape[-1], weight.shape[0]
        x2 = x.reshape(-1, k)
        _check_tokens(x2.shape[0], k)
        if recipe.name == "rowwise":
            y = rowwise_gemm(x2, weight.t(), E4M3, E4M3, recipe.margin, out_dtype)
            ctx.save_for_backward(x2, weight)
        else:
            x8, sx = _cast(x2, "input", recipe, state, record)
            w8, sw = _cast(weight, "weight", recipe, state, record)
            y = scaled_mm(x8, w8.t(), sx, sw, out_dtype)
            ctx.save_for_backward(x8, sx, w8, sw)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.recipe, ctx.state, ctx.out_dtype, ctx.store = recipe, state, out_dtype, store
        ctx.params, ctx.x_dtype, ctx.x_shape = (weight, bias), x.dtype, x.shape
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        recipe, out_dtype = ctx.recipe, ctx.out_dtype
        weight, bias = ctx.params
        dy2 = dy.reshape(-1, dy.shape[-1])
        gdt = recipe.dtype("grad_output")
        dx = None
        if recipe.name == "rowwise":
            x2, w = ctx.saved_tensors
            if ctx.needs_input_grad[0]:
                dx = rowwise_gemm(dy2, w, gdt, E4M3, recipe.margin, out_dtype)

            def wgrad() -> torch.Tensor:
                return weight_grad_rowwise(x2, dy2, recipe, out_dtype)
        else:
            x8, sx, w8, sw = ctx.saved_tensors
            dy8, sdy = _cast(dy2, "grad_output", recipe, ctx.state)
            if ctx.needs_input_grad[0]:
                dx = scaled_mm(dy8, w8, sdy, sw, out_dtype)

            def wgrad() -> torch.Tensor:
                return weight_grad(x8, sx, dy8, sdy, out_dtype)
        if dx is not None:
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]

        def weight_grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            dw = wgrad().to(weight.dtype) if want_w else None
            db = dy2.float().sum(0).to(bias.dtype) if want_b else None
            return dw, db

        grads: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if ctx.store is None or ctx.store.capturing is None:
            grads = weight_grads()
        else:  # zero-bubble BI: dX now, dW when the schedule runs BW
            def job() -> list[torch.Tensor]:
                done = [(p, g) for p, g in zip((weight, bias), weight_grads(), strict=True) if g is not None]
                for p, g in done:
                    accumulate(p, g)
                return [p for p, _ in done]

            ctx.store.capturing.append(job)
        return (dx, *grads, None, None, None, None, None)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe,
               state: DelayedScalingState | None = None, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16, store: WeightGradStore | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in ``out_dtype``, forward, dX and dW in float8 per
    ``recipe``. ``state``: the layer's DelayedScalingState (delayed recipe only; the forward records the
    input's and weight's amaxes, the backward the output gradient's). ``store``: a zero-bubble
    WeightGradStore whose captures defer dW (and db); ``weight`` must then be a leaf."""
    if (recipe.name == "delayed") != (state is not None):
        raise ValueError(f"fp8_linear: recipe {recipe.name!r} with state={type(state).__name__}: the delayed "
                         "recipe needs a DelayedScalingState, the others take none")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_linear: out_dtype={out_dtype}; valid: torch.bfloat16, torch.float32")
    # A forward under no_grad (validation, evaluation) does not train the delayed scales: only a training
    # forward records (read here: inside the Function's forward grad mode is always off)
    record = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _Fp8Linear.apply(x, weight, bias, recipe, state, out_dtype, store, record)
