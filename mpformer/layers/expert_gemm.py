"""A mixture-of-experts SwiGLU expert MLP over rows already grouped by expert, three ways.

``x`` is ``[N, h]`` with its rows sorted by expert, ``counts[e]`` rows for expert ``e`` (uneven, possibly
zero); ``w_up`` is ``[E, 2f, h]`` (per expert its gate rows, then its up rows) and ``w_down`` ``[E, h, f]``;
every expert computes ``down(silu(gate) * up)`` on its own rows.

    grouped  ``torch._grouped_mm`` with ``offs = cumsum(counts)``: one call per GEMM for every expert, in an
             autograd.Function whose backward is ``_grouped_mm`` too (dX = dY W, dW = dY^T X per group)
    padded   rows scattered into ``[E, max(counts), h]`` (zeros elsewhere), two ``bmm``, gathered back
    loop     ``F.linear`` per expert over its rows (what Hugging Face transformers does), the rows split and
             the weights unbound once

Constraints of ``_grouped_mm`` in torch 2.13 (``torch/_meta_registrations.py`` ``_meta_grouped_mm_common``,
and calls on this CPU): every operand's leading stride a multiple of 16 bytes (h and f multiples of 4 in
fp32, of 8 in bf16); the meta kernel (what torch.compile and the meta device run) accepts bf16 alone; the CPU
kernel takes fp32, bf16 and fp16 (not fp64) in eager mode, but FakeTensor tracing (torch.compile) runs
the meta kernel and refuses fp32 there too; its built-in backward fails on an expanded (stride-0) gradient,
which is why the Function below makes the incoming gradient contiguous. On CUDA the fused CUTLASS kernel
is bf16 on sm90/sm100; other dtypes take a per-group fallback that copies ``offs`` to the host (a sync),
so only bf16 counts as grouped there. On CPU the kernel is a loop of GEMMs over the groups: equal to the
loop bit for bit, and no faster (choose_method).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mpformer.parallel.device import host_tensor

METHODS = ("grouped", "padded", "loop")
_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16),
                   "cuda": (torch.bfloat16,), "meta": (torch.bfloat16,)}


def grouped_ok(device_type: str, dtype: torch.dtype, h: int, f: int) -> bool:
    """Whether ``torch._grouped_mm`` runs the up ([N,h] x [E,h,2f]) and down ([N,f] x [E,f,h]) GEMMs and their
    backward for this device type, dtype and size: a supported dtype, h and f strides of 16 bytes."""
    if dtype not in _GROUPED_DTYPES.get(device_type, ()) or not hasattr(torch, "_grouped_mm"):
        return False  # torch < 2.8 has no _grouped_mm (tests/unit/test_torch_floor.py): the loop runs
    align = 16 // torch.empty((), dtype=dtype).element_size()
    return h > 0 and f > 0 and h % align == 0 and f % align == 0


def choose_method(device_type: str, dtype: torch.dtype, h: int, f: int) -> str:
    """The default method for a device.

    CPU: ``loop``. benchmarks/results/expert_gemm_epyc.json and expert_gemm_epyc_large.json (AMD EPYC,
    AVX-512 with avx512_bf16, one thread, torch 2.13, fwd+bwd CPU time): ``grouped`` ran at 0.87-1.00x the
    loop in fp32 and 0.98-1.01x in bf16 (the CPU kernel is itself a loop of GEMMs, run over whole tensors
    between the elementwise ops, out of cache), ``padded`` at 0.42-0.61x (it multiplies the padding:
    1.4-1.9x the rows here, and scatters and gathers). CUDA: ``grouped`` in bf16 where aligned (one fused
    CUTLASS launch for every expert, no host sync; not yet measured here), the loop otherwise."""
    if device_type == "cuda" and grouped_ok(device_type, dtype, h, f):
        return "grouped"
    return "loop"


class _GroupedMM(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e]^T`` for ``w`` of ``[E, n, k]``, forward and backward by _grouped_mm."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, empty: tuple[int, ...]) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.empty = empty
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()  # an expanded gradient (from .sum()) has stride 0, which _grouped_mm refuses
        dx = torch._grouped_mm(dy, w, offs=offs) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch._grouped_mm(dy.t(), x, offs=offs)  # [n, N] x [N, k] per group -> [E, n, k]
            # a group of no rows: zero by definition, whatever a kernel leaves there. One view per expert
            # (dw[e]), not dw[list] = 0: a list index is copied to the device, a host sync on CUDA
            for e in ctx.empty:
                dw[e].zero_()
        return dx, dw, None, None


def _offsets(counts: Sequence[int] | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, tuple[int, ...]]:
    if isinstance(counts, torch.Tensor):  # stays on the device: no sync, empty groups unknown to the host
        return torch.cumsum(counts.to(device), 0).to(torch.int32), ()
    ends, total = [], 0
    for c in counts:
        total += int(c)
        ends.append(total)
    return host_tensor(ends, torch.int32, device), tuple(e for e, c in enumerate(counts) if c == 0)


def _swiglu(y: torch.Tensor, f: int) -> torch.Tensor:
    # split, not two slices: a slice's backward writes a zero gradient of all of y, then adds the two
    gate, up = y.split(f, dim=-1)
    return F.silu(gate) * up


def expert_mlp(x_mh: torch.Tensor, counts: Sequence[int] | torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               *, method: str) -> torch.Tensor:
    """``down_e(silu(gate_e) * up_e)`` on each expert's rows of ``x_mh`` ``[N, h]`` (sorted by expert), ``[N, h]``.

    ``counts`` is a list of E ints (any method, no host sync) or, for ``grouped`` alone, an integer tensor on
    ``x_mh``'s device. ``grouped`` raises ValueError where ``grouped_ok`` is False: the caller chooses."""
    E, two_f, h = w_up.shape
    f = two_f // 2
    if w_down.shape != (E, h, f) or x_mh.dim() != 2 or x_mh.shape[1] != h or two_f != 2 * f:
        raise ValueError(f"expert_mlp: x {tuple(x_mh.shape)}, w_up {tuple(w_up.shape)} and w_down "
                         f"{tuple(w_down.shape)} are not [N, h], [E, 2f, h], [E, h, f]")
    if len(counts) != E:
        raise ValueError(f"expert_mlp: {len(counts)} counts for {E} experts")
    if method == "grouped":
        if not grouped_ok(x_mh.device.type, x_mh.dtype, h, f):
            raise ValueError(f"expert_mlp: torch._grouped_mm cannot run {x_mh.dtype} on {x_mh.device.type} with "
                             f"h={h}, f={f} (needs a 16-byte multiple for h and f, and bf16 on cuda/meta); "
                             f"use method={choose_method(x_mh.device.type, x_mh.dtype, h, f)!r}")
        offs, empty = _offsets(counts, x_mh.device)
        a = _swiglu(_GroupedMM.apply(x_mh.contiguous(), w_up, offs, empty), f)
        return _GroupedMM.apply(a, w_down, offs, empty)
    if isinstance(counts, torch.Tensor):
        raise ValueError(f"expert_mlp: method {method!r} needs counts as a list of ints")
    counts = [int(c) for c in counts]
    if sum(counts) != x_mh.shape[0]:
        raise ValueError(f"expert_mlp: counts sum to {sum(counts)}, x has {x_mh.shape[0]} rows")
    if method == "padded":
        cap, n, dev = max(counts, default=0), x_mh.shape[0], x_mh.device
        starts = [0, *itertools.accumulate(counts)][:E]
        # row i of expert e (its j-th) goes to slot e * cap + j; built from the host's list: no sync
        expert = torch.repeat_interleave(torch.arange(E, device=dev), host_tensor(counts, torch.int64, dev),
                                         output_size=n)
        dest = expert * cap + torch.arange(n, device=dev) - host_tensor(starts, torch.int64, dev)[expert]
        xp = x_mh.new_zeros(E * cap, h).index_copy(0, dest, x_mh).view(E, cap, h)
        a = _swiglu(torch.bmm(xp, w_up.transpose(1, 2)), f)
        return torch.bmm(a, w_down.transpose(1, 2)).reshape(E * cap, h).index_select(0, dest)
    if method == "loop":
        # split and unbind once: each one backward that assembles its gradient once. Slicing x[start:end] or
        # indexing w_up[e] per expert (as Hugging Face does) makes autograd write a zero gradient of the whole
        # tensor per expert: 2x this loop's time at E=64 (bench_expert_gemm.py's "loop, HF indexing")
        xs, ups, downs = x_mh.split(counts), w_up.unbind(0), w_down.unbind(0)
        outs = [F.linear(_swiglu(F.linear(xs[e], ups[e]), f), downs[e]) for e, c in enumerate(counts) if c]
        return torch.cat(outs) if outs else x_mh.new_zeros(0, h) + 0 * x_mh.sum()
    raise ValueError(f"expert_mlp: method {method!r} is not one of {METHODS}")
