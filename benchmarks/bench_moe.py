"""Mixture of experts: an expert layer against the dense MLP of the same active parameters, and expert
parallelism (ep=2, both dispatchers) against ep=1 on 2 ranks.

    python benchmarks/bench_moe.py [--json F] [--tokens 2048] [--hidden 256] [--experts 8] [--topk 2]
                                   [--expert-ffn 256] [--steps 8] [--rounds 3]

1. One process, fp32, forward + backward of one layer on ``tokens`` tokens: the MoE layer (E experts of
   width f, top-k, dropless, the per-device expert method of layers/expert_gemm.py) against a dense SwiGLU
   MLP of width k*f (the same parameters per token) and the MoE layer's own expert GEMMs alone. The
   ratio MoE / dense is the price of routing, sorting and combining on this CPU.
2. Two ranks (gloo, one thread each), each with ``tokens`` tokens: the layer at ep=1 (every rank holds
   every expert) against ep=2 with the all-to-all and the all-gather dispatchers; median step time of
   rank 0 and the bytes each rank sent per step (the communication ledger).
Timing: candidates interleaved round by round (common.interleave), medians of ``steps`` timed steps
per round after one warm-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, format_table, interleave, median, write_json

from mpformer.core.model_config import ModelConfig
from mpformer.parallel.spawn import run_distributed


def model_config(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(arch="mixtral", num_layers=1, hidden_size=a.hidden, num_attention_heads=4,
                       ffn_hidden_size=a.topk * a.expert_ffn, moe_ffn_hidden_size=a.expert_ffn,
                       num_experts=a.experts, num_experts_per_tok=a.topk, mlp_kind="moe", vocab_size=256).validate()


def _layers(cfg: ModelConfig, ep=None) -> tuple[torch.nn.Module, torch.nn.Module]:
    from mpformer.layers.mlp import MLP
    from mpformer.layers.moe import MoE

    torch.manual_seed(0)
    moe, dense = MoE(cfg, ep=ep), MLP(cfg)
    for m in (moe, dense):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)
    return moe.train(), dense.train()


def _timer(fn, steps: int):
    def run() -> list[float]:
        fn()  # warm-up of the round
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    return run


def _step(layer: torch.nn.Module, x: torch.Tensor):
    def fn() -> None:
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        y.backward(torch.ones_like(y))
    return fn


def one_process(a: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    cfg = model_config(a)
    moe, dense = _layers(cfg)
    x = torch.randn(a.tokens, 1, a.hidden, requires_grad=True)
    times = interleave({"moe": _timer(_step(moe, x), a.steps), "dense": _timer(_step(dense, x), a.steps)}, a.rounds)
    dense_ms = median(times["dense"]) * 1e3
    return [{"layer": name, "ms": median(t) * 1e3, "vs_dense": median(t) * 1e3 / dense_ms}
            for name, t in times.items()]


def _ranks(a: argparse.Namespace) -> dict:
    from mpformer.parallel.comm import Comm, CommLedger
    from mpformer.parallel.expert_parallel import EPContext

    torch.set_num_threads(1)
    cfg = model_config(a)
    ledger = CommLedger()
    world = Comm(torch.distributed.group.WORLD, ledger, tag="ep.")
    layers = {"ep1": _layers(cfg)[0], "ep2_alltoall": _layers(cfg, EPContext(world, "alltoall"))[0],
              "ep2_allgather": _layers(cfg, EPContext(world, "allgather"))[0]}
    g = torch.Generator().manual_seed(1 + world.rank)
    x = torch.randn(a.tokens, 1, a.hidden, generator=g, requires_grad=True)
    out = {}
    for name, layer in layers.items():  # bytes of one step, before timing
        ledger.take()
        _step(layer, x)()
        out[name] = {"bytes": sum(ledger.take().values())}
    # every rank runs the same interleaved order: the collectives line up
    times = interleave({n: _timer(_step(m, x), a.steps) for n, m in layers.items()}, a.rounds)
    for name, t in times.items():
        out[name]["ms"] = median(t) * 1e3
    return out


def two_ranks(a: argparse.Namespace) -> list[dict]:
    res = run_distributed(_ranks, 2, args=(a,), timeout=900)[0]
    base = res["ep1"]["ms"]
    return [{"layout": n, "ms": r["ms"], "vs_ep1": r["ms"] / base, "bytes_per_rank": r["bytes"]}
            for n, r in res.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    print(f"CPU: {cpu_model()}  fp32, tokens {a.tokens}, hidden {a.hidden}, {a.experts} experts top-{a.topk} "
          f"of width {a.expert_ffn} (dense: {a.topk * a.expert_ffn}), {a.steps} timed steps x {a.rounds} rounds")
    layer = one_process(a)
    print(format_table(["layer", "", "ms fwd+bwd", "vs dense"], [[r["layer"], "", r["ms"], r["vs_dense"]]
                                                                  for r in layer]))
    ranks = two_ranks(a)
    print(format_table(["2 ranks", "", "ms fwd+bwd", "vs ep1", "bytes/rank"],
                       [[r["layout"], "", r["ms"], r["vs_ep1"], r["bytes_per_rank"]] for r in ranks]))
    if a.json:
        write_json(a.json, {"benchmark": "moe", "args": vars(a), "layer": layer, "two_ranks": ranks})


if __name__ == "__main__":
    main()
