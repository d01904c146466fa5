"""Pipeline schedules: measured step time on real ranks against the simulator's prediction.

    python benchmarks/bench_pipeline.py [--json F] [--pp 4] [--microbatches 8] [--steps 5] [--slices 2,4]
                                        [--schedules 1f1b,zb-h1]

For each schedule (GPipe, 1F1B, interleaved with vpp=2, ZB-H1, ZB-H2, ZB-V, DualPipeV, then 1F1B with each
``--slices`` k: token-level pipelining, every micro-batch in k sequence slices) the same Llama-style model
is split over ``pp`` gloo ranks and the PipelineEngine runs ``--steps`` timed steps (after one
untimed) of ``--microbatches`` micro-batches, with tracing on. From that same run:

* measured step time: per step, from the barrier every rank leaves to the last rank's end (all
  sends completed), median over steps;
* per-operation costs: the median duration of F, BI, BW (or a combined B) per global stage, taken
  from the engine's trace (mpformer.pipeline.trace.measured_costs), and the p2p time of one
  boundary tensor (half a ping-pong between ranks 0 and 1, median of 20);
* simulated step time: ``simulate(schedule, costs)`` on the very action lists that ran;
* the engine's gap: its median time per compute action that is neither compute nor a receive wait
  (posting messages, waiting for sends, Python between actions: trace.measured_gap), and the
  simulated step with it added after each compute (``Costs.gap``);
* measured bubble: per rank, 1 - compute time / step time, mean over ranks and steps, next to the
  simulated bubble from the same costs, without and with the gap (idle time, as it is measured).

The ratio measured / simulated says how much of the real step the schedule model explains from the
operations' costs alone; with the gap, from everything the trace measures per action. What is left
is what the model does not know of (a rank waiting for a core while it is not in a traced action,
costs that vary from one action to the next). On a machine with fewer cores than ranks (CI: 2 cores, 4 ranks) the
ranks also compete for cores, which the per-op medians absorb only on average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, format_table, write_json

from mpformer.core.model_config import ModelConfig
from mpformer.parallel.spawn import run_distributed
from mpformer.pipeline.simulate import simulate

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)]
Run = tuple[str, str, int, int]  # (label, schedule, vpp, token slices)


def runs(args: argparse.Namespace) -> list[Run]:
    out = [(name + (f" (vpp={vpp})" if vpp > 1 else ""), name, vpp, 1) for name, vpp in SCHEDULES
           if args.schedules is None or name in args.schedules]
    return out + [(f"1f1b, {k} token slices", "1f1b", 1, k) for k in args.slices]


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(arch="llama", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                       num_kv_heads=4, ffn_hidden_size=args.hidden * 11 // 4, vocab_size=args.vocab,
                       max_position_embeddings=args.seq)


def _ping_pong(p2p, rank: int, shape: tuple[int, ...], rounds: int = 20) -> float:
    """Half the median round trip of one boundary tensor between pp ranks 0 and 1."""
    import torch.distributed as dist

    t = torch.zeros(shape)
    times = []
    for _ in range(rounds + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            p2p.post([(1, t)], [])[0].wait()
            p2p.post([], [(1, t)])[1][0].wait()
        elif rank == 1:
            p2p.post([], [(0, t)])[1][0].wait()
            p2p.post([(0, t)], [])[0].wait()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) / 2


def _worker(args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from mpformer.core.layout import SPLIT_BACKWARD, ParallelLayout
    from mpformer.core.pipeline_plan import stage_plan
    from mpformer.layers.linear import WeightGradStore
    from mpformer.models.parallelize import build_model
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups
    from mpformer.pipeline.engine import PipelineEngine
    from mpformer.pipeline.p2p import P2P
    from mpformer.pipeline.schedules import build_schedule
    from mpformer.pipeline.trace import gather_events

    torch.set_num_threads(args.threads)
    cfg, device = model_config(args), Device("cpu")
    shape = (args.seq, args.batch, args.hidden)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.microbatches):
        tok = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        batches.append((tok[:, :-1], tok[:, 1:]))
    out: dict = {"runs": {}}
    for label, name, vpp, slices in runs(args):
        layout = ParallelLayout(dp=1, pp=args.pp, vpp=vpp, schedule=name, pp_token_slices=slices)
        groups = ProcessGroups.build(layout, device)
        rank = groups.coords["pp"]
        plan = stage_plan(cfg, layout, rank, args.seq)
        store = WeightGradStore() if name in SPLIT_BACKWARD else None  # zb-h1/h2 run BW
        model = build_model(cfg, tp=groups.tp_context(), device=device.torch_device, seed=1, stage=plan, store=store)
        p2p = P2P(groups.pp, groups.ledger, (args.seq // slices, *shape[1:]), torch.float32, device.torch_device)
        if "p2p_s" not in out:
            out["p2p_s"] = _ping_pong(p2p, rank, shape)
        schedule = build_schedule(name, args.pp, args.microbatches, vpp, slices=slices)
        engine = PipelineEngine(model, plan, schedule, p2p, store=store)
        steps, events = [], []
        for step in range(args.steps + 1):
            model.zero_grad(set_to_none=True)
            if step > 0:
                engine.start_trace()
            dist.barrier()
            t0 = time.perf_counter()
            engine.run(batches)
            t1 = time.perf_counter()
            if step > 0:
                steps.append((t0, t1))
                events.extend(engine.take_trace())
        ends = [None] * args.pp
        dist.all_gather_object(ends, steps, group=groups.pp)
        all_events = gather_events(events, groups.pp)
        if rank == 0:
            out["runs"][label] = {"steps": ends, "events": all_events}
        del model, engine
    return out


def _analyse(r: Run, run: dict, args: argparse.Namespace, p2p_s: float) -> dict:
    from mpformer.pipeline.schedules import build_schedule
    from mpformer.pipeline.trace import measured_costs, measured_gap

    label, name, vpp, slices = r
    schedule = build_schedule(name, args.pp, args.microbatches, vpp, slices=slices)
    p2p_s *= 1 / slices  # a slice's message: the ping-pong's tensor over k (the transfer is bandwidth-bound here)
    per_rank = run["steps"]  # [rank][step] = (t0, t1)
    step_windows = [(max(r[k][0] for r in per_rank), max(r[k][1] for r in per_rank)) for k in range(args.steps)]
    measured = [t1 - t0 for t0, t1 in step_windows]
    events = run["events"]
    costs = measured_costs(events, schedule.num_stages, args.pp, p2p=p2p_s, v=schedule.v)
    sim = simulate(schedule, costs)
    sim_blocking = simulate(schedule, costs, blocking=True)
    gap = measured_gap(events, step_windows)
    sim_gap = simulate(schedule, replace(costs, gap=gap))
    bubbles = []
    for (t0, t1) in step_windows:
        busy = [0.0] * args.pp
        for a, s, e in events:
            if not a.op.is_comm and t0 - 1e-3 <= s <= t1:
                busy[a.rank] += e - s
        bubbles.append(statistics.mean(1 - b / (t1 - t0) for b in busy))
    m = statistics.median(measured)
    return {"schedule": label, "vpp": vpp, "slices": slices, "measured_step_s": m, "simulated_step_s": sim.step_time,
            "ratio": m / sim.step_time, "simulated_blocking_step_s": sim_blocking.step_time,
            "gap_s": gap, "simulated_with_gap_step_s": sim_gap.step_time, "ratio_with_gap": m / sim_gap.step_time,
            "measured_bubble": statistics.median(bubbles), "simulated_bubble": sim.bubble_fraction,
            "simulated_bubble_with_gap": sim_gap.bubble_fraction,
            "measured_steps_s": measured,
            "costs_ms": {k: [1e3 * v for v in getattr(costs, k)] for k in ("f", "b", "w")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--schedules", type=lambda x: x.split(","), default=None,
                    help=f"comma-separated, of {', '.join(n for n, _ in SCHEDULES)} (default all)")
    ap.add_argument("--slices", type=lambda x: [int(k) for k in x.split(",") if k], default=[2, 4],
                    help="token slices to run 1f1b with, comma-separated ('' for none)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = run_distributed(_worker, args.pp, args=(args,), timeout=1800)[0]
    rows, results = [], []
    for run in runs(args):
        r = _analyse(run, out["runs"][run[0]], args, out["p2p_s"])
        results.append(r)
        rows.append([run[0], 1e3 * r["measured_step_s"],
                     1e3 * r["simulated_step_s"], r["ratio"], 1e3 * r["simulated_blocking_step_s"],
                     1e3 * r["gap_s"], 1e3 * r["simulated_with_gap_step_s"], r["ratio_with_gap"],
                     r["measured_bubble"], r["simulated_bubble"], r["simulated_bubble_with_gap"]])
    env = environment()
    print(f"cpu: {env['cpu_model']} ({env['cpu_capability']}), {env['cpu_count']} cores | torch {env['torch']}")
    print(f"pp={args.pp}, {args.microbatches} micro-batches of {args.batch}x{args.seq} tokens, Llama "
          f"L={args.layers} h={args.hidden} vocab={args.vocab}, {args.threads} thread(s) per rank; "
          f"p2p of one boundary tensor {1e3 * out['p2p_s']:.3f} ms")
    print(format_table(["schedule", "measured ms", "simulated ms", "measured/simulated",
                        "simulated, blocking groups ms", "gap ms", "simulated with gap ms",
                        "measured/simulated with gap", "measured bubble", "simulated bubble",
                        "simulated bubble with gap"], rows))
    for r in results:
        c = r["costs_ms"]
        print(f"{r['schedule']:24s} per-stage ms  F {[round(x, 1) for x in c['f']]}  "
              f"B/BI {[round(x, 1) for x in c['b']]}  BW {[round(x, 1) for x in c['w']]}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, {"args": vars(args), "environment": environment(), "p2p_s": out["p2p_s"],
                               "results": results})


if __name__ == "__main__":
    main()
