"""Tensor parallelism: communication per step and activation memory per rank, against the formulas.

    python benchmarks/bench_tensor_parallel.py [--json F] [--layers 4] [--seq 256] [--batch 2]

1. Bytes each rank moves in one training step (forward + backward + gradient sync) of a 4-layer
   GPT-2-style model, counted by the CommLedger, next to mpformer.parallel.volumes (docs/formulas.md):
   tp 2 and 4, with and without sequence parallelism. Ratio 1.00 means every collective the
   formula predicts, and no other, was issued.
2. Activation bytes per rank: the bytes of every distinct tensor autograd saves for backward
   during one forward (saved-tensor hooks, storages counted once, parameters excluded), at tp=1,
   tp=2 and tp=2+SP, next to Korthikanti et al.'s per-layer formulas. Their table counts 16-bit
   activations, 1-byte dropout masks and the s^2 attention scores; here activations are fp32,
   dropout is off and SDPA keeps no s^2 scores, so the comparable row is "selective recompute"
   expressed in fp32 elements: sbh (16) at tp=1, sbh (4 + 12/t) with TP, sbh 16/t with TP+SP
   (the 34 / 10 + 24/t / 34/t of the paper, minus two 1-byte masks, halved to elements).
   The measured layers include SDPA's output and log-sum-exp, which the formula's softmax terms
   replace. Under SP, as the formula assumes and Megatron does, a column-parallel layer keeps
   its input's sequence shard and all-gathers it again in backward (under its dgrad GEMM); the
   re-gather is in the all-gather volume of docs/formulas.md, which the test suite checks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, write_json

from mpformer.core.model_config import ModelConfig
from mpformer.parallel.spawn import run_distributed
from mpformer.parallel.volumes import tp_step_bytes


def model_config(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> ModelConfig:
    return ModelConfig(arch="gpt2", num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       activation="gelu_tanh", vocab_size=vocab, max_position_embeddings=seq,
                       tie_embeddings=True, attention_bias=True, mlp_bias=True)


def _saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, int]:
    """(bytes saved for backward inside the transformer layers, bytes saved in total)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    in_layers: set[int] = set()
    state = {"layer": False}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
            if state["layer"]:
                in_layers.add(ptr)
        return t

    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, a: state.__setitem__("layer", True))
        layer.register_forward_hook(lambda m, a, o: state.__setitem__("layer", False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    return sum(seen[p] for p in in_layers), sum(seen.values())


def _worker(cfg_dict: dict, seq: int, batch: int, tp: int, sp: bool) -> dict:
    from mpformer.core.layout import ParallelLayout
    from mpformer.models.parallelize import build_model, grad_specs
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups
    from mpformer.parallel.tensor_parallel import kv_replicas, sync_tp_grads

    cfg = ModelConfig(**cfg_dict)
    groups = ProcessGroups.build(ParallelLayout(dp=1, tp=tp, sequence_parallel=sp), Device("cpu"))
    model = build_model(cfg, tp=groups.tp_context(kv_replicas(tp, cfg.kv_heads)), device=torch.device("cpu"),
                        seed=0).train()
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    layer_bytes, total_bytes = _saved_activation_bytes(model, tokens)
    groups.ledger.take()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    sync_tp_grads(grad_specs(model))
    return {"ledger": groups.ledger.take(), "layer_bytes": layer_bytes, "total_bytes": total_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    cfg = model_config(a.layers, a.hidden, a.heads, a.vocab, a.seq)
    layouts = [(1, False), (2, False), (2, True), (4, False), (4, True)]
    res = {(tp, sp): run_distributed(_worker, tp, args=(cfg.to_dict(), a.seq, a.batch, tp, sp), timeout=600)[0]
           for tp, sp in layouts}

    comm_rows, out = [], {"config": vars(a) | {"json": str(a.json)}, "comm": [], "activations": []}
    for (tp, sp), r in res.items():
        if tp == 1:
            continue
        want = tp_step_bytes(cfg, s=a.seq, b=a.batch, t=tp, sp=sp)
        for kind, w in want.items():
            got = r["ledger"].get(kind, 0)
            ratio = got / w if w else (1.0 if got == 0 else float("inf"))
            comm_rows.append([f"tp={tp}{' +SP' if sp else ''}", kind, f"{got:,}", f"{w:,.0f}", f"{ratio:.4f}"])
            out["comm"].append({"tp": tp, "sp": sp, "kind": kind, "measured": got, "analytic": w})
    print(f"model: gpt2-style L={a.layers} h={a.hidden} heads={a.heads} vocab={a.vocab}; micro-batch {a.batch} x "
          f"seq {a.seq}; one forward + backward + tp gradient sync, fp32\n")
    print(format_table(["layout", "collective", "measured bytes/rank", "analytic (formulas)", "ratio"], comm_rows))

    sbh, L = a.seq * a.batch * a.hidden, a.layers
    base = res[(1, False)]["layer_bytes"]
    act_rows = []
    for (tp, sp), r in res.items():
        if tp == 4:
            continue
        elems = 16.0 if tp == 1 else (16.0 / tp if sp else 4 + 12.0 / tp)
        formula = elems * 4 * sbh * L
        act_rows.append([f"tp={tp}{' +SP' if sp else ''}", f"{r['layer_bytes'] / 2**20:.2f}",
                         f"{formula / 2**20:.2f}", f"{r['layer_bytes'] / formula:.3f}",
                         f"{r['layer_bytes'] / base:.3f}", f"{elems / 16.0:.3f}", f"{r['total_bytes'] / 2**20:.2f}"])
        out["activations"].append({"tp": tp, "sp": sp, "measured_layer_bytes": r["layer_bytes"],
                                   "formula_bytes": formula, "total_saved_bytes": r["total_bytes"]})
    print("\nactivation memory per rank (transformer layers; fp32, no dropout, SDPA keeps no s^2 scores; under SP the "
          "column-parallel layers keep their inputs' sequence shards and re-gather them in backward, as the formula "
          "assumes)")
    print(format_table(["layout", "measured MiB", "Korthikanti MiB", "measured/formula", "vs tp=1 measured",
                        "vs tp=1 formula", "whole model MiB"], act_rows))
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
