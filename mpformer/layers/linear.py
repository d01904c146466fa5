"""Linear layers: the CPU low-precision fast path, and the split backward of zero-bubble pipelines.

Why a custom backward on CPU: under bf16/fp16 autocast, the input gradient ``dX = dY @ W`` is a
GEMM whose second operand is row-major ``W [out, in]`` (the "NN" layout). On CPUs without native
bf16 matmul units (AVX2 only) oneDNN runs that layout ~20x slower than the transposed one
(measured 0.7-1.3 vs 15-24 GFLOP/s, benchmarks/bench_throughput.py). Computing it as
``dY @ (W^T contiguous)^T`` costs one small copy of W and puts the GEMM in the fast layout; the
values are the same products summed in the same precision. Whether this CPU needs it is measured
once per process (kernels.py: on AMX or AVX512-BF16 machines the NN layout is fast and the copy
only costs time). fp32 and GPU paths are untouched.

Why a weight-gradient store: the zero-bubble schedules (ZB-H1/H2, Qi et al. 2023) run a
micro-batch's backward as two actions, BI (input gradients, which the previous stage is waiting
for) and BW (weight gradients, which nobody waits for, run later to fill bubbles). A linear layer
given a ``WeightGradStore`` computes ``dX`` in backward as usual; while the store is capturing it
queues ``dW = dY^T X`` (and ``db``) instead, and ``WeightGradStore.run`` performs the queued GEMMs
and accumulates them into ``.grad`` as autograd would have. Outside a capture (a combined backward,
validation, a one-stage pipeline) the same function returns the weight gradients directly.

Why a gradient sink: ZeRO-3 (optim/engine.py) collects a unit's gradients in one flat buffer to
reduce-scatter it. Formed by autograd, a weight gradient exists twice for a moment (autograd's dW,
then its copy in the buffer): for a 4h x h projection of a 530B model, 3.4 GB more at the step's
peak. A parameter that carries a sink (``set_grad_sink``) has its ``dW = dY^T X`` (and ``db``) added
straight into the buffer the sink lends, then the sink is told it arrived; autograd sees no weight
gradient (Megatron's gradient-accumulation fusion into ``main_grad``, with the buffer lent when the
gradient is formed rather than held all step).

Why a sequence gather inside: under sequence parallelism a column-parallel projection's input is the
all-gather of each rank's sequence shard. Saved as gathered, each such input costs a whole [s, b, h]
per layer and rank where its shard is 1/t of it (two per layer: 3.5 s b h of 4.25 in all at t = 8 for
GPT-3's block, Korthikanti et al.'s 34 s b h / t). Given ``seq`` (the tp group), the linear gathers
the input itself, keeps the shard for backward and gathers it again there, under the input-gradient
GEMM, then reduce-scatters dX under the weight-gradient GEMM (Megatron's
LinearWithGradAccumulationAndAsyncCommunication does the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpformer.layers.fp8_layer import Float8Layer
from mpformer.layers.grad_store import GradSink, WeightGradStore, accumulate, grad_sink
from mpformer.parallel.comm import Comm
from mpformer.parallel.device import autocast_dtype, no_autocast
from mpformer.parallel.kernels import cpu_kernels

_LOW = (torch.bfloat16, torch.float16)


class _CpuLowPrecisionLinear(torch.autograd.Function):
    """y = x W^T + b with dX taken through a contiguous W^T (inputs already in the low dtype)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy, w.t().contiguous().t())
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = dy2.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


class _SplitLinear(torch.autograd.Function):
    """y = x W^T + b whose weight gradients can be deferred to a ``WeightGradStore`` or added into a
    ``GradSink``'s buffer; ``dtype`` is the autocast dtype to compute in (None: the inputs' dtype);
    ``seq``: x is this rank's sequence shard, gathered over ``seq`` here and again in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: WeightGradStore | None, sink: GradSink | None, dtype: torch.dtype | None,
                seq: Comm | None) -> torch.Tensor:
        xc, wc = (x, weight) if dtype is None else (x.to(dtype), weight.to(dtype))
        bc = bias if bias is None or dtype is None else bias.to(dtype)
        ctx.save_for_backward(xc, wc)
        ctx.store, ctx.sink, ctx.seq, ctx.params, ctx.x_dtype = store, sink, seq, (weight, bias), x.dtype
        return F.linear(xc if seq is None else seq.all_gather(xc, 0), wc, bc)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xc, wc = ctx.saved_tensors
        weight, bias, seq = *ctx.params, ctx.seq
        dy = dy.to(wc.dtype)
        gathering = None
        if seq is not None:  # the input again, under the input-gradient GEMM
            shard = xc.contiguous()
            xc = torch.empty((seq.size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
            gathering = seq.all_gather_into(xc, shard, async_op=True)
        dx = scattering = None
        if ctx.needs_input_grad[0]:
            transposed = wc.device.type == "cpu" and wc.dtype in _LOW and cpu_kernels().dgrad_transposed
            w_fast = wc.t().contiguous().t() if transposed else wc
            dx = torch.matmul(dy, w_fast).to(ctx.x_dtype)
            if seq is not None:  # dX's sequence shards summed over tp, under the weight-gradient GEMM
                full, dx = dx, torch.empty((dx.shape[0] // seq.size, *dx.shape[1:]), dtype=dx.dtype, device=dx.device)
                scattering = seq.reduce_scatter_into(dx, full, async_op=True)
        if gathering is not None:
            gathering.wait()
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]

        def weight_grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            dy2 = dy.reshape(-1, dy.shape[-1])
            dw = dy2.t().mm(xc.reshape(-1, xc.shape[-1])).to(weight.dtype) if want_w else None
            db = dy2.sum(0).to(bias.dtype) if want_b else None
            return dw, db

        grads: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if ctx.sink is not None:  # after dX: the sink may free the gathered weight once its gradients are in
            _into_sink(ctx.sink, weight, bias, dy, xc, want_w, want_b)
        elif ctx.store is None or ctx.store.capturing is None:
            grads = weight_grads()
        else:
            def job() -> list[torch.Tensor]:
                dw, db = weight_grads()
                done = [(p, g) for p, g in ((weight, dw), (bias, db)) if g is not None]
                for p, g in done:
                    accumulate(p, g)
                return [p for p, _ in done]

            ctx.store.capturing.append(job)
        if scattering is not None:
            scattering.wait()
        return (dx, *grads, None, None, None, None)


def _into_sink(sink: GradSink, weight: torch.Tensor, bias: torch.Tensor | None, dy: torch.Tensor,
               xc: torch.Tensor, want_w: bool, want_b: bool) -> None:
    """dW = dY^T X added into the sink's buffer in place (no dW of its own when the dtypes agree), db too."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), xc.reshape(-1, xc.shape[-1])
    if want_w:
        buf = sink.grad_buffer(weight)
        if buf.dtype == dy2.dtype:
            buf.addmm_(dy2.t(), x2)
        else:
            buf.add_(dy2.t().mm(x2))
        sink.grad_arrived(weight)
    if want_b:
        sink.grad_buffer(bias).add_(dy2.sum(0))
        sink.grad_arrived(bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           store: WeightGradStore | None = None, seq: Comm | None = None) -> torch.Tensor:
    """F.linear, except on CPU under bf16/fp16 autocast where the input gradient takes the layout the
    probe found fast, with a ``store`` whose captures defer the weight gradients (``weight`` must then
    be a leaf), for a weight with a gradient sink (ZeRO-3), whose gradients go into its buffer, and with
    ``seq``, where x is this rank's sequence shard (gathered here; the shard is what backward keeps)."""
    sink = grad_sink(weight)
    seq = seq if seq is not None and seq.size > 1 else None
    if store is not None or sink is not None or seq is not None:
        assert store is None or sink is None, "a deferred weight gradient has no ZeRO-3 unit buffer to go to"
        assert bias is None or grad_sink(bias) is sink, "a weight and its bias go to the same sink"
        dt = autocast_dtype(x)
        with no_autocast(x):
            return _SplitLinear.apply(x, weight, bias, store, sink, dt, seq)
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        if dt in _LOW and cpu_kernels().dgrad_transposed:
            with torch.autocast("cpu", enabled=False):
                # Casting outside the Function keeps autograd's cast back to fp32 for the master weights.
                b = bias.to(dt) if bias is not None else None
                return _CpuLowPrecisionLinear.apply(x.to(dt), weight.to(dt), b)
    return F.linear(x, weight, bias)


class Linear(nn.Linear, Float8Layer):
    """nn.Linear with the CPU low-precision backward above; same parameters, same state dict.
    ``store``: the zero-bubble pipeline's WeightGradStore, whose captures defer the weight gradients.
    After ``enable_fp8`` (train.precision=fp8, models/fp8.py) its GEMMs run in float8 (layers/fp8_layer.py);
    this forward is the one place the model's one-device linears branch to it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 store: WeightGradStore | None = None, device=None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8_forward(x, self.bias)
        return linear(x, self.weight, self.bias, self.store)

    def forward_parts(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """The output's ``n`` equal row blocks (gate and up of a fused projection), as ``self(x).chunk``.
        On one device, with weight gradients neither deferred (the store accumulates into whole
        parameters, not row views) nor sunk (ZeRO-3 gathers and collects around each projection's
        own call): one narrower GEMM per block on the rows of the fused weight. Storage stays fused
        (contiguous tensor-parallel slices) and the narrower GEMMs run faster on CPU (measured in
        benchmarks/bench_throughput.py), with no split or concat of activations. In float8: one GEMM,
        with one scale (and one delayed-scaling state) for the fused weight."""
        if self.fp8 is not None or self.store is not None or grad_sink(self.weight) is not None:
            return self(x).chunk(n, dim=-1)
        weights = self.weight.chunk(n, dim=0)
        biases = self.bias.chunk(n, dim=0) if self.bias is not None else (None,) * n
        return tuple(linear(x, w, b) for w, b in zip(weights, biases))
