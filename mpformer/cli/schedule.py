"""``mpformer-schedule`` / ``tools/schedule.py``: build, verify and simulate a pipeline schedule.

    tools/schedule.py --schedule 1f1b --pp 4 --microbatches 8 [--vpp V] [--slices K] [--f 1 --b 1 --w 1 --p2p 0]
                      [--offload all|auto --offload-keep N --copy T]
                      [--json F] [--plot F.png] [--trace F.json] [--print] [--blocking]
    tools/schedule.py --file my_schedule.txt ...      (a hand-written schedule, text or .csv)

Costs are for one microbatch through one rank's share of the layers (a whole pipeline stage):
with --vpp V each chunk costs 1/V of them, and with --slices K (token-level pipelining) each slice
1/K, so step times compare across schedules. --offload draws activation offload's copies (each
--copy long, out beside the unit's forward, back beside the compute before its backward; a compute
lasts at least as long as a copy beside it) on a lane under each rank. A schedule that
does not split the backward pays b + w for its B. p2p is the time of one send/receive pair.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from mpformer.core.errors import PLOT_SUFFIXES, ArgumentParser, ConfigError, check_output_file, user_errors_to_exit
from mpformer.pipeline.actions import Op, load_schedule
from mpformer.pipeline.schedules import SCHEDULES, build_schedule
from mpformer.pipeline.simulate import Costs, SimResult, simulate, steady_state_bubble, write_chrome_trace

COLORS = {Op.F: "#4c72b0", Op.B: "#55a868", Op.BI: "#55a868", Op.BW: "#dd8452"}
COPY_COLORS = {"out": "#8172b2", "back": "#c44e52"}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="mpformer-schedule",
                                description="Generate, verify and simulate a pipeline schedule; report its bubble.")
    p.add_argument("--schedule", metavar="NAME", help=f"one of: {', '.join(SCHEDULES)}")
    p.add_argument("--pp", type=int, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, help="microbatches per step")
    p.add_argument("--file", metavar="F", help="verify and simulate a hand-written schedule instead (text form, "
                                               "or CSV if F ends in .csv); replaces --schedule/--pp/--microbatches")
    p.add_argument("--vpp", type=int, default=1, help="virtual chunks per rank (interleaved; 2 for zb-v and "
                   "dualpipev; default 1)")
    p.add_argument("--slices", type=int, default=1, help="token slices per micro-batch (TeraPipe; gpipe and 1f1b; "
                   "default 1)")
    p.add_argument("--f", type=float, default=1.0, help="forward time of one stage (default 1)")
    p.add_argument("--b", type=float, default=1.0, help="input-gradient backward time of one stage (default 1)")
    p.add_argument("--w", type=float, default=1.0, help="weight-gradient backward time of one stage (default 1)")
    p.add_argument("--p2p", type=float, default=0.0, help="time of one send/receive (default 0)")
    p.add_argument("--fb", type=float, default=None, help="time of one overlapped forward-and-backward pair "
                   "(dualpipev's F&B, per chunk pair; default: the halves' computes in turn, their exchanges beside)")
    p.add_argument("--a2a-f", type=float, default=0.0, help="a mixture of experts' dispatch and combine time in "
                   "one stage's forward (all-to-all; default 0): exposed, except beside the other half of an "
                   "overlapped pair (dualpipev)")
    p.add_argument("--a2a-b", type=float, default=0.0, help="the same in one stage's input-gradient backward")
    p.add_argument("--offload", default="none", metavar="MODE", help="activation offload: none (default), auto, all")
    p.add_argument("--offload-keep", type=int, default=1, help="offload=auto: units kept on the device (default 1)")
    p.add_argument("--copy", type=float, default=1.0, help="time of one stage's micro-batch copy to host memory or "
                   "back, like --f (a chunk's or slice's share of it with --vpp, --slices; default 1)")
    p.add_argument("--blocking", action="store_true",
                   help="model an engine that waits for each p2p group as a whole (default: a receive is "
                        "waited for at its consumer, a send never blocks)")
    p.add_argument("--json", metavar="F", help="write the summary as JSON")
    p.add_argument("--plot", metavar="F.png", help="write a timeline picture (matplotlib)")
    p.add_argument("--trace", metavar="F.json", help="write a Chrome trace (chrome://tracing, Perfetto); "
                                                    "one cost unit is shown as 1 ms")
    p.add_argument("--print", action="store_true", help="print the schedule's action lists (text form)")
    p.add_argument("--table", action="store_true", help="every schedule at --pp and --microbatches side by side: "
                   "simulated bubble and peak activations next to the published formulas (markdown)")
    return p


def summary(res: SimResult, steady: list[float]) -> str:
    s, c = res.schedule, res.costs
    sliced = f" ({s.microbatches // s.slices} x {s.slices} token slices)" if s.slices > 1 else ""
    lines = [f"schedule {s.name}  pp={s.pp} microbatches={s.microbatches}{sliced} vpp={s.vpp}  "
             f"(per chunk: f={c.f:g} b={c.b:g} w={c.w:g}; p2p={c.p2p:g}"
             + (f"; expert all-to-all f={c.a2a_f:g} b={c.a2a_b:g}" if c.a2a_f or c.a2a_b else "") + ")",
             f"step time {res.step_time:g}   bubble fraction {res.bubble_fraction:.4f} (mean over ranks)   "
             f"back-to-back steps: {sum(steady) / len(steady):.4f}",
             "rank  bubble   idle      peak in-flight (microbatch-chunks)"]
    lines += [f"{r:>4}  {res.bubble_fraction_per_rank[r]:.4f}   {res.idle[r]:<8g}  {res.peak_inflight[r]}"
              for r in range(s.pp)]
    return "\n".join(lines)


def plot_timeline(res: SimResult, path: str | Path) -> None:
    """Ranks as rows, F/B/W as coloured boxes with the microbatch (and chunk) written inside."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    s = res.schedule
    fig, ax = plt.subplots(figsize=(min(4 + res.step_time * 0.35, 60), 1 + 0.6 * s.pp))
    for r, row in enumerate(res.timeline):
        for t in row:
            a = t.action
            if a.op.is_comm or t.end <= t.start:
                continue
            ax.broken_barh([(t.start, t.end - t.start)], (r - 0.4, 0.8), facecolors=COLORS[a.op],
                           edgecolors="black", linewidth=0.5, alpha=1.0 - 0.25 * (a.chunk % 2))
            label = f"{a.microbatch}.{a.chunk}" if s.vpp > 1 else str(a.microbatch)
            if s.slices > 1:  # micro-batch / slice
                label = f"{a.microbatch // s.slices}/{a.microbatch % s.slices}"
            ax.text((t.start + t.end) / 2, r, label, ha="center", va="center", fontsize=7)
    for r, kind, _mb, _c, start, end in res.copies:  # offload's copies on a thin lane under the rank
        y = r + (0.42 if kind == "out" else 0.5)
        ax.broken_barh([(start, end - start)], (y - 0.04, 0.08), facecolors=COPY_COLORS[kind], edgecolors="none")
    ax.set_ylim(s.pp - 0.5 + (0.1 if res.copies else 0), -0.5)
    ax.set_yticks(range(s.pp), [f"rank {r}" for r in range(s.pp)])
    ax.set_xlim(0, res.step_time)
    ax.set_xlabel("time (cost units)")
    ax.set_title(f"{s.name}: pp={s.pp} m={s.microbatches} vpp={s.vpp}, step {res.step_time:g}, "
                 f"bubble {res.bubble_fraction:.3f}")
    handles = [Patch(color=COLORS[Op.F], label="F"), Patch(color=COLORS[Op.B], label="B / BI"),
               Patch(color=COLORS[Op.BW], label="BW")]
    if res.copies:
        handles += [Patch(color=COPY_COLORS[k], label=f"copy {k}") for k in ("out", "back")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


@user_errors_to_exit
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, value, kinds in (("--json", args.json, None), ("--plot", args.plot, PLOT_SUFFIXES),
                               ("--trace", args.trace, None)):
        if value:
            check_output_file(value, flag, kinds)
    if not args.f + args.b + args.w > 0:
        raise ConfigError(f"--f {args.f} --b {args.b} --w {args.w}: the step costs must add up to more than 0")
    if args.table:
        if args.pp is None or args.microbatches is None:
            raise ConfigError("--table needs --pp P --microbatches M")
        from mpformer.pipeline.compare import markdown, schedule_table

        rows = schedule_table(args.pp, args.microbatches, args.f, args.b, args.w, args.fb)
        print(markdown(rows, args.pp, args.microbatches), end="")
        if args.json:  # the table's rows, with the arguments that made them
            Path(args.json).write_text(json.dumps({"pp": args.pp, "microbatches": args.microbatches, "f": args.f,
                                                   "b": args.b, "w": args.w, "fb": args.fb, "rows": rows},
                                                  indent=1) + "\n")
        return 0
    if args.file:
        schedule = load_schedule(args.file)
    elif args.schedule is None or args.pp is None or args.microbatches is None:
        raise ConfigError("give --schedule NAME --pp P --microbatches M, or --file F")
    elif args.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {args.schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")
    else:
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.vpp, slices=args.slices)
    v = schedule.vpp * schedule.slices  # a chunk's, or a slice's, share of a stage's micro-batch
    offload = None
    if args.offload != "none":
        from mpformer.pipeline.offload import OFFLOAD_MODES, offload_units

        if args.offload not in OFFLOAD_MODES or args.offload_keep < 1 or args.copy < 0:
            raise ConfigError(f"--offload {args.offload} --offload-keep {args.offload_keep} --copy {args.copy}: valid "
                              f"modes {', '.join(OFFLOAD_MODES)}, a keep >= 1 and a copy time >= 0")
        offload = [offload_units(acts, args.offload, args.offload_keep) for acts in schedule.actions]
        if not any(offload):
            raise ConfigError(f"--offload {args.offload}: no unit of this schedule waits for its backward (pp="
                              f"{schedule.pp}); valid: a pipeline of pp > 1, or --offload none")
    if min(args.a2a_f, args.a2a_b) < 0:
        raise ConfigError(f"--a2a-f {args.a2a_f} --a2a-b {args.a2a_b}: exchange times must be >= 0")
    costs = Costs(f=args.f / v, b=args.b / v, w=args.w / v, p2p=args.p2p, fb=args.fb,
                  copy=args.copy / v if offload else 0.0, a2a_f=args.a2a_f / v, a2a_b=args.a2a_b / v)
    res = simulate(schedule, costs, blocking=args.blocking, offload=offload)
    print(summary(res, steady_state_bubble(schedule, costs, blocking=args.blocking)), flush=True)
    if args.print:
        print(schedule.to_text(), end="")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res.to_json(), indent=2) + "\n")
    if args.plot:
        plot_timeline(res, args.plot)
    if args.trace:
        write_chrome_trace(args.trace, (t for row in res.timeline for t in row), us_per_unit=1000.0,
                           vpp=schedule.vpp, copies=res.copies, exchanges=res.exchanges)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
