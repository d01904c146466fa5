"""Time on one device of the kernels kernels.py counts: GEMMs, the attention core, memory-bound work.

    GEMM       a measured table (the local-cpu profile): the nearest measured shape's rate. A GPU preset
               (``sm_count`` set): FLOPs / (peak x gemm_fraction x wave efficiency), where gemm_fraction
               is the device's maximum achievable matmul rate over its data-sheet peak (measured; the
               preset names the source) and the wave efficiency is the share of the SMs busy over the
               waves of output tiles the GEMM needs (NVIDIA's Matrix Multiplication Background guide:
               tile and wave quantisation); never faster than its operands and output over HBM (the
               roofline: thin GEMMs are memory-bound). A preset without SM count: GEMM_EFFICIENCY x
               a size term (small GEMMs are launch- and tile-bound).
    attention  a measured fused kernel (local-cpu: seconds per head by shape, forward + backward); a
               flash kernel's FLOPs at the preset's achieved fraction of peak, forward and backward
               (``attention_fraction``, measured for the kernel generation the preset states); without
               a flash kernel, its batched GEMMs and score-matrix passes (in the kernel lists)
    memory     bytes / (HBM bandwidth x stream_fraction), the fraction a streaming kernel reaches
    launches   a pass never takes less than ``launches x launch_s``: the host issues kernels one by one
               and a GPU whose kernels are shorter than that waits for the next
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.kernels import FP32, Gemm, LayerWork, Pass

# A preset without SM count or measured table: the fraction of peak a large, well-shaped 16-bit GEMM
# reaches, and the size (FLOPs) at which half of that is reached. Device-class constants (cuBLAS on
# A100/H100 parts), not derived; the GPU presets replace them by their measured rate and SM count.
GEMM_EFFICIENCY = 0.85
GEMM_HALF_FLOPS = 2.0e9
# Output tiles cuBLAS / CUTLASS choose between for large 16-bit GEMMs on sm80 / sm90 (CTA tiles of
# the kernels the libraries ship); a GEMM takes whichever leaves the fewest idle SMs in its last wave.
TILES = ((256, 128), (128, 256), (128, 128))
SPLIT_K, MIN_SPLIT_K = 4, 1024


def wave_efficiency(m: int, n: int, sms: int, batch: int = 1, k: int = 0) -> float:
    """Useful share of the SM-time of the waves a GEMM's output tiles need: with tiles of Tm x Tn,
    ceil(m/Tm) ceil(n/Tn) batch tiles run in ceil(tiles / sms) waves of ``sms`` tiles, of which m n
    batch elements are useful (tile and wave quantisation); the best of the tile shapes in TILES, and
    of splitting k into up to SPLIT_K slices that each keep at least MIN_SPLIT_K of it (cuBLAS's
    split-K / stream-K kernels fill the last wave of a GEMM with few output tiles and a long k)."""
    best = 0.0
    for tm, tn in TILES:
        for split in range(1, SPLIT_K + 1):
            if split > 1 and k // split < MIN_SPLIT_K:
                break
            tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch * split
            waves = math.ceil(tiles / sms)
            best = max(best, m * n * batch * split / (waves * sms * tm * tn))
    return best


def size_factor(c: Cluster, t0: float) -> float:
    """What a GEMM that would take ``t0`` seconds at peak loses beyond its wave quantisation: the
    device's measured cuBLAS GEMMs (``gemm_measured``: m, n, k, TFLOP/s, with the peak and maximum
    achievable rate of their dtype), each as measured / (MAMF x its own wave efficiency), against its
    time at peak; interpolated in log t0, the end points held beyond the table, at most 1. Short GEMMs
    lose to their prologue, epilogue and launch; the loss is a matter of time, so one device's table
    in one dtype speaks for another dtype of similar kernels at the same duration."""
    table = c.gemm_measured
    if not table or not c.sm_count:
        return 1.0
    pts = sorted((2.0 * m * n * k / table["peak"],
                  min(1.0, tf * 1e12 / (table["mamf"] * wave_efficiency(m, n, c.sm_count, 1, k))))
                 for m, n, k, tf in table["rows"])
    if t0 <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if t0 <= x1:
            a = math.log(t0 / x0) / math.log(x1 / x0)
            return y0 + a * (y1 - y0)
    return pts[-1][1]


def gemm_efficiency(c: Cluster, dtype: str, m: int, n: int, k: int, batch: int = 1) -> float:
    """Fraction of the data-sheet peak the GEMM's arithmetic runs at (before the memory roofline)."""
    table = [r for r in c.measured.get("matmul", []) if r["dtype"] == dtype]
    if table:  # the nearest measured shape, distance in log m, log n, log k (aspect matters, not just size)
        def dist(r: dict) -> float:
            return sum(abs(math.log(a / r[key])) for a, key in ((m, "m"), (n, "n"), (k, "k")))

        return min(table, key=dist)["flops_per_s"] / c.peak(dtype)
    if c.sm_count and c.gemm_fraction:
        t0 = 2.0 * m * n * k * batch / c.peak(dtype)
        return c.gemm_fraction * size_factor(c, t0) * wave_efficiency(m, n, c.sm_count, batch, k)
    flops = 2.0 * m * n * k
    return GEMM_EFFICIENCY * flops / (flops + GEMM_HALF_FLOPS)


def gemm_time(c: Cluster, dtype: str, g: Gemm) -> float:
    """``dtype``: the pass's GEMM rate; a float8 GEMM (``g.dtype``) runs at the device's fp8 rate with
    1-byte operands (its efficiency from the same size terms: the presets' cuBLASLt table is FP8)."""
    dtype = g.dtype or dtype
    flops = 2.0 * g.m * g.n * g.k * g.batch
    t = flops / (c.peak(dtype) * gemm_efficiency(c, dtype, g.m, g.n, g.k, g.batch))
    if c.sm_count:  # roofline: inputs read once, the output written (and read when it accumulates)
        a = FP32 if dtype in ("fp32", "tf32") else 1 if dtype == "fp8" else 2  # TF32 reads fp32 operands
        nbytes = g.batch * ((g.m * g.k + g.k * g.n) * a + g.m * g.n * g.out_bytes * (2 if g.accumulate else 1))
        t = max(t, nbytes / stream_rate(c))
    return t


def stream_rate(c: Cluster) -> float:
    """Bytes/s a streaming (elementwise) kernel reaches."""
    return c.memory_bandwidth * c.stream_fraction


def flash_time(c: Cluster, dtype: str, flops: float, backward: bool) -> float:
    """A flash attention kernel's FLOPs at the preset's achieved fraction (forward, backward); without
    one, at the GEMM efficiency of a 128-wide head's products (a preset that states none)."""
    if flops == 0.0:
        return 0.0
    frac = c.attention_fraction
    eff = frac[1 if backward else 0] if frac else gemm_efficiency(c, dtype, 4096, 4096, 128)
    return flops / (c.peak(dtype) * eff)


def measured_attention(c: Cluster, dtype: str, s_q: int, s_k: int, d: int, heads: int) -> float | None:
    """Forward + backward seconds of the fused attention kernel from a measured profile (scaled by
    s_q s_k d from the nearest measured shape), or None without one."""
    table = [r for r in c.measured.get("attention", []) if r["dtype"] == dtype]
    if not table:
        return None
    row = min(table, key=lambda r: abs(math.log(s_q / r["seq"])) + abs(math.log(d / r["head_dim"])))
    return heads * row["seconds_per_head"] * s_q * s_k * d / (row["seq"] ** 2 * row["head_dim"])


@dataclass(frozen=True)
class PassTime:
    gemm: float
    attention: float
    memory: float
    launch_floor: float

    @property
    def total(self) -> float:
        return max(self.gemm + self.attention + self.memory, self.launch_floor)


def matmul_dtype(c: Cluster, precision: str, tf32: bool) -> str:
    """The rate fp32 GEMMs run at: TF32 where the runtime enables it and the device has it (not the
    attention kernel, which keeps its own)."""
    return "tf32" if precision == "fp32" and tf32 and "tf32" in c.peak_flops else precision


def pass_time(c: Cluster, dtype: str, p: Pass, attention_s: float | None = None, backward: bool = False,
              gemm_dtype: str | None = None) -> PassTime:
    """One pass's kernels; ``attention_s`` replaces the flash FLOPs' time when a profile measured it;
    ``gemm_dtype``: the GEMMs' rate when it is not ``dtype``'s (TF32)."""
    gemm = sum(gemm_time(c, gemm_dtype or dtype, g) for g in p.gemms)
    attn = attention_s if attention_s is not None else flash_time(c, dtype, p.attention_flops, backward)
    return PassTime(gemm, attn, p.stream_bytes / stream_rate(c), p.launches * c.launch_s)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one layer, one micro-batch, one rank: forward, input and weight gradients (without
    recompute), the attention core's forward (what selective recompute reruns), and the parts."""

    f: float
    bi: float
    bw: float
    attn_f: float
    parts: dict[str, float]
    f_gemms: tuple[float, ...] = ()  # the forward's GEMMs one by one (qkv, o, up, down)
    f_memory: float = 0.0  # the forward's memory-bound kernels


def layer_times_from(c: Cluster, dtype: str, work: LayerWork, measured_attn: float | None = None,
                     gemm_dtype: str | None = None) -> LayerTimes:
    """``measured_attn``: the profile's forward + backward of the attention core (a third forward)."""
    af = pass_time(c, dtype, work.attn_f, None if measured_attn is None else measured_attn / 3, gemm_dtype=gemm_dtype)
    ab = pass_time(c, dtype, work.attn_b, None if measured_attn is None else 2 * measured_attn / 3, backward=True,
                   gemm_dtype=gemm_dtype)
    f, bi, bw = (pass_time(c, dtype, p, backward=k > 0, gemm_dtype=gemm_dtype)
                 for k, p in enumerate((work.f, work.bi, work.bw)))
    parts = {"gemm": f.gemm + bi.gemm + bw.gemm + af.gemm + ab.gemm, "gemm_forward": f.gemm,
             "attention": af.attention + ab.attention, "memory_bound": f.memory + bi.memory + bw.memory
             + af.memory + ab.memory}
    f_gemms = tuple(gemm_time(c, gemm_dtype or dtype, g) for g in work.f.gemms)
    return LayerTimes(f.total + af.total, bi.total + ab.total, bw.total, af.total, parts, f_gemms, f.memory)
