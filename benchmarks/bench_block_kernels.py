"""Candidate kernels for one block of attention with its log-sum-exp, on this CPU (what fused.py chose).

    python benchmarks/bench_block_kernels.py [--seq 4096] [--reps 3] [--json F]      # ~1 min, one thread

One block of ``--seq`` queries against ``--seq`` keys (heads 8/2 kv, head dim 32, fp32), a full block
and a causal one, forward and forward + backward, each candidate against the fused op mpformer runs:

    fused op        aten._scaled_dot_product_flash_attention_for_cpu and its backward (the choice)
    fused op, mask  the same with an additive mask of the block's size (a masked block's path)
    einsum tiles    the kernel mpformer ran before: scores, softmax statistics and products as einsums over
                    1024 x 1024 tiles in fp32 (written here for the comparison)
    math            SDPA with an explicit boolean mask: the whole [s, s] score matrix
    flex (compiled) FlexAttention with a block mask, forward only: torch 2.13 compiles it on CPU for
                    inference alone, without return_lse (tried, its error recorded), so it can neither
                    train nor merge blocks here (it is a CUDA candidate)

Time is the median of ``--reps`` after a warm-up; flex's first call (compilation) is reported apart.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, median, write_json

_aten = torch.ops.aten


def _time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts)


BEFORE = "edd10f3"  # the last commit with the einsum kernel (context_parallel/blockwise.py before issue 32)


def _einsum_kernel():
    """The earlier kernel itself, read from the repository's history (not kept in the tree): its
    BlockAttention (forward by 1024 x 1024 tiles of einsums, its own exact backward) and group_queries."""
    import subprocess
    import types

    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{BEFORE}:mpformer/context_parallel/blockwise.py"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType("blockwise_before")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, "blockwise_before.py", "exec"), mod.__dict__)  # this repository's own earlier code
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    env = environment()
    s = a.seq
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, s, 32, generator=gen)
    k, v = (torch.randn(1, 2, s, 32, generator=gen) for _ in range(2))
    g = torch.randn(q.shape, generator=gen)
    tril = torch.ones(s, s, dtype=torch.bool).tril()
    additive = torch.zeros(s, s).masked_fill(~tril, float("-inf"))
    rows, results = [], {}

    def fused(causal: bool, mask=None, backward: bool = True):
        def run():
            out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask)
            if backward:
                _aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal,
                                                                           attn_mask=mask)
        return run

    before = _einsum_kernel()
    from mpformer.core.sequence import Segment

    def einsum(causal: bool, backward: bool = True):
        qs, ks = (Segment(0, s),), ((Segment(0, s),) if causal else (Segment(-s, s),))  # keys before: all seen

        def run():
            x = [t.clone().requires_grad_(backward) for t in (q, k, v)]
            out = before.local_attention(*x, qs, ks, None, None, 32 ** -0.5)
            if backward:
                out.backward(g)
        return run

    def math(causal: bool, backward: bool = True):
        def run():
            x = [t.clone().requires_grad_(backward) for t in (q, k, v)]
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                out = F.scaled_dot_product_attention(*x, attn_mask=tril if causal else None, enable_gqa=True)
            if backward:
                out.backward(g)
        return run

    cases = {"fused op": fused, "einsum tiles": einsum, "math": math}
    for causal in (False, True):
        block = "causal" if causal else "full"
        base = {}
        for name, make in cases.items():
            fwd, both = _time(make(causal, backward=False), a.reps), _time(make(causal), a.reps)
            base.setdefault("fwd", fwd)
            base.setdefault("both", both)
            rows.append([block, name, f"{fwd * 1e3:.0f}", f"{both * 1e3:.0f}", f"{both / base['both']:.2f}"])
            results[f"{block}/{name}"] = {"forward_s": fwd, "forward_backward_s": both}
        if causal:  # the masked block's path: the same work through an explicit additive mask
            fwd, both = _time(fused(False, additive, backward=False), a.reps), _time(fused(False, additive), a.reps)
            ratio = f"{both / base['both']:.2f}"
            rows.append([block, "fused op, mask", f"{fwd * 1e3:.0f}", f"{both * 1e3:.0f}", ratio])
            results[f"{block}/fused op, mask"] = {"forward_s": fwd, "forward_backward_s": both}
        if not a.no_flex:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            mask = create_block_mask((lambda b, h, i, j: i >= j) if causal else (lambda b, h, i, j: i >= 0), None,
                                     None, s, s, device="cpu")
            flex = torch.compile(flex_attention, dynamic=False)
            try:  # what a merge of blocks needs: the log-sum-exp
                flex(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True)
                lse_note = "return_lse runs"
            except Exception as e:  # torch 2.13 on CPU: inference only, and no return_lse
                why = next((x for x in str(e).splitlines() if "not supported" in x or "only supports" in x),
                           str(e).splitlines()[0])
                lse_note = f"return_lse fails: {why.strip()[:160]}"
            t0 = time.perf_counter()
            flex(q, k, v, block_mask=mask, enable_gqa=True)
            first = time.perf_counter() - t0
            fwd = _time(lambda m=mask, f=flex: f(q, k, v, block_mask=m, enable_gqa=True), a.reps)
            rows.append([block, f"flex (compiled, first call {first:.0f} s; no lse, no backward)", f"{fwd * 1e3:.0f}",
                         "-", "-"])
            results[f"{block}/flex"] = {"forward_s": fwd, "first_call_s": first, "lse": lse_note}
            print(f"flex, {block}: {lse_note}")
    print(f"CPU: {env['cpu_model']} ({env['cpu_capability']}), torch {env['torch']}; one block of {s} x {s}, heads "
          f"8/2, d 32, fp32, one thread, median of {a.reps}")
    print(format_table(["block", "candidate", "fwd ms", "fwd+bwd ms", "fwd+bwd vs fused op"], rows))
    if a.json:
        write_json(a.json, {"args": {k_: str(v_) for k_, v_ in vars(a).items()}, "environment": env,
                            "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
