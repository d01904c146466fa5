"""LM head and cross entropy in one, chunk by chunk: the loss without full-vocabulary logits.

Shape legend: n tokens (s * b, sequence-first), h hidden, v this rank's vocabulary rows (the whole
vocabulary without tensor parallelism), c tokens of one chunk.

The unfused head forms ``[n, v]`` logits (in the compute dtype, then an fp32 copy), F.cross_entropy
keeps their fp32 log-softmax for backward, and backward adds an ``[n, v]`` gradient or two: at
4 x 512 tokens, h = 512 and v = 32000 (fp32) it keeps 250 MiB after forward and peaks at 750 MiB
over the inputs; this head keeps 67 MiB and peaks at 192 MiB with chunks of 1024, and is 1.18x
faster in CPU time (benchmarks/bench_cross_entropy.py, benchmarks/README.md). Per chunk of
``chunk`` tokens::

    logits_cv = x_ch @ W_vh^T                      compute dtype (autocast's, as ``linear``), then fp32
    m = max_v logits                               all-reduce MAX over tp        (collective 1 of 2)
    z = sum_v exp(logits - m),  x_y = logit_y - m  one all-reduce SUM of [2, c]  (collective 2 of 2)
    loss_c = log z - x_y                           0 where label == -100
    d_cv = softmax - onehot(y)                     0 on ignored rows; cast to the compute dtype
    dX_ch = d_cv @ W_vh,  dW_vh += d_cv^T @ x_ch   fp32 buffers, unscaled

and the Function returns the summed loss. The loss is the end of the graph, so its gradients are
known in forward up to the one scalar that comes back as grad_output: backward only scales the two
buffers (the Liger-kernel "fused linear cross entropy" scheme). Why this rather than saving the
log-sum-exp and recomputing each chunk's logits in backward: the head costs 3 GEMMs of n * v * h
either way (logits, dX, dW), recomputation adds a 4th (a third more head time), and nothing is saved
for backward but the two gradient buffers ``[n, h]`` and ``[v, h]`` (fp32; the hidden and the weight
themselves are not kept). The ``[v, h]`` buffer is a weight gradient's size, which the backward
of the unfused head materialises too; it is held from forward to backward, so a schedule that runs
many forwards before their backwards on the last stage (GPipe) holds one per micro-batch in flight
(1F1B runs each backward right after its forward). Outside autograd (no_grad, evaluation) no
gradient is formed.

Under tensor parallelism every rank sees the same gathered tokens (``gather_input`` before the call,
whose backward sums or reduce-scatters dX) and its vocabulary block ``[start, start + v)``; rows from
``valid`` on pad the vocabulary and never enter a GEMM (their gradient is 0), and collectives stay at
2 per chunk, moving 3 floats per token in all, like cross_entropy.py.

The zero-bubble pipeline's WeightGradStore: with a store, dW is not formed in forward; forward keeps
the hidden, the weight and each token's log-sum-exp (n floats), and dW is recomputed chunk by chunk
(logits again, then d^T x), either in backward (a combined backward) or, while the store is
capturing, as a queued job that the W action runs and accumulates into ``weight.grad``, like
linear.py's _SplitLinear. That costs the 4th GEMM but keeps the head's weight-gradient work in W,
off the pipeline's critical path, which is what the split schedules are for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpformer.core.model_options import DEFAULT_CHUNK
from mpformer.layers.grad_store import WeightGradStore, accumulate
from mpformer.parallel.comm import Comm
from mpformer.parallel.device import autocast_dtype, no_autocast
from mpformer.parallel.kernels import cpu_kernels

# DEFAULT_CHUNK tokens per chunk (core/model_options.py), measured (benchmarks/bench_cross_entropy.py,
# 2048 tokens, h 512, v 32000, CPU): 1024 took the least CPU time in fp32 (256: +14%, 512: +5%, 2048:
# +3%) and was within 3% of the best in bf16; a chunk's transient grows linearly with it (fp32 logits,
# and under bf16 their 16-bit original and the 16-bit gradient: 4-8 bytes x v a token, 125-250 MiB at
# 1024 x 32000).
_LOW = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Spec:
    """What the Function needs besides its tensors."""

    comm: Comm | None  # the tp comm (None: the whole vocabulary on this rank)
    start: int  # global id of this rank's first vocabulary row
    valid: int  # rows that are real tokens (the rest is tp padding)
    chunk: int
    dtype: torch.dtype  # the GEMMs' dtype (autocast's, else the hidden's)
    store: WeightGradStore | None


def _all_reduce(t: torch.Tensor, comm: Comm | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    if comm is not None:
        comm.all_reduce(t, op=op)


def _chunk_loss(logits_cv: torch.Tensor, labels_c: torch.Tensor, sp: _Spec) -> tuple[torch.Tensor, ...]:
    """Loss per token [c] (0 where ignored), and for the gradient: ``logits_cv`` (fp32) overwritten with
    exp(logit - m), the row scale 1/z (0 on ignored rows), the log-sum-exp (+inf on ignored rows, so
    that exp(logit - lse) is the gradient's softmax part there too) and the label's column here."""
    if sp.valid > 0:
        m = logits_cv.amax(dim=-1)  # amax: no argmax indices (19 -> 1-4 ms at 1024 x 8192, one CPU thread)
    else:  # a rank holding only padding rows
        m = torch.full(logits_cv.shape[:1], float("-inf"), device=logits_cv.device)
    _all_reduce(m, sp.comm, dist.ReduceOp.MAX)
    logits_cv.sub_(m.unsqueeze(-1))
    onehot = _onehot(labels_c, sp)
    safe, mine = onehot
    picked = (logits_cv.gather(-1, safe.unsqueeze(-1)).squeeze(-1) if sp.valid > 0
              else torch.zeros_like(m))
    logits_cv.exp_()
    zx = torch.stack([logits_cv.sum(dim=-1), torch.where(mine, picked, torch.zeros_like(picked))])
    _all_reduce(zx, sp.comm)  # z and the label's logit in one collective
    ignore = labels_c == -100
    log_z = zx[0].log()
    loss = (log_z - zx[1]).masked_fill(ignore, 0.0)
    scale = zx[0].reciprocal().masked_fill(ignore, 0.0)
    return loss, scale, (m + log_z).masked_fill(ignore, float("inf")), onehot


def _onehot(labels_c: torch.Tensor, sp: _Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """The label's column on this rank (clamped to a valid one) and whether it is here (never for -100)."""
    local = labels_c - sp.start
    return local.clamp(0, max(sp.valid - 1, 0)), (local >= 0) & (local < sp.valid)


def _dlogits(p_cv: torch.Tensor, onehot: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """d (summed loss) / d logits = softmax - onehot from the (0 on ignored rows) softmax ``p_cv``, in
    the GEMMs' dtype (``p_cv`` is overwritten). The one-hot is subtracted arithmetically (-1 at the
    label's column where it is on this rank, -0 elsewhere), not through a boolean index, which would
    wait for the device to count the selected rows (a host sync per chunk on CUDA)."""
    safe, mine = onehot
    p_cv.scatter_add_(1, safe.unsqueeze(-1), mine.to(p_cv.dtype).neg_().unsqueeze(-1))
    return p_cv.to(dtype)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (fp32) = or += a @ b; a 16-bit product is rounded once, then added in fp32."""
    if a.dtype == out.dtype:
        out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    else:
        out.add_(a @ b) if accumulate else out.copy_(a @ b)


def _forward(x_nh: torch.Tensor, weight_vh: torch.Tensor, labels_n: torch.Tensor, sp: _Spec, want_x: bool,
             want_w: bool) -> tuple[torch.Tensor, ...]:
    """Summed loss, and the unscaled gradient buffers asked for: dX [n, h] and dW [v, h] (fp32), or,
    under a store, the log-sum-exp [n] from which dW is recomputed."""
    n, h = x_nh.shape
    w_c = weight_vh[: sp.valid].to(sp.dtype)  # padding rows never enter a GEMM
    w_dx = w_c
    if want_x and x_nh.device.type == "cpu" and sp.dtype in _LOW and cpu_kernels().dgrad_transposed:
        w_dx = w_c.t().contiguous().t()  # dX through a contiguous W^T where the probe found it faster (kernels.py)
    defer = want_w and sp.store is not None
    dx = torch.empty(n, h, dtype=torch.float32, device=x_nh.device) if want_x else None
    dw = torch.zeros(weight_vh.shape, dtype=torch.float32, device=x_nh.device) if want_w and not defer else None
    lse = torch.empty(n, dtype=torch.float32, device=x_nh.device) if defer else None
    total = torch.zeros((), dtype=torch.float32, device=x_nh.device)
    for a in range(0, n, sp.chunk):
        rows = slice(a, min(a + sp.chunk, n))
        x_ch, labels_c = x_nh[rows].to(sp.dtype), labels_n[rows]
        logits_cv = F.linear(x_ch, w_c).float()
        loss_c, scale_c, lse_c, onehot = _chunk_loss(logits_cv, labels_c, sp)
        total += loss_c.sum()
        if lse is not None:
            lse[rows] = lse_c
        if dx is None and dw is None:
            continue
        d_cv = _dlogits(logits_cv.mul_(scale_c.unsqueeze(-1)), onehot, sp.dtype)
        del logits_cv  # bf16: the fp32 softmax goes before the GEMMs
        if dx is not None:
            _mm_into(dx[rows], d_cv, w_dx, accumulate=False)
        if dw is not None:
            _mm_into(dw[: sp.valid], d_cv.t(), x_ch, accumulate=a > 0)
        del d_cv  # before the next chunk's logits: one chunk's buffers alive at a time, not two
    return total, dx, dw, lse


def _recompute_dw(x_nh: torch.Tensor, weight_vh: torch.Tensor, labels_n: torch.Tensor, lse_n: torch.Tensor,
                  sp: _Spec) -> torch.Tensor:
    """dW [v, h] (fp32, unscaled) from the saved log-sum-exp: logits again, softmax without collectives."""
    w_c = weight_vh[: sp.valid].to(sp.dtype)
    dw = torch.zeros(weight_vh.shape, dtype=torch.float32, device=x_nh.device)
    for a in range(0, x_nh.shape[0], sp.chunk):
        rows = slice(a, min(a + sp.chunk, x_nh.shape[0]))
        x_ch, labels_c = x_nh[rows].to(sp.dtype), labels_n[rows]
        p_cv = F.linear(x_ch, w_c).float().sub_(lse_n[rows].unsqueeze(-1)).exp_()  # softmax; 0 on ignored rows
        _mm_into(dw[: sp.valid], _dlogits(p_cv, _onehot(labels_c, sp), sp.dtype).t(), x_ch, accumulate=a > 0)
        del p_cv  # before the next chunk's logits
    return dw


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Summed loss of ``x @ W^T``; gradients formed in forward, scaled by grad_output in backward."""

    @staticmethod
    def forward(ctx, x_nh: torch.Tensor, weight_vh: torch.Tensor, labels_n: torch.Tensor, sp: _Spec,
                want_x: bool, want_w: bool) -> torch.Tensor:
        total, dx, dw, lse = _forward(x_nh, weight_vh, labels_n, sp, want_x, want_w)
        if lse is not None:
            ctx.save_for_backward(dx, dw, x_nh, weight_vh, labels_n, lse)
        else:
            ctx.save_for_backward(dx, dw)
        ctx.sp, ctx.x_dtype, ctx.weight, ctx.used = sp, x_nh.dtype, weight_vh, False
        return total

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.used:  # the buffers were scaled in place by the first backward
            raise RuntimeError("fused cross entropy: a second backward through the same graph (retain_graph) is "
                               "not supported; set train.fused_cross_entropy=false")
        ctx.used = True
        dx, dw, *kept = ctx.saved_tensors
        g = g.float()
        dx = dx.mul_(g).to(ctx.x_dtype) if dx is not None else None
        if dw is not None:
            dw = dw.mul_(g).to(ctx.weight.dtype)
        elif kept:  # a store: dW from the log-sum-exp, now or in the W action
            dw = _deferred_dw(ctx.sp, ctx.weight, kept, g)
        return dx, dw, None, None, None, None


def _deferred_dw(sp: _Spec, weight: torch.Tensor, kept: list[torch.Tensor], g: torch.Tensor) -> torch.Tensor | None:
    """dW for backward to return (a combined backward), or None with its job queued while the store captures."""
    x_nh, weight_vh, labels_n, lse = kept
    if sp.store.capturing is None:
        return _recompute_dw(x_nh, weight_vh, labels_n, lse, sp).mul_(g).to(weight.dtype)

    def job() -> list[torch.Tensor]:  # ``weight`` is the parameter itself (a leaf): accumulate into .grad
        accumulate(weight, _recompute_dw(x_nh, weight_vh, labels_n, lse, sp).mul_(g))
        return [weight]

    sp.store.capturing.append(job)
    return None


def fused_linear_cross_entropy(x_nh: torch.Tensor, weight_vh: torch.Tensor, labels_n: torch.Tensor, *,
                               chunk: int = DEFAULT_CHUNK, comm: Comm | None = None, start: int = 0,
                               valid: int | None = None, store: WeightGradStore | None = None) -> torch.Tensor:
    """Summed cross entropy (fp32 scalar) of the logits ``x_nh @ weight_vh^T`` against ``labels_n``
    (-100: ignored), ``chunk`` tokens at a time. The caller divides by the labelled-token count.
    Under tp: ``comm`` is the tp comm, ``weight_vh`` this rank's vocabulary block starting at global
    id ``start`` with ``valid`` real rows (None: all). ``store``: the zero-bubble WeightGradStore
    (``weight_vh`` must then be a leaf). GEMMs run in the autocast dtype when autocast is on."""
    if chunk < 1:
        raise ValueError(f"cross entropy chunk={chunk} must be >= 1")
    dtype = autocast_dtype(x_nh) or x_nh.dtype
    sp = _Spec(comm if comm is not None and comm.size > 1 else None, start,
               weight_vh.shape[0] if valid is None else valid, chunk, dtype, store)
    grad = torch.is_grad_enabled()
    want_x, want_w = grad and x_nh.requires_grad, grad and weight_vh.requires_grad
    with no_autocast(x_nh):
        if not (want_x or want_w):  # no_grad or frozen: the loss alone, no Function, no buffers
            return _forward(x_nh, weight_vh, labels_n, sp, False, False)[0]
        return _FusedLinearCrossEntropy.apply(x_nh, weight_vh, labels_n, sp, want_x, want_w)
