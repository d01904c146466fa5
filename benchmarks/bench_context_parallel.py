"""Context parallelism: activation memory per rank against sequence length, ring overlap, zigzag balance.

    python benchmarks/bench_context_parallel.py [--json F] [--seqs 1024 2048 4096 8192 16384] [--quick]

1. Activation memory per rank of one training forward (a small Llama, micro-batch 1, fp32) at
   each sequence length for cp = 1, 2, 4 and every kind: the bytes of every distinct tensor autograd
   saves inside the transformer layers (saved-tensor hooks, storages counted once, parameters
   excluded), the resident-memory peak of the whole forward + backward above the process's
   resident memory before it, and the memory model's prediction (autoconfig/memory.py:
   activation_bytes_per_layer + cp_extra_bytes_per_layer, times the layers). "vs cp=1" divides each
   by the same sequence's cp=1 row: about 1/cp is the goal.
2. Ring attention forward + backward per rank with the next K/V hop posted before the block is
   computed (overlap) and with every hop waited for first (no overlap), at cp = 2 and 4: median of
   repetitions, slowest rank.
3. Attention compute per cp rank (the block kernels of one rank's queries against every key, no
   communication, one process) under the zigzag split and under the contiguous split, next to the
   computed ratio of query-key products (core/sequence.py).
The cp kernels' speed against cp=1's SDPA at 16k tokens is bench_cp_kernels.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, median, write_json

from mpformer.core.model_config import ModelConfig
from mpformer.parallel.spawn import run_distributed

KINDS = [(1, "ring", 1), (2, "ring", 1), (2, "allgather", 1), (2, "ulysses", 1), (4, "ring", 1),
         (4, "allgather", 1), (4, "ulysses", 1), (4, "hybrid", 2)]


def model_config(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(arch="llama", num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       num_kv_heads=a.kv_heads, ffn_hidden_size=4 * a.hidden, vocab_size=a.vocab,
                       max_position_embeddings=max(a.seqs))


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    return 0


def _memory_worker(cfg_dict: dict, seq: int, cp: int, kind: str, ulysses: int) -> dict:
    from mpformer.core.layout import ParallelLayout
    from mpformer.models.parallelize import build_model, cp_context
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups

    cfg = ModelConfig(**cfg_dict)
    layout = ParallelLayout(dp=1, cp=cp, cp_kind=kind, cp_ulysses=ulysses)
    groups = ProcessGroups.build(layout, Device("cpu"))
    model = build_model(cfg, tp=None, cp=cp_context(layout, groups), device=torch.device("cpu"), seed=0).train()
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    state = {"layer": False}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if state["layer"] and ptr not in params:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, a: state.__setitem__("layer", True))
        layer.register_forward_hook(lambda m, a, o: state.__setitem__("layer", False))
    before = _rss()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return {"saved": sum(seen.values()), "peak_rss": _hwm() - before, "time_s": time.perf_counter() - t0}


def _predicted(cfg: ModelConfig, seq: int, cp: int, kind: str, ulysses: int) -> float:
    from mpformer.autoconfig.block_memory import cp_extra_bytes_per_layer
    from mpformer.autoconfig.memory import Workload, activation_bytes_per_layer
    from mpformer.core.layout import ParallelLayout

    L = ParallelLayout(dp=1, cp=cp, cp_kind=kind, cp_ulysses=ulysses)
    w = Workload(1, 1, seq, "fp32")
    return cfg.num_layers * (activation_bytes_per_layer(cfg, L, w) + cp_extra_bytes_per_layer(cfg, L, w))


def _ring_worker(seq: int, heads: int, kv: int, d: int, reps: int) -> dict:
    import dataclasses

    from mpformer.context_parallel.context import SeqShard, attention
    from mpformer.core.layout import ParallelLayout
    from mpformer.core.sequence import positions
    from mpformer.models.parallelize import cp_context
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups

    cp = int(os.environ["WORLD_SIZE"])
    layout = ParallelLayout(dp=1, cp=cp, cp_kind="ring")
    ctx = cp_context(layout, ProcessGroups.build(layout, Device("cpu")))
    segs = ctx.segments(seq)
    index = torch.tensor(positions(segs))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, seq // cp, d, generator=gen, requires_grad=True) for n in (heads, kv, kv))
    out: dict[str, list[float]] = {"overlap": [], "no_overlap": []}
    for r in range(reps + 1):
        for name, c in (("overlap", ctx), ("no_overlap", dataclasses.replace(ctx, overlap=False))):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            y = attention(q, k, v, c, SeqShard(seq, segs, index), None, d ** -0.5)
            y.sum().backward()
            if r:  # the first round warms up
                out[name].append(time.perf_counter() - t0)
    return out


def _balance(seq: int, cp: int, heads: int, kv: int, d: int, reps: int) -> dict:
    """Per-rank compute of the block kernels (forward and backward) under each split, one process."""
    from mpformer.context_parallel.blockwise import Accumulator, KVBlock, QueryPart, Saved, block_backward
    from mpformer.core.sequence import attention_pairs, rank_segments

    gen = torch.Generator().manual_seed(0)
    out = {}
    for split in ("zigzag", "contiguous"):
        parts = [rank_segments(seq, cp, r, split) for r in range(cp)]
        k, v = (torch.randn(1, kv, seq // cp, d, generator=gen) for _ in range(2))
        times, pairs = [], []
        for r in range(cp):
            qp = QueryPart(torch.randn(1, heads, seq // cp, d, generator=gen), parts[r], None, None, d ** -0.5)
            blocks = [KVBlock(k, v, parts[j]) for j in range(cp)]
            runs = []
            for _ in range(reps):
                t0 = time.perf_counter()
                acc = Accumulator(qp.q)
                for blk in blocks:
                    acc.add(qp, blk)
                o = acc.result(qp.q.dtype)
                saved, dq = Saved.of(o, acc.lse, torch.ones_like(o)), torch.zeros_like(acc.out)
                for blk in blocks:
                    block_backward(qp, blk, saved, dq)
                runs.append(time.perf_counter() - t0)
            times.append(median(runs))
            pairs.append(attention_pairs(parts[r], tuple(s for p in parts for s in p)))
        out[split] = {"times": times, "pairs": pairs}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="sequences 1k-4k only")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.quick:
        a.seqs = [s for s in a.seqs if s <= 4096]
    cfg, env = model_config(a), environment()
    print(f"CPU: {env['cpu_model']} ({env['cpu_capability']}), {env['cpu_count']} cores, torch {env['torch']}; "
          f"Llama L={a.layers} h={a.hidden} heads={a.heads}/{a.kv_heads} kv, micro-batch 1, fp32; gloo ranks of "
          "1 thread\n")
    payload: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                     "environment": env, "memory": [], "ring": [], "balance": []}
    rows = []
    for seq in a.seqs:
        base = None
        for cp, kind, u in KINDS:
            r = run_distributed(_memory_worker, cp, args=(cfg.to_dict(), seq, cp, kind, u), timeout=1800)
            saved, peak = max(x["saved"] for x in r), max(x["peak_rss"] for x in r)
            pred = _predicted(cfg, seq, cp, kind, u)
            base = base or (saved, peak, pred)
            label = "cp=1" if cp == 1 else f"cp={cp} {kind}" + (f" u={u}" if kind == "hybrid" else "")
            rows.append([seq, label, saved / 2**20, saved / base[0], peak / 2**20, peak / base[1], pred / 2**20,
                         pred / base[2], saved / pred, max(x["time_s"] for x in r)])
            payload["memory"].append({"seq": seq, "cp": cp, "kind": kind, "ulysses": u, "saved_bytes": saved,
                                      "peak_rss_bytes": peak, "predicted_bytes": pred})
    print("1. activation memory per rank (largest rank), one forward + backward")
    print(format_table(["seq", "layout", "saved MiB", "vs cp=1", "peak RSS MiB", "vs cp=1", "model MiB", "vs cp=1",
                        "saved/model", "fwd+bwd s"], rows))

    ring_rows = []
    seq = max(s for s in a.seqs if s <= 8192)
    for cp in (2, 4):
        r = run_distributed(_ring_worker, cp, args=(seq, a.heads, a.kv_heads, a.hidden // a.heads, a.reps),
                            timeout=1800)
        on, off = (max(median(x[k]) for x in r) for k in ("overlap", "no_overlap"))
        ring_rows.append([cp, seq, on, off, off / on])
        payload["ring"].append({"cp": cp, "seq": seq, "overlap_s": on, "no_overlap_s": off})
    print(f"\n2. ring attention forward + backward, one layer's attention (heads {a.heads}/{a.kv_heads}, d "
          f"{a.hidden // a.heads}), slowest rank, median of {a.reps}")
    print(format_table(["cp", "seq", "overlap s", "no overlap s", "no overlap / overlap"], ring_rows))

    bal_rows = []
    for cp in (2, 4):
        b = _balance(seq, cp, a.heads, a.kv_heads, a.hidden // a.heads, a.reps)
        for split, x in b.items():
            t, p = x["times"], x["pairs"]
            bal_rows.append([cp, split, " ".join(f"{v:.3f}" for v in t), max(t) / min(t), max(p) / min(p)])
            payload["balance"].append({"cp": cp, "seq": seq, "split": split, **x})
    print(f"\n3. attention compute per cp rank (block kernels, forward + backward, no communication), seq {seq}")
    print(format_table(["cp", "split", "seconds per rank", "max/min time", "max/min products"], bal_rows))
    if a.json:
        write_json(a.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
