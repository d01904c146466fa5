"""Mixture-of-experts expert compute: grouped GEMM, padded batched GEMM and a per-expert loop (issue 34).

    python benchmarks/bench_expert_gemm.py [--quick] [--precision fp32 bf16] [--reps 5] [--json F]   # ~3 min

One SwiGLU expert MLP (``mpformer/layers/expert_gemm.py``), forward + backward, over ``tokens x topk`` rows
already sorted by expert: for each shape (E experts, top-k, tokens, hidden h, expert ffn f), three ways:

    grouped  torch._grouped_mm with offs = cumsum(counts) for up (gate|up fused, [E, 2f, h]) and down, its
             backward _grouped_mm too (dX and dW)
    padded   rows scattered into [E, max count, h], torch.bmm, gathered back
    loop     F.linear over each expert's rows (what Hugging Face transformers does), the rows split and the
             weights unbound once (the helper's loop): the baseline
    loop, HF indexing  the same loop indexing as transformers' MixtralExperts does (w[e] and a row slice per
             expert): its backward writes a zero gradient of the whole tensor per expert (written here)

Routing is seeded top-k over softmax(random logits + a Zipf-like bias per expert, -0.15 log(1 + rank)), with the last
expert's logits at -inf (one empty expert in every shape): the counts are uneven (max / mean printed) as a
trained router's are. Before timing, each method's output and its gradients (x, w_up, w_down) are checked
against the loop: within 1e-5 relative (max |difference| / max |loop|) in fp32, or the benchmark fails;
bf16's error is reported. Time is the median of ``--reps`` fwd+bwd steps per method after ``--warmup``,
the methods alternating step by step (common.interleave); ratio = loop's median / this one (> 1: faster).
On CPU the time compared is the process's CPU time with one torch thread (``--threads``), as in
bench_cross_entropy.py: on a shared 2-core machine wall time (also given) mostly measures the neighbours;
on CUDA (``--device cuda``) it is wall time between ``torch.cuda.synchronize()`` calls, one before the
clock is read and one before it is read again (kernels launch asynchronously: without them the time
is the launches'), the data made on the GPU by a seeded CUDA generator (a CPU randn of Mixtral's
expert weights takes seconds), and the peak memory of each method's step is reported.
``--device meta`` runs the same calls on shapes alone (gpu_budget.py counts their FLOPs there; no
check, no meaningful time). benchmarks/gpu_check.sh's ``moe`` part runs it on the GPU:

    --device cuda --precision bf16      (its default shapes there, GPU_SHAPES: Mixtral 8x7B's experts, E 8,
    top 2, h 4096, f 14336, and Qwen3-30B-A3B's, E 128, top 8, h 2048, f 768; 8192 tokens each)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, format_table, interleave, median, quartiles, write_json

from mpformer.layers.expert_gemm import METHODS, choose_method, expert_mlp, grouped_ok

SHAPES = ((8, 2, 4096, 512, 1024), (64, 8, 4096, 512, 256))  # and --shapes 16,2,4096,1024,2048 --precision fp32
# a GPU's default (--device cuda, and meta, where gpu_budget.py counts the same run's FLOPs): Mixtral 8x7B's
# and Qwen3-30B-A3B's expert layers at 8192 tokens
GPU_SHAPES = ((8, 2, 8192, 4096, 14336), (128, 8, 8192, 2048, 768))
QUICK = ((8, 2, 512, 128, 256), (64, 8, 256, 128, 64))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def route(E: int, topk: int, tokens: int, seed: int) -> list[int]:
    """Rows per expert of a seeded top-k routing with a mild Zipf-like imbalance and one dead expert."""
    g = torch.Generator().manual_seed(seed)
    rank = torch.randperm(E, generator=g).float()
    logits = torch.randn(tokens, E, generator=g) - 0.15 * torch.log1p(rank)
    logits[:, E - 1] = float("-inf")
    experts = torch.softmax(logits, -1).topk(topk, -1).indices.flatten()
    return torch.bincount(experts, minlength=E).tolist()


def make(E: int, h: int, f: int, counts: list[int], dtype: torch.dtype, device: str, seed: int):
    """x [N, h], w_up [E, 2f, h], w_down [E, h, f], dy [N, h]: seeded, made where they are used (a CUDA
    generator on a GPU; shapes alone on meta)."""
    n = sum(counts)
    shapes, scales = ((n, h), (E, 2 * f, h), (E, h, f), (n, h)), (1.0, 1 / math.sqrt(h), 1 / math.sqrt(f), 1.0)
    kind = torch.device(device).type
    if kind == "meta":
        return [torch.empty(s, dtype=dtype, device=device) for s in shapes]
    g = torch.Generator(device if kind == "cuda" else "cpu").manual_seed(seed)
    where = device if kind == "cuda" else "cpu"
    return [(torch.randn(s, generator=g, device=where) * c).to(device=device, dtype=dtype)
            for s, c in zip(shapes, scales)]


HF = "loop, HF indexing"
CANDIDATES = (*METHODS, HF)


def hf_loop(x: torch.Tensor, counts: list[int], w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """transformers' MixtralExperts.forward on sorted rows: index the 3-D weights and slice the rows per expert."""
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c:
            gate, up = torch.nn.functional.linear(x[start:start + c], w_up[e]).chunk(2, dim=-1)
            outs.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down[e]))
            start += c
    return torch.cat(outs)


def step(method: str, counts: list[int], x, w_up, w_down, dy) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().requires_grad_(True) for t in (x, w_up, w_down)]
    if method == HF:
        y = hf_loop(leaves[0], counts, leaves[1], leaves[2])
    else:
        y = expert_mlp(leaves[0], counts, leaves[1], leaves[2], method=method)
    y.backward(dy)
    return y, [t.grad for t in leaves]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.device.type == "meta":
        return float("nan")  # no values: nothing to compare
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", help="E,topk,tokens,h,f each (default: SHAPES; GPU_SHAPES on cuda)")
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="two tiny shapes, 5 steps: a smoke run")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    gpu = torch.device(a.device).type in ("cuda", "meta")
    default = QUICK if a.quick else GPU_SHAPES if gpu else SHAPES
    shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes] if a.shapes else list(default)
    reps = max(5, a.reps)
    env = environment()
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    native_bf16 = {k: k in flags.split() for k in ("avx512_bf16", "amx_bf16")}
    env["native_bf16"] = native_bf16
    if cuda:
        env["cuda_device"] = torch.cuda.get_device_name()
    rows, results = [], []
    headers = ["shape", "method"]
    for prec in a.precision:
        headers += [f"{prec} {'' if cuda else 'CPU '}ms", f"{prec} vs loop", f"{prec} wall ms", f"{prec} rel err"]

    for E, k, tokens, h, f in shapes:
        counts = route(E, k, tokens, a.seed)
        n, cap = sum(counts), max(counts)
        info = {"E": E, "topk": k, "tokens": tokens, "h": h, "f": f, "rows": n, "max_count": cap,
                "max_over_mean": cap / (n / E), "empty_experts": counts.count(0), "padded_rows": E * cap,
                "counts": counts}
        flop = 6 * n * 3 * h * f  # forward 2 * n * (h * 2f + f * h), backward twice that
        per_dtype = {}
        for prec in a.precision:
            dtype = DTYPES[prec]
            methods = [m for m in CANDIDATES if m != "grouped" or grouped_ok(torch.device(a.device).type, dtype, h, f)]
            args = make(E, h, f, counts, dtype, a.device, a.seed + 1)
            y_ref, g_ref = step("loop", counts, *args)
            errors = {}
            for m in methods:
                if m == "loop":
                    continue
                y, grads = step(m, counts, *args)
                errors[m] = max(rel_err(y, y_ref), *(rel_err(p, q) for p, q in zip(grads, g_ref)))
                if dtype == torch.float32 and errors[m] > 1e-5:  # nan (meta) passes
                    raise SystemExit(f"{m} differs from the loop by {errors[m]:.2e} (relative) at {info}")
            del y_ref, g_ref

            cpu_times: dict[str, list[float]] = {m: [] for m in methods}
            peak: dict[str, int] = {m: 0 for m in methods}

            def timed(m: str, args=args, counts=counts, cpu_times=cpu_times, peak=peak):
                def run() -> list[float]:
                    sync()  # the queue empty before the clock is read: the time is this step's alone
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                    t0, c0 = time.perf_counter(), time.process_time()
                    step(m, counts, *args)
                    sync()  # every kernel of the step done before the clock is read again
                    t1 = time.perf_counter()
                    cpu_times[m].append(time.process_time() - c0)
                    if cuda:
                        peak[m] = max(peak[m], torch.cuda.max_memory_allocated())
                    return [t1 - t0]
                return run

            for m in methods:
                for _ in range(a.warmup):
                    timed(m)()
            for m in methods:
                cpu_times[m].clear()
            wall = interleave({m: timed(m) for m in methods}, reps)
            t = wall if cuda else cpu_times  # the compute itself on CPU; a GPU's time is wall time
            base = median(t["loop"])
            per_dtype[prec] = {m: {"median_s": median(t[m]), "quartiles_s": quartiles(t[m]), "times_s": t[m],
                                   "wall_median_s": median(wall[m]), "wall_times_s": wall[m],
                                   "ratio_vs_loop": base / median(t[m]), "gflops": flop / median(t[m]) / 1e9,
                                   "max_rel_err_vs_loop": errors.get(m, 0.0),
                                   **({"peak_bytes": peak[m]} if cuda else {})} for m in methods}
            per_dtype[prec]["choose_method"] = choose_method(torch.device(a.device).type, dtype, h, f)
            del args
        results.append({**info, "flop_fwd_bwd": flop, "results": per_dtype})
        label = f"E{E} k{k} T{tokens} h{h} f{f}"
        for m in CANDIDATES:
            row = [label, m]
            for prec in a.precision:
                r = per_dtype[prec].get(m)
                row += [f"{r['median_s'] * 1e3:.1f}", f"{r['ratio_vs_loop']:.2f}", f"{r['wall_median_s'] * 1e3:.1f}",
                        f"{r['max_rel_err_vs_loop']:.1e}" if m != "loop" else "ref"] if r else ["-"] * 4
            rows.append(row)
        print(f"{label}: {n} rows, max/mean count {info['max_over_mean']:.2f}, {info['empty_experts']} empty, "
              f"padded to {E * cap} rows", flush=True)
        print(format_table(headers, rows[-len(CANDIDATES):]), flush=True)

    where = env.get("cuda_device") or f"{env['cpu_model']} ({env['cpu_capability']}; avx512_bf16 "\
        f"{'yes' if native_bf16['avx512_bf16'] else 'no'}, amx_bf16 {'yes' if native_bf16['amx_bf16'] else 'no'})"
    print(f"{where}, torch {env['torch']}, {torch.get_num_threads()} threads; fwd+bwd, median of {reps} after "
          f"{a.warmup} warm-up, ratio = loop / this{'' if cuda else ' in process CPU time'}")
    print(format_table(headers, rows))
    if a.json:
        write_json(a.json, {"args": {k_: str(v_) for k_, v_ in vars(a).items()}, "environment": env,
                            "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
