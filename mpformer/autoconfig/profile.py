"""Calibration on the machine at hand: kernel rates, the cost of sharing cores, collectives.

    python -m mpformer.autoconfig.profile [--out configs/cluster/local-cpu-profile.json] [--ranks 2 3 4]
    python -m mpformer.autoconfig.profile --device cuda --out configs/cluster/NAME-profile.json

About a minute on a 2-core machine, one process per rank and one thread each (as pretrain runs):

* matmul: FLOP/s of fp32 (and bf16) GEMMs of transformer shapes, attention's per-head products
  included, so the cost model takes an efficiency by shape instead of one constant;
* attention: causal scaled-dot-product attention, forward + backward, seconds per head by shape;
* memory: an elementwise add's bytes/s (norms, activations, the optimizer step);
* one run of max(--ranks) processes, in rounds (the machine's speed drifts by tens of percent within
  minutes, not within a round, so every figure is a ratio within a round, the median over rounds):
  - reference: the forward + backward time of a small Llama (``REFERENCE``, not a model the
    benchmarks train) alone; the cost model's prediction for it against this calibrates what the
    kernel terms miss (framework overhead);
  - sharing: the same run by k processes at once (k = 1 and each of --ranks): per-rank time over time
    alone. A CPU host runs more ranks than cores; this is how much slower each computes while k
    compute, which the cost model applies to every stretch of a pipeline's timeline;
  - layouts: the reference model trained one step in a few layouts of all the ranks (1F1B pipelines
    of two depths, tensor-parallel pairs; ``reference_layouts``) as the trainer runs them, against
    steps of the same micro-batches with every rank computing without a break right before and after:
    what the processor-sharing timeline and the collectives' fits miss (calibration.py). Few on
    purpose: benchmarks/bench_autoconfig.py scores the cost model on layouts none of these equals;
  - collectives: all-reduce, all-gather and reduce-scatter over gloo, message sizes 4 KiB - 16 MiB, in
    concurrent groups of each size dividing max(--ranks) with every process running and computing
    between collectives, as in training (on shared cores the latency is mostly the wait for the other
    ranks to be scheduled, which an idle benchmark does not see); per op and group size a fit of
    ``t = alpha + bus_bytes / beta`` in relative error (bus bytes: the ring-adjusted bytes each rank
    moves, as the CommLedger counts them), used by the cost model per op and group size;
  - context parallelism's attention (ring, all-gather, Ulysses) at each such group size, at two
    sequence lengths of the reference's attention shape, against the fused kernel's share of a rank:
    what cp costs on shared cores beyond the kernel the compute model times (cp_cost.py);
* the reference alone, one step in turn each: with the split backward of the zero-bubble schedules,
  and its tokens as four short micro-batches (the host's cost per kernel launched), against one pass.

The JSON's ``cluster`` section overrides the preset's peak rate, memory bandwidth and link numbers.
``--device cuda`` measures one GPU's matmul, attention and memory rates (no collectives).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from mpformer.autoconfig.links import RING_FACTOR  # bus bytes per buffer byte, as the cost model counts them
from mpformer.autoconfig.profile_ranks import REFERENCE, REFERENCE_SEQ, profile_alone_ratios, profile_shared
from mpformer.core.errors import ArgumentParser

# Transformer-like GEMMs (tokens x out x in), and attention's per-head products (s x s x d, s x d x s).
SHAPES = [(256, 256, 256), (512, 512, 512), (256, 1024, 256), (1024, 1024, 1024), (128, 2048, 512),
          (2048, 512, 2048), (512, 4096, 512), (1024, 4096, 1024), (256, 256, 32), (256, 32, 256),
          (512, 512, 64), (512, 64, 512), (1024, 1024, 128), (1024, 128, 1024)]


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of t = alpha + x / beta over (bus_bytes x, seconds t) in relative error (weights
    1/t^2): the small messages that fix alpha count as much as the large ones that fix beta; alpha >= 0."""
    w = [1.0 / max(t, 1e-12) ** 2 for _, t in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, points)) / sw
    var = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
    slope = sum(wi * (x - mx) * (t - mt) for wi, (x, t) in zip(w, points)) / var if var > 0 else 0.0
    alpha = max(mt - slope * mx, 0.0)
    return alpha, (1.0 / slope if slope > 0 else float("inf"))


def _device_wait(device: str):
    """What waits for the device's queue before a clock is read (None on CPU)."""
    from mpformer.parallel.device import Device

    return Device(device).synchronize if device != "cpu" else None


def _time(fn, min_time: float, sync=None) -> float:
    """Seconds per call: doubling batches of calls until one batch lasts ``min_time``; ``sync`` waits
    for an accelerator's queue (once per batch, so that short kernels are not timed as launches)."""
    fn()
    if sync is not None:
        sync()
    reps = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if sync is not None:
            sync()
        dt = time.perf_counter() - t0
        if dt >= min_time:
            return dt / reps
        reps *= 2


def profile_matmul(dtypes: Sequence[str] = ("fp32", "bf16"), threads: int = 1,
                   min_time: float = 0.06, sync=None, device: str = "cpu") -> list[dict]:
    """FLOP/s by shape; ``sync`` (a barrier) lines up concurrent ranks so that they share the cores."""
    import torch

    torch.set_num_threads(threads)
    out = []
    wait = _device_wait(device)
    for dt in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
        shapes = GPU_SHAPES if device != "cpu" else SHAPES if dt == "fp32" else [
            (m, n, k) for m, n, k in SHAPES if 2 * m * n * k <= 3e8]  # CPU bf16 is slow: its small GEMMs only
        for m, n, k in shapes:
            a, b = torch.randn(m, k, device=device).to(dtype), torch.randn(n, k, device=device).to(dtype)
            if sync is not None:
                sync()
            sec = _time(lambda a=a, b=b: a @ b.t(), min_time, wait)  # the forward's x W^T layout
            out.append({"dtype": dt, "m": m, "n": n, "k": k, "flops_per_s": 2 * m * n * k / sec})
    return out


ATTENTION = [(256, 32), (512, 64), (1024, 64), (1024, 128)]  # (sequence, head dim), causal
GPU_SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (2048, 8192, 2048),
              (4096, 14336, 4096), (4096, 4096, 14336), (16384, 4096, 4096), (8192, 1024, 8192), (4096, 128256, 4096),
              (2048, 2048, 128), (2048, 128, 2048), (4096, 4096, 128), (8192, 8192, 128), (1024, 1024, 64)]
GPU_ATTENTION = [(1024, 64), (2048, 128), (4096, 128), (8192, 128)]


def profile_attention(dtypes: Sequence[str] = ("fp32", "bf16"), threads: int = 1, min_time: float = 0.06,
                      sync=None, heads: int = 2, device: str = "cpu") -> list[dict]:
    """Seconds per head of causal scaled-dot-product attention, forward + backward, by shape: the fused
    kernel's efficiency differs from a GEMM's (masking, online softmax, the backward's recompute)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    out = []
    for dt in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
        shapes = GPU_ATTENTION if device != "cpu" else ATTENTION[:2] if dt == "bf16" else ATTENTION  # CPU bf16: slow
        for seq, d in shapes:
            q, k, v = (torch.randn(1, heads, seq, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
            grad = torch.randn(1, heads, seq, d, dtype=dtype, device=device)

            def step(q=q, k=k, v=v, grad=grad) -> None:
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

            if sync is not None:
                sync()
            sec = _time(step, min_time, _device_wait(device))
            out.append({"dtype": dt, "seq": seq, "head_dim": d, "seconds_per_head": sec / heads})
    return out


def profile_memory_bandwidth(threads: int = 1, min_time: float = 0.2, device: str = "cpu") -> float:
    """Bytes/s of an elementwise kernel (read two, write one) on tensors far larger than the caches:
    the rate norms, activations and the optimizer step run at."""
    import torch

    torch.set_num_threads(threads)
    n = 8 * 2**20 if device == "cpu" else 256 * 2**20
    x, y, z = (torch.randn(n, device=device) for _ in range(3))
    sec = _time(lambda: torch.add(x, y, out=z), min_time, _device_wait(device))
    return 3 * x.numel() * 4 / sec


def summarise(matmul: list[dict], collectives: list[dict]) -> dict:
    fits = {}
    for op in RING_FACTOR:
        for n in sorted({c["ranks"] for c in collectives}):
            pts = [(c["bus_bytes"], c["seconds"]) for c in collectives if c["op"] == op and c["ranks"] == n]
            if pts:
                alpha, beta = fit_alpha_beta(pts)
                fits[f"{op}/{n}"] = {"alpha_s": alpha, "beta_bytes_per_s": beta}
    peak = {dt: max(r["flops_per_s"] for r in matmul if r["dtype"] == dt) for dt in {r["dtype"] for r in matmul}}
    ar = [f for k, f in fits.items() if k.startswith("all_reduce/")]
    cluster = {"peak_flops": peak}
    if ar:
        cluster.update(intra_bandwidth=min(f["beta_bytes_per_s"] for f in ar),
                       intra_latency=max(f["alpha_s"] for f in ar))
        cluster.update(inter_bandwidth=cluster["intra_bandwidth"], inter_latency=cluster["intra_latency"])
    return {"cluster": cluster, "matmul": matmul, "collectives": collectives, "fits": fits}


def _reference_meta() -> dict:
    return {"model": REFERENCE, "seq_length": REFERENCE_SEQ, "micro_batch_size": 1, "precision": "fp32"}


def main(argv: Sequence[str] | None = None) -> int:
    ap = ArgumentParser(description="Measure this machine for the auto-configurator's local-cpu cluster.")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "configs" / "cluster" /
                                          "local-cpu-profile.json"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4],
                    help="process counts whose shared-core rates are measured; the largest also runs the "
                         "collectives, in groups of each count that divides it")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (as pretrain gives each rank)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: this GPU's matmul, attention and memory rates (no collectives: one device)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.device == "cuda":
        return _profile_gpu(Path(args.out), t0)
    phases, t = {}, time.perf_counter()
    shared = asdict(profile_shared(args.ranks))  # the JSON sections: the fields are its keys (profile_results.py)
    phases["ranks"] = {**shared["seconds"], "total": time.perf_counter() - t}
    t = time.perf_counter()
    result = summarise(profile_matmul(threads=args.threads), shared["collectives"])
    phases["matmul"], t = time.perf_counter() - t, time.perf_counter()
    # The split backward and short micro-batches against one pass, alone, step by step in turn.
    reference = {**_reference_meta(), **shared["reference"], **asdict(profile_alone_ratios(args.threads))}
    phases["split_backward"], t = time.perf_counter() - t, time.perf_counter()
    result["cluster"]["memory_bandwidth"] = profile_memory_bandwidth(args.threads)
    result["attention"] = profile_attention(threads=args.threads)
    phases["memory_attention"] = time.perf_counter() - t
    result["phase_seconds"] = phases
    result["reference"] = reference
    result["loaded"] = shared["loaded"]
    result["layouts"] = shared["layouts"]
    result["cp_attention"] = shared["cp_attention"]
    result["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"profile written to {args.out} in {result['seconds']:.0f} s: peak "
          + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in result["cluster"]["peak_flops"].items())
          + f"; all-reduce {result['cluster'].get('intra_bandwidth', 0) / 1e9:.2f} GB/s; memory "
          f"{result['cluster']['memory_bandwidth'] / 1e9:.1f} GB/s")
    return 0


def _profile_gpu(out: Path, t0: float) -> int:
    from mpformer.core.errors import ConfigError
    from mpformer.parallel.device import resolve_device

    try:
        device = resolve_device("cuda", 0)
    except ConfigError:
        raise ConfigError("--device cuda: this torch sees no CUDA device; valid here: --device cpu") from None

    matmul = profile_matmul(("bf16", "fp32"), device="cuda")
    result = summarise(matmul, [])
    result["cluster"]["memory_bandwidth"] = profile_memory_bandwidth(device="cuda")
    result["attention"] = profile_attention(("bf16",), heads=16, device="cuda")
    result["device"] = device.name()
    result["seconds"] = time.perf_counter() - t0
    out.write_text(json.dumps(result, indent=1))
    print(f"profile of {result['device']} written to {out} in {result['seconds']:.0f} s: peak "
          + ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in result["cluster"]["peak_flops"].items())
          + f"; memory {result['cluster']['memory_bandwidth'] / 1e12:.2f} TB/s")
    return 0


if __name__ == "__main__":
    from mpformer.core.errors import user_errors_to_exit

    raise SystemExit(user_errors_to_exit(main)())
