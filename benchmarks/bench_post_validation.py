"""Optimizer post-validation through the real trainer: the step check synchronous, after a speculative
step, and overlapping the next step (train.overlap_validation), against the simulator.

    python benchmarks/bench_post_validation.py [--pp 2] [--schedule zb-h2] [--microbatches 8] [--steps 10]
                                               [--json F]

The same Llama-style model trains on ``--pp`` gloo ranks (pretrain's entry point, random tokens) with
``--schedule``, four ways:

* synchronous: every rank waits for the step's check (norm, loss) before it updates;
* post-validation: a rank updates speculatively first, then waits for the check (optim/speculate.py);
* overlapped: the check completes during the next step's forward/backward (training/overlap.py),
  clip_grad high enough that no step clips: every speculation is kept;
* overlapped, all redone: clip_grad so low that every step clips: every speculation is undone and the
  step after it runs twice (what a failed check costs).

Per run: the median step time (rank 0's metrics, after ``--warmup`` steps) and its ratio to the
synchronous run's. Beside them, the simulator at T_F = T_B = T_W: the isolated step (a barrier between
steps, as the synchronous check makes) and the period of steps run back to back (Qi et al.'s setting),
whose ratio is what overlapping can gain on a machine whose ranks do not compete for cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

from mpformer.parallel.spawn import run_distributed
from mpformer.pipeline.actions import repeat
from mpformer.pipeline.schedules import build_schedule
from mpformer.pipeline.simulate import simulate, steady_state_bubble
from mpformer.testing.memory import data_file

MODES = {  # label -> overrides
    "synchronous": {},
    "post-validation": {"train.post_validation": True},
    "overlapped": {"train.post_validation": True, "train.overlap_validation": True},
    "overlapped, all redone": {"train.post_validation": True, "train.overlap_validation": True,
                               "optim.clip_grad": 1e-6},
}


def _worker(args: argparse.Namespace, data: str, root: str) -> dict:
    from mpformer.testing.train import overrides, train

    base = {"model": "tiny-llama", "model.num_layers": args.layers, "model.hidden_size": args.hidden,
            "model.num_attention_heads": 8, "model.num_kv_heads": 4, "model.ffn_hidden_size": args.hidden * 11 // 4,
            "model.vocab_size": args.vocab, "model.max_position_embeddings": args.seq,
            "train.seq_length": args.seq, "train.steps": args.steps, "train.micro_batch_size": 1,
            "train.global_batch_size": args.microbatches, "train.device": "cpu", "train.threads": args.threads,
            "optim.clip_grad": 1e6, "parallel.pp": args.pp, "parallel.schedule": args.schedule,
            "parallel.vpp": 2 if args.schedule in ("zb-v", "dualpipev", "interleaved") else 1,
            "logging.progress": False, "data.paths": f"[{data}]", "checkpoint.save_interval": 0}
    out = {}
    for label, kw in MODES.items():
        t0 = time.perf_counter()
        res = train(overrides(base, Path(root) / label.replace(" ", "_").replace(",", ""), **kw))
        out[label] = {"step_s": [e[2] for e in res["exposed_comm"]], "losses": res["losses"],
                      "wall_s": time.perf_counter() - t0}
    return out


def simulated(args: argparse.Namespace) -> dict[str, float]:
    vpp = 2 if args.schedule in ("zb-v", "dualpipev", "interleaved") else 1
    s = build_schedule(args.schedule, args.pp, args.microbatches, vpp)
    one = simulate(s)
    period = simulate(repeat(s, 3)).step_time - simulate(repeat(s, 2)).step_time  # steady_state_bubble's
    return {"isolated": one.step_time, "back_to_back": period, "ratio": period / one.step_time,
            "bubble_isolated": one.bubble_fraction, "bubble_back_to_back": sum(steady_state_bubble(s)) / args.pp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--schedule", default="zb-h2")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    env = environment()
    print(f"cpu: {env['cpu_model']} ({env['cpu_capability']}) | {env['cpu_count']} cores | torch {env['torch']}")
    print(f"{args.schedule} pp={args.pp}, {args.microbatches} micro-batches of 1x{args.seq}, Llama h={args.hidden} "
          f"{args.layers} layers, {args.steps} steps (median after {args.warmup})")
    with tempfile.TemporaryDirectory() as root:
        data = data_file(Path(root), vocab=args.vocab, documents=400)
        res = run_distributed(_worker, args.pp, args=(args, data, root), timeout=1800)[0]
    sim = simulated(args)
    base = statistics.median(res["synchronous"]["step_s"][args.warmup:])
    rows = []
    for label, r in res.items():
        med = statistics.median(r["step_s"][args.warmup:])
        rows.append({"mode": label, "step_s": med, "ratio": med / base, "final_loss": r["losses"][-1]})
    print(format_table(["mode", "", "step ms (median)", "/ synchronous", "final loss"],
                       [[r["mode"], "", 1e3 * r["step_s"], f"{r['ratio']:.3f}", f"{r['final_loss']:.4f}"]
                        for r in rows]))
    print(f"simulated, T_F = T_B = T_W: isolated step {sim['isolated']:.0f}, back to back {sim['back_to_back']:.0f} "
          f"units per step (ratio {sim['ratio']:.3f}); bubble {sim['bubble_isolated']:.3f} -> "
          f"{sim['bubble_back_to_back']:.3f}")
    if args.json:
        write_json(args.json, {"args": vars(args), "environment": env, "simulated": sim, "results": rows})


if __name__ == "__main__":
    main()
