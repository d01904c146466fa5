"""Calibration on the machine at hand: matmul rate by shape, collective bandwidth and latency.

    python -m mpformer.autoconfig.profile --out configs/cluster/local-cpu-profile.json [--ranks 2 4]

Under a minute on a 2-core machine. Matmul: fp32 (and bf16) GEMMs of transformer-like shapes with
the thread count one rank gets; the result is FLOP/s per shape, so the cost model interpolates an
efficiency by shape instead of assuming one constant. Collectives: all-reduce, all-gather and
reduce-scatter over gloo for group sizes ``--ranks`` and message sizes from 4 KiB to 16 MiB; per
op and group size a least-squares fit of ``t = alpha + bus_bytes / beta`` (bus bytes: the ring-
adjusted bytes each rank moves, as the CommLedger counts them). The JSON's ``cluster`` section
overrides the preset's peak rate and link numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

SHAPES = [(256, 256, 256), (512, 512, 512), (256, 1024, 256), (1024, 1024, 1024), (128, 2048, 512),
          (2048, 512, 2048), (512, 4096, 512), (1024, 4096, 1024)]
SIZES = [4 * 2**10, 64 * 2**10, 1 * 2**20, 4 * 2**20, 16 * 2**20]
RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of t = alpha + x / beta over (bus_bytes x, seconds t); alpha >= 0."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (t - mt) for x, t in points) / var if var > 0 else 0.0
    alpha = max(mt - slope * mx, 0.0)
    return alpha, (1.0 / slope if slope > 0 else float("inf"))


def _time(fn, min_time: float) -> float:
    fn()
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        dt = time.perf_counter() - t0
        if dt >= min_time:
            return dt / reps


def profile_matmul(dtypes: Sequence[str] = ("fp32", "bf16"), threads: int = 1,
                   min_time: float = 0.15) -> list[dict]:
    import torch

    torch.set_num_threads(threads)
    out = []
    for dt in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
        for m, n, k in SHAPES:
            a, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
            sec = _time(lambda a=a, b=b: a @ b.t(), min_time)  # the forward's x W^T layout
            out.append({"dtype": dt, "m": m, "n": n, "k": k, "flops_per_s": 2 * m * n * k / sec})
    return out


def _collectives_worker(sizes: Sequence[int]) -> list[dict]:
    import torch
    import torch.distributed as dist

    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    n, out = dist.get_world_size(), []
    for size in sizes:
        elems = size // 4
        elems -= elems % n
        x, part, full = torch.ones(elems), torch.empty(elems // n), torch.empty(elems)
        ops = {"all_reduce": lambda x=x: dist.all_reduce(x),
               "all_gather": lambda full=full, part=part: dist.all_gather_into_tensor(full, part),
               "reduce_scatter": lambda part=part, x=x: reduce_scatter(part, x)}
        reps = 20 if size <= 64 * 2**10 else 10 if size <= 2**20 else 4  # the same on every rank
        for name, fn in ops.items():
            fn()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sec = (time.perf_counter() - t0) / reps
            out.append({"op": name, "ranks": n, "bytes": elems * 4,
                        "bus_bytes": RING_FACTOR[name] * elems * 4 * (n - 1) / n, "seconds": sec})
    return out


def profile_collectives(ranks: Sequence[int] = (2, 4)) -> list[dict]:
    from mpformer.testing.spawn import run_distributed

    out = []
    for n in ranks:
        out += run_distributed(_collectives_worker, n, args=(SIZES,), timeout=120)[0]
    return out


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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Measure this machine for the auto-configurator's local-cpu cluster.")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "configs" / "cluster" /
                                          "local-cpu-profile.json"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (as pretrain gives each rank)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result = summarise(profile_matmul(threads=args.threads), profile_collectives(args.ranks))
    result["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"profile written to {args.out} in {result['seconds']:.0f} s: peak "
          + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in result["cluster"]["peak_flops"].items())
          + f"; all-reduce {result['cluster'].get('intra_bandwidth', 0) / 1e9:.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
