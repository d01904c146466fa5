"""The attention kernels of gpu_check.sh: one cp rank's ring blocks and a document-masked layer on one device.

    python benchmarks/gpu_kernels.py [--seq 16384] [--device cuda|cpu] [--json F]

Three timings of one attention layer's forward + backward (bf16 on CUDA, fp32 on CPU; Llama 3 8B's
heads by default: 32 query and 8 kv heads of 128), each against torch's SDPA over the whole causal
sequence (``sdpa``) in the same run, with parity and the cost model's prediction beside it:

    cp=2 ring rank 0   the blocks a rank of a cp=2 ring computes (its zigzag chunks against both ranks'
                       keys, merged by log-sum-exp; no communication: one GPU serves one rank), the
                       cost model's cp rank (half the causal pairs)
    documents          data.document_mask's blocks (documents of ``--doc`` tokens, each its own causal
                       block on the fused kernel) against SDPA run on each document alone, causal
                       (parity: the same attention; a dense [s, s] document mask through SDPA would
                       take its math kernel, about 96 GiB at 16k tokens, beyond an 80 GB GPU) and
                       against plain causal SDPA over the whole sequence (time)
    error              largest |difference| of the output and of dq, dk, dv over the reference's largest
                       element (its own precision's rounding: bf16 ~1e-2, fp32 ~1e-6)

Each case also runs once under torch's profiler: the attention ops it lists (``kernels``: flash,
efficient, cudnn, math, cpu_flash) against the one the runtime chooses and the cost model prices
(context_parallel/fused.py ``attention_kernel``); a case whose profile differs is printed as a
MISMATCH and the script exits 3 (after writing its JSON).

The prediction is the cost model's fused-kernel time (autoconfig/compute.py flash_time) on the
device's cluster preset, for the pairs each case computes: the check calibrates it. The JSON is
written after each case, so a case that fails or times out leaves the ones before it.

``--device meta`` runs it on data-free tensors (timings and errors meaningless): what
tests/integration/test_gpu_check.py rehearses at full size against an 80 GB GPU's memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

PRESETS = {"H200": "h200-node", "H100": "dgx-h100", "A100": "dgx-a100-80gb"}


def _timed(fn, device: str, reps: int) -> tuple[float, object]:
    out = fn()  # warm-up (and the result checked)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], g: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, inputs, g))


# The profiler's op names (aten, as any device lists them) -> the kernel they are.
PROFILED = {"_flash_attention_forward": "flash", "_flash_attention_backward": "flash",
            "_efficient_attention_forward": "efficient", "_efficient_attention_backward": "efficient",
            "_cudnn_attention_forward": "cudnn", "_cudnn_attention_backward": "cudnn",
            "_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
            "_scaled_dot_product_flash_attention_for_cpu_backward": "cpu_flash",
            "_scaled_dot_product_attention_math": "math"}


def profiled_kernels(fn, device: str) -> dict[str, int]:
    """The attention kernels one call of ``fn`` ran, by the profiler's op names (what a GPU's trace lists)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
    out: dict[str, int] = {}
    for e in prof.events():
        kind = PROFILED.get(e.name.removeprefix("aten::"))
        if kind is not None:
            out[kind] = out.get(kind, 0) + 1
    return out


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max())


def _predicted(device_name: str, dtype: str, pairs: float, heads: int, d: int) -> float | None:
    """The cost model's fused attention forward + backward for ``pairs`` query-key products per head."""
    from mpformer.autoconfig.cluster import load_cluster
    from mpformer.autoconfig.compute import flash_time

    # The CPU dry run prices an H100 (the code path, not a prediction for this machine).
    preset = next((v for k, v in PRESETS.items() if k in device_name), "dgx-h100" if device_name == "cpu" else None)
    if preset is None:
        return None
    c = load_cluster(preset, nodes=1)
    flops = 4.0 * pairs * d * heads
    return flash_time(c, dtype, flops, False) + flash_time(c, dtype, 2.5 * flops, True)


def main(argv: list[str] | None = None) -> int:
    from mpformer.context_parallel.blockwise import doc_starts, local_attention
    from mpformer.context_parallel.context import document_ids
    from mpformer.core.attention_plan import plan, plan_pairs
    from mpformer.core.sequence import concat, positions, rank_segments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--doc", type=int, default=2048, help="document length of the masked case")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu", "meta"])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_kernels.py: no CUDA device visible (--device cpu runs the dry run)")
    dev, dtype = a.device, torch.float32 if a.device == "cpu" else torch.bfloat16
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    s, n, kv, d = a.seq, a.heads, a.kv_heads, a.head_dim
    gen = torch.Generator(device=dev).manual_seed(0) if dev != "meta" else None
    q, k, v = (torch.randn(1, h, s, d, device=dev, dtype=dtype, generator=gen) for h in (n, kv, kv))
    g = torch.randn(1, n, s, d, device=dev, dtype=dtype, generator=gen)
    scale = d ** -0.5

    def sdpa(part: slice = slice(None)):
        """SDPA over positions ``part``, causal: the whole sequence, or one document."""
        x = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
        if dev == "meta":  # torch's SDPA picks math on meta tensors; the kernel a GPU runs instead
            from mpformer.context_parallel.fused import causal_attention

            out = causal_attention(*x, scale=scale)
        else:
            out = F.scaled_dot_product_attention(*x, is_causal=True, scale=scale, enable_gqa=True)
        return out, _grads(out, x, g[:, :, part])

    def save() -> None:  # after each case: a later one's failure or timeout keeps the earlier figures
        if a.json:
            write_json(a.json, {"device": name, "args": {k: str(x) for k, x in vars(a).items()},
                                "environment": environment(), "results": results})

    from mpformer.context_parallel.fused import attention_kernel

    chosen = attention_kernel("cpu" if dev == "cpu" else "cuda", dtype, d)  # unmasked blocks, no dropout
    mismatches: list[str] = []

    def kernels(case: str, fn) -> dict:
        seen = profiled_kernels(fn, dev)
        if set(seen) != {chosen}:
            mismatches.append(f"{case}: profiled {seen}, chosen {chosen}")
        return {"profiled": seen, "chosen": chosen, "match": set(seen) == {chosen}}

    t_sdpa, (ref, ref_grads) = _timed(sdpa, dev, a.reps)
    rows, results = [["sdpa (causal)", f"{t_sdpa * 1e3:.1f}", "1.00", "-", "-"]], {"sdpa_s": t_sdpa}
    save()

    # One rank of a cp=2 ring: its chunks against its own keys and the other rank's, on this device.
    mine, other = rank_segments(s, 2, 0), rank_segments(s, 2, 1)
    idx_q = torch.tensor(positions(mine), device=dev)
    idx_k = torch.tensor(positions(concat([mine, other])), device=dev)

    def ring_rank():
        x = [q[:, :, idx_q].clone().requires_grad_(), k[:, :, idx_k].clone().requires_grad_(),
             v[:, :, idx_k].clone().requires_grad_()]
        out = local_attention(*x, mine, concat([mine, other]), None, None, scale)
        return out, _grads(out, x, g[:, :, idx_q])

    t_ring, (out, grads) = _timed(ring_rank, dev, a.reps)
    err = max(_err(out, ref[:, :, idx_q]), _err(grads[0], ref_grads[0][:, :, idx_q]))
    pairs = plan_pairs(plan(mine, concat([mine, other])))
    pred = _predicted(name, "bf16" if dev == "cuda" else "fp32", pairs, n, d)
    rows.append(["cp=2 ring rank 0", f"{t_ring * 1e3:.1f}", f"{t_ring / t_sdpa:.2f}", f"{err:.1e}",
                 "-" if pred is None else f"{pred * 1e3:.1f}"])
    results["ring_rank"] = {"seconds": t_ring, "vs_sdpa": t_ring / t_sdpa, "error": err, "pairs": pairs,
                            "predicted_s": pred, "kernels": kernels("cp=2 ring rank 0", ring_rank)}
    save()
    del ref, ref_grads, out, grads

    # Packed documents of a.doc tokens: the per-document blocks against SDPA with the dense mask.
    tokens = torch.ones(1, s, dtype=torch.long)
    tokens[0, a.doc - 1::a.doc] = 0
    docs = document_ids(tokens, 0)
    starts = doc_starts(docs)
    seg = concat([rank_segments(s, 1, 0)])

    def documents():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = local_attention(*x, seg, seg, starts, None, scale)
        return out, _grads(out, x, g)

    t_docs, (out, grads) = _timed(documents, dev, 2)
    err = 0.0
    for lo, hi in zip((0, *starts[0]), (*starts[0], s)):  # each document alone: its causal SDPA
        want, want_grads = sdpa(slice(lo, hi))
        err = max(err, _err(out[:, :, lo:hi], want),
                  *(_err(x[:, :, lo:hi], y) for x, y in zip(grads, want_grads)))
        del want, want_grads
    pairs = plan_pairs(plan(seg, seg, None, starts[0]))
    pred = _predicted(name, "bf16" if dev == "cuda" else "fp32", pairs, n, d)
    rows.append(["documents", f"{t_docs * 1e3:.1f}", f"{t_docs / t_sdpa:.2f}", f"{err:.1e}",
                 "-" if pred is None else f"{pred * 1e3:.1f}"])
    results["documents"] = {"seconds": t_docs, "vs_sdpa": t_docs / t_sdpa, "error": err, "pairs": pairs,
                            "predicted_s": pred, "kernels": kernels("documents", documents)}
    for row, case in zip(rows[1:], ("ring_rank", "documents")):
        k = results[case]["kernels"]
        row.append(",".join(f"{x}:{c}" for x, c in sorted(k["profiled"].items())) + ("" if k["match"] else " MISMATCH"))
    rows[0].append("-")
    print(f"{name}, {dtype}: one attention layer forward + backward, {s} tokens, heads {n}/{kv} of {d}")
    print(format_table(["case", "ms", "vs sdpa", "error", "cost model ms", f"kernels (chosen: {chosen})"], rows))
    results["kernel_mismatches"] = mismatches
    save()
    if mismatches:
        print("kernel MISMATCH: " + "; ".join(mismatches), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
