"""CPU kernel choices, made from a capability probe at start-up rather than for one instruction set.

The input gradient of a linear layer, ``dX = dY @ W`` with ``W [out, in]`` row-major, is the "NN"
GEMM layout. Under bf16/fp16 on CPUs without native bf16 matrix units (AVX2 only) oneDNN runs that
layout ~20x slower than the transposed one (measured here 0.7-1.3 vs 15-24 GFLOP/s), and a copy of
``W^T`` into contiguous memory moves it to the fast layout for the price of one small copy. On CPUs
with AMX-BF16 or AVX512-BF16 the NN layout is fast and the copy only costs time. Which machine this
is cannot be read reliably from the flags alone (oneDNN's dispatch, ONEDNN_MAX_CPU_ISA, a VM hiding
flags), so the probe times the two ways on a layer-sized GEMM once per process and takes the copy
only where it wins clearly.

Attention has the same split. torch's CPU flash kernel in bf16 is ~10x slower than in fp32 on AVX2
(fwd+bwd of one llama layer's causal attention, b4 n12/4 s512 d64, one thread: 2,473 ms in bf16
against 250 ms with q, k, v cast to fp32; the math backend 397 ms), so there the core runs in fp32
and casts its output back: one cast each way, and more exact. On bf16 hardware the native kernel may
win; a second probe times both on a small causal problem and takes fp32 only where it wins clearly.

    MPFORMER_CPU_DGRAD=nn | transposed    overrides the input-gradient probe (tests run both paths)
    MPFORMER_CPU_ATTENTION=native | fp32  overrides the attention probe

A training run does not probe per process: its choice is made once, agreed by every rank, printed and
kept in its checkpoints (parallel/kernel_choice.py, ``train.cpu_attention`` / ``train.cpu_dgrad``),
then installed here, where the layers read it. Without an installed choice (a model used directly)
each process decides for itself on first use, as below.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

DGRAD_CHOICES = ("nn", "transposed")
ATTENTION_CHOICES = ("native", "fp32")
ATTENTION_PROBE = (1, 4, 256, 64)  # (batch, heads, sequence, head dim): ~40 ms on AVX2 in bf16
PROBE_SHAPE = (256, 512, 512)  # (tokens, out, in): a small layer's GEMM; ~0.1 s in the slow layout on AVX2
WIN_FACTOR = 1.3  # the copy must beat the NN layout by this much (timing noise on a shared machine)


@dataclass(frozen=True)
class CpuKernels:
    dgrad_transposed: bool  # low-precision input gradients through a contiguous W^T
    nn_gflops: float  # what the probe measured (nan when overridden)
    transposed_gflops: float
    source: str  # "probe", or the environment variable that decided

    def describe(self) -> str:
        how = "dY @ contiguous(W^T)" if self.dgrad_transposed else "dY @ W (NN)"
        if self.source != "probe":
            return f"cpu bf16 input gradients: {how} ({self.source})"
        return (f"cpu bf16 input gradients: {how} (probe: NN {self.nn_gflops:.1f}, via W^T "
                f"{self.transposed_gflops:.1f} GFLOP/s)")


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def probe(dtype: torch.dtype = torch.bfloat16, shape: tuple[int, int, int] = PROBE_SHAPE) -> CpuKernels:
    """Time ``dY @ W`` both ways on this CPU (milliseconds on a bf16 machine, about 0.4 s on AVX2)."""
    n, out, inp = shape
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(n, out, generator=g).to(dtype)
    w = torch.randn(out, inp, generator=g).to(dtype)
    flops = 2.0 * n * out * inp
    ways = (lambda: torch.matmul(dy, w), lambda: torch.matmul(dy, w.t().contiguous().t()))
    for fn in ways:
        fn()  # warm-up: oneDNN builds its kernel for the shape on first use
    nn_s, tr_s = (_seconds(fn) for fn in ways)
    if 1 / (3 * WIN_FACTOR) < nn_s / tr_s < 3 * WIN_FACTOR:  # not clear-cut (the usual gap is ~20x): best of 3
        nn_s, tr_s = (min(t, _seconds(fn), _seconds(fn)) for t, fn in zip((nn_s, tr_s), ways))
    return CpuKernels(nn_s > WIN_FACTOR * tr_s, flops / nn_s / 1e9, flops / tr_s / 1e9, "probe")


_installed: dict[str, object] = {}  # the run's agreed choice (kernel_choice.install), read by the layers


def cpu_kernels() -> CpuKernels:
    """The input-gradient choice: the run's agreed one when installed, else this process's own."""
    run = _installed.get("dgrad")
    return run if isinstance(run, CpuKernels) else process_kernels()


@functools.lru_cache(maxsize=1)
def process_kernels() -> CpuKernels:
    """This process's choice: the environment's if set, else the probe's (run once, on first use)."""
    forced = os.environ.get("MPFORMER_CPU_DGRAD")
    if forced:
        if forced not in DGRAD_CHOICES:
            raise ValueError(f"MPFORMER_CPU_DGRAD={forced!r}; valid: {', '.join(DGRAD_CHOICES)}")
        return CpuKernels(forced == "transposed", float("nan"), float("nan"), f"MPFORMER_CPU_DGRAD={forced}")
    return probe()


@dataclass(frozen=True)
class CpuAttention:
    upcast: bool  # 16-bit attention cores computed in fp32 (inputs cast up, the output cast back)
    native_ms: float  # what the probe measured, fwd+bwd (nan when overridden)
    fp32_ms: float
    source: str

    def describe(self, dtype: torch.dtype) -> str:
        how = "in fp32" if self.upcast else f"in {str(dtype).removeprefix('torch.')}"
        if self.source != "probe":
            return f"cpu attention {how} ({self.source})"
        return f"cpu attention {how} (probe: native {self.native_ms:.1f}, fp32 {self.fp32_ms:.1f} ms)"


def probe_attention(dtype: torch.dtype, shape: tuple[int, int, int, int] = ATTENTION_PROBE) -> CpuAttention:
    """Time a causal SDPA forward and backward in ``dtype`` and with its inputs cast to fp32."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode(False):
        q = torch.randn(*shape, generator=g).to(dtype)

    def way(upcast: bool):
        def run() -> None:
            x = q.detach().float().requires_grad_() if upcast else q.detach().requires_grad_()
            with torch.autocast("cpu", enabled=False):
                out = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
            out.backward(torch.ones_like(out))
        return run

    ways = (way(False), way(True))
    # The first attention may run under no_grad or inference_mode (evaluation): the probe's backward
    # needs autograd whatever the caller's mode.
    with torch.inference_mode(False), torch.enable_grad():
        for fn in ways:
            fn()
        native, fp32 = (min(_seconds(fn), _seconds(fn)) for fn in ways)
    return CpuAttention(native > WIN_FACTOR * fp32, 1e3 * native, 1e3 * fp32, "probe")


def cpu_attention(dtype: torch.dtype) -> CpuAttention:
    """How 16-bit attention cores run on CPU: the run's agreed choice for ``dtype`` when installed, else
    this process's own."""
    run = _installed.get(f"attention:{dtype}")
    return run if isinstance(run, CpuAttention) else process_attention(dtype)


@functools.lru_cache(maxsize=4)
def process_attention(dtype: torch.dtype) -> CpuAttention:
    """How this process computes 16-bit attention cores on CPU (the probe runs once per dtype)."""
    forced = os.environ.get("MPFORMER_CPU_ATTENTION")
    if forced:
        if forced not in ATTENTION_CHOICES:
            raise ValueError(f"MPFORMER_CPU_ATTENTION={forced!r}; valid: {', '.join(ATTENTION_CHOICES)}")
        return CpuAttention(forced == "fp32", float("nan"), float("nan"), f"MPFORMER_CPU_ATTENTION={forced}")
    return probe_attention(dtype)
