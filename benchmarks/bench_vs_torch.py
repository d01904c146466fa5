"""mpformer against what a user would run instead: HF + torch DDP / FSDP2, HF eager and compiled.

Every candidate trains the same transformers LlamaForCausalLM config from the same initial weights
(HF's init, copied into mpformer through the canonical key map; the initial losses are checked
equal), on the same batches, with the same AdamW (mpformer's builder: fused where the device has it,
no decay on 1-D tensors) and global-norm clipping at 1.0. A step is the global batch as micro-batches
with gradient accumulation, clip, AdamW step, zero_grad.

    one process   HF eager | HF torch.compile (whole model) | mpformer (the trainer's engine, ZeRO 0)
                  [| mpformer with train.compile's per-block torch.compile, where the tree has it]
    dp ranks      HF + DDP       | mpformer ZeRO-1 | mpformer ZeRO-2     (DDP's bucket size: the engine's)
                  HF + FSDP2     | mpformer ZeRO-3                      (fully_shard per decoder layer + root)

bf16 is autocast with fp32 master weights for every candidate (DDP/FSDP2: fp32 parameters under
autocast, as HF users run AMP; mpformer: bf16 parameters with fp32 masters, as its trainer runs).
Candidates alternate in rounds (forward order, then reversed), ``--steps`` steps each per round;
the table gives median step times and ratios to the torch baseline of the same group, and for
mpformer the median exposed communication per step (host time blocked in collectives). Compiled is
compared with compiled: ``--compile`` compiles the baselines of the data-parallel groups alike (HF's
decoder layers one by one, before DDP or fully_shard wrap them, as torchtitan does), and the one
process mpformer compiled is set against HF compiled. Same training, checked: every candidate's loss,
step by step over at least ``MIN_GUARD_STEPS`` steps, within the precision's tolerance of its
baseline's (a model that ignores its input fails, whatever its speed).

    python benchmarks/bench_vs_torch.py [--quick] [--precision fp32 bf16] [--ranks 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import build_pair
from common import environment, format_table, median, write_json

from mpformer.core.model_config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GUARD_RTOL = {"fp32": 1e-3, "bf16": 5e-2}  # every step's loss against the group baseline's (bench_throughput)
MIN_GUARD_STEPS = 10
QUICK = {"hidden": 128, "layers": 2, "vocab": 2048, "seq": 64, "global_batch": 8, "micro_batch": 2, "steps": 3,
         "rounds": 3}


def hf_and_mpformer(cfg: ModelConfig, seed: int):
    """HF's model with HF's init, and an mpformer Transformer holding the same weights (bench_throughput's)."""
    mp, hf = build_pair(cfg, seed, None)
    return hf, mp


class Candidate:
    """One model + optimizer; ``step(batches)`` runs one optimizer step over the micro-batches."""

    def __init__(self, name: str, group: str, loss, no_sync, update, dtype: torch.dtype, ledger=None) -> None:
        self.name, self.group, self.loss, self.no_sync, self.update = name, group, loss, no_sync, update
        self.autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype != torch.float32 \
            else contextlib.nullcontext
        self.ledger, self.times, self.exposed, self.losses = ledger, [], [], []

    def step(self, batches) -> None:
        if self.ledger is not None:
            self.ledger.take_seconds()
        t0 = time.perf_counter()
        total = 0.0
        for j, (x, y) in enumerate(batches):
            with self.no_sync() if j < len(batches) - 1 else contextlib.nullcontext():
                with self.autocast():
                    loss = self.loss(x, y)
                (loss / len(batches)).backward()
            total += float(loss.detach())
        self.update()
        self.times.append(time.perf_counter() - t0)
        self.losses.append(total / len(batches))
        if self.ledger is not None:
            self.exposed.append(sum(self.ledger.take_seconds().values()))


def _hf_loss(model):
    return lambda x, y: model(input_ids=x, labels=y, shift_labels=y).loss


def _torch_update(model, opt, clip: float):
    params = [p for p in model.parameters() if p.requires_grad]

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return update


def _mpformer(name: str, mp, zero: int, comm, dtype: torch.dtype, bucket_mb: float, compile_blocks: bool,
              reduce_dtype: torch.dtype = torch.float32):
    from mpformer.core.config import OptimConfig
    from mpformer.models.parallelize import grad_specs
    from mpformer.optim.builder import build_engine
    from mpformer.optim.engine import Reduction

    ocfg = OptimConfig()
    engine = build_engine(mp, Reduction(comm, specs=grad_specs(mp), reduce_dtype=reduce_dtype), zero, ocfg, "cpu",
                          bucket_mb, dtype,
                          overlap_param_gather=True)  # as the trainer runs it (train.overlap_param_gather)
    if compile_blocks:
        mp.compile_layers()

    def update() -> None:
        engine.finish()
        engine.clip(ocfg.clip_grad)
        engine.step()
        engine.zero_grad()

    return Candidate(name, "", lambda x, y: mp(x, y), engine.no_sync, update, dtype, comm.ledger)


def _compile_layers(hf) -> None:
    for layer in hf.model.layers:
        layer.compile()


def _optimizer(model, dtype_fused: bool = True):
    from mpformer.core.config import OptimConfig
    from mpformer.optim.builder import make_optimizer, param_groups

    ocfg = OptimConfig()
    return make_optimizer(param_groups(model, ocfg.weight_decay), ocfg, "cpu" if dtype_fused else "none"), ocfg


def one_process(cfg: ModelConfig, args, precision: str) -> list[Candidate]:
    from mpformer.parallel.comm import Comm, CommLedger

    dtype = DTYPES[precision]
    out = []
    for name in ("hf eager", "hf compiled"):
        hf, _ = hf_and_mpformer(cfg, args.seed)
        opt, ocfg = _optimizer(hf)
        model = torch.compile(hf) if name == "hf compiled" else hf
        out.append(Candidate(name, "1 process", _hf_loss(model), contextlib.nullcontext,
                             _torch_update(hf, opt, ocfg.clip_grad), dtype))
    variants = [("mpformer", False)] + ([("mpformer compiled", True)] if args.compile else [])
    for name, comp in variants:
        _, mp = hf_and_mpformer(cfg, args.seed)
        cand = _mpformer(name, mp, 0, Comm(None, CommLedger()), dtype, args.bucket_mb, comp)
        cand.group = "1 process"
        out.append(cand)
    return out


def distributed_worker(cfg: ModelConfig, args, precision: str, batches_all) -> dict:
    """On each of the dp ranks: every distributed candidate, interleaved; rank 0's times returned."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpformer.parallel.comm import Comm, CommLedger

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, reduce_dtype = DTYPES[precision], DTYPES[args.grad_reduce]
    per_rank = [[(x[rank::world].contiguous(), y[rank::world].contiguous()) for x, y in step] for step in batches_all]
    cands = []
    hf, _ = hf_and_mpformer(cfg, args.seed)
    if args.compile:  # the baseline compiled as mpformer is: block by block, before the wrapper
        _compile_layers(hf)
    ddp = DDP(hf, bucket_cap_mb=args.bucket_mb)
    if args.grad_reduce == "bf16":  # the same traffic saving for the baseline: DDP's bf16 compression hook
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    opt, _ = _optimizer(hf)
    cands.append(Candidate("hf + DDP", "ZeRO-1/2 vs DDP", _hf_loss(ddp), ddp.no_sync, _torch_update(ddp, opt, 1.0),
                           dtype))
    for zero in (1, 2):
        _, mp = hf_and_mpformer(cfg, args.seed)
        c = _mpformer(f"mpformer zero {zero}", mp, zero, Comm(dist.group.WORLD, CommLedger(), tag="dp."), dtype,
                      args.bucket_mb, args.compile, reduce_dtype)
        c.group = "ZeRO-1/2 vs DDP"
        cands.append(c)
    hf3, _ = hf_and_mpformer(cfg, args.seed)
    if args.compile:
        _compile_layers(hf3)
    kw = {}
    if args.grad_reduce == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for layer in hf3.model.layers:
        fully_shard(layer, **kw)
    fully_shard(hf3, **kw)
    opt3, _ = _optimizer(hf3, dtype_fused=False)  # fused AdamW takes no DTensors on CPU: foreach

    @contextlib.contextmanager
    def fsdp_no_sync():
        hf3.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            hf3.set_requires_gradient_sync(True)

    cands.append(Candidate("hf + FSDP2", "ZeRO-3 vs FSDP2", _hf_loss(hf3), fsdp_no_sync,
                           _torch_update(hf3, opt3, 1.0), dtype))
    _, mp3 = hf_and_mpformer(cfg, args.seed)
    c = _mpformer("mpformer zero 3", mp3, 3, Comm(dist.group.WORLD, CommLedger(), tag="dp."), dtype, args.bucket_mb,
                  args.compile, reduce_dtype)
    c.group = "ZeRO-3 vs FSDP2"
    cands.append(c)
    run_rounds(cands, per_rank, args)
    return {c.name: {"group": c.group, "times": c.times, "exposed": c.exposed, "losses": c.losses} for c in cands}


def run_rounds(cands: list[Candidate], batches, args) -> None:
    """Warm-up step each, then ``rounds`` rounds of ``steps`` steps each, the order reversed every round."""
    counters = dict.fromkeys(range(len(cands)), 0)

    def run(i: int, n: int) -> None:
        for _ in range(n):
            cands[i].step(batches[counters[i] % len(batches)])
            counters[i] += 1

    for i in range(len(cands)):
        run(i, 1)
        cands[i].times.clear()
        cands[i].exposed.clear()
    for r in range(args.rounds):
        for i in (range(len(cands)) if r % 2 == 0 else reversed(range(len(cands)))):
            run(i, args.steps)


def _baseline(name: str, results: dict) -> str:
    """The torch candidate a candidate is measured against: its group's HF run, compiled against compiled."""
    group = results[name]["group"]
    hf = [n for n, r in results.items() if r["group"] == group and n.startswith("hf")]
    if "compiled" in name and "hf compiled" in hf:
        return "hf compiled"
    return next(n for n in hf if n != "hf compiled") if len(hf) > 1 else hf[0]


def rows_of(results: dict, precision: str, tokens: int) -> list[dict]:
    rows = []
    for name, r in results.items():
        base = _baseline(name, results)
        med = median(r["times"])
        losses, want = r["losses"], results[base]["losses"]
        if len(losses) < MIN_GUARD_STEPS:
            raise SystemExit(f"{name}: {len(losses)} steps are too few to check the same training (at least "
                             f"{MIN_GUARD_STEPS}: raise --rounds or --steps)")
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        if rel > GUARD_RTOL[precision]:
            raise AssertionError(f"{name} ({precision}): its losses part from {base}'s by {rel:.2e} relative "
                                 f"(> {GUARD_RTOL[precision]}): not the same training")
        rows.append({"precision": precision, "group": r["group"], "impl": name, "baseline": base,
                     "steps": len(r["times"]), "tokens_per_s": tokens / med, "step_ms": 1e3 * med,
                     "ratio": median(results[base]["times"]) / med,
                     "exposed_comm_ms": 1e3 * median(r["exposed"]) if r["exposed"] else None,
                     "losses": losses, "max_loss_rel_diff": rel})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4, help="per rank (one process: the same micro-batches)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per candidate per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--precision", nargs="+", choices=list(DTYPES), default=["fp32"])
    p.add_argument("--grad-reduce", choices=list(DTYPES), default="fp32",
                   help="gradient reduction dtype, for mpformer (parallel.grad_reduce_dtype) and the baselines "
                        "alike (DDP: bf16_compress_hook; FSDP2: MixedPrecisionPolicy(reduce_dtype))")
    p.add_argument("--only", choices=["one", "dist", "both"], default="both")
    p.add_argument("--compile", action="store_true", help="mpformer with its per-block torch.compile too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"a tiny model: {QUICK}")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    return args


def main(argv=None) -> dict:
    from mpformer.parallel.spawn import run_distributed

    args = parse_args(argv)
    ffn = 64 * math.ceil(8 * args.hidden / 3 / 64)
    cfg = ModelConfig(arch="llama", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      num_kv_heads=args.kv_heads, ffn_hidden_size=ffn, vocab_size=args.vocab,
                      max_position_embeddings=max(args.seq, 128)).validate()
    env, t0 = environment(), time.perf_counter()
    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, cfg.vocab_size, (3, args.global_batch, args.seq + 1), generator=g)
    micro_per_rank = args.global_batch // (args.ranks * args.micro_batch)
    rows = []
    for precision in args.precision:
        if args.only in ("one", "both"):
            micro = args.global_batch // args.micro_batch  # one process: the whole global batch
            steps = [[(d[i:i + args.micro_batch, :-1].contiguous(), d[i:i + args.micro_batch, 1:].contiguous())
                      for i in range(0, args.global_batch, args.micro_batch)][:micro] for d in data]
            cands = one_process(cfg, args, precision)
            run_rounds(cands, steps, args)
            results = {c.name: {"group": c.group, "times": c.times, "exposed": c.exposed, "losses": c.losses}
                       for c in cands}
            rows += rows_of(results, precision, args.global_batch * args.seq)
        if args.only in ("dist", "both"):
            # Every rank gets rows rank::ranks of each micro-batch group: the same global batch.
            steps = []
            for d in data:
                chunk = args.micro_batch * args.ranks
                steps.append([(d[i:i + chunk, :-1].contiguous(), d[i:i + chunk, 1:].contiguous())
                              for i in range(0, args.global_batch, chunk)][:micro_per_rank])
            res = run_distributed(distributed_worker, args.ranks, args=(cfg, args, precision, steps), timeout=3600,
                                  env={"OMP_NUM_THREADS": "1"})[0]
            rows += rows_of(res, precision, args.global_batch * args.seq)
    print(f"model: llama L={cfg.num_layers} h={cfg.hidden_size} heads {cfg.num_attention_heads}/{cfg.kv_heads} "
          f"ffn {cfg.ffn_size} vocab {cfg.vocab_size} ({cfg.num_params() / 1e6:.1f}M) | global batch "
          f"{args.global_batch} x {args.seq}, micro-batch {args.micro_batch} | dp ranks {args.ranks} (gloo, 1 thread "
          f"each) | cpu: {env['cpu_model']} ({env['cpu_capability']}) | torch {env['torch']}")
    print(format_table(["precision", "group", "impl", "against", "steps", "tokens/s", "step ms", "ratio",
                        "exposed comm ms", "losses: max rel diff"],
                       [[r["precision"], r["group"], r["impl"], r["baseline"], r["steps"], r["tokens_per_s"],
                         r["step_ms"], r["ratio"], r["exposed_comm_ms"] if r["exposed_comm_ms"] is not None else "-",
                         f"{r['max_loss_rel_diff']:.1e}"] for r in rows]))
    print(f"total {time.perf_counter() - t0:.0f} s; ratio = the baseline's median / this median (> 1: faster); "
          f"losses: every step against the baseline's (bound {GUARD_RTOL})")
    payload = {"benchmark": "vs_torch", "env": env, "args": vars(args), "model": cfg.to_dict(), "results": rows}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
