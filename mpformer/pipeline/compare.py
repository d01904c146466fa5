"""Every generated schedule side by side: simulated bubble and peak activations next to the published
formulas (``tools/schedule.py --table``; the README's table is its output).

Costs are per whole stage (T_F, T_B = the input-gradient pass, T_W); a schedule with v chunks per rank
runs each chunk at 1/v of them. The bubble is a rank's idle time over the step, (idle) / (idle +
m (T_F + T_B + T_W)), for one isolated step and for steps run back to back (no barrier between them:
what optimizer post-validation allows). Published idle times per rank (docs/formulas.md
and the sources named):

    gpipe, 1f1b   (p-1)(T_F+T_B+T_W)
    interleaved   (p-1)(T_F+T_B+T_W) / v                  (Narayanan et al. 2021)
    zb-h1         (p-1)(T_F+T_B-T_W)                      (Qi et al. 2024)
    zb-h2         (p-1)(T_F+T_B-2T_W), back to back       (Qi et al. 2024)
    dualpipev     (PP/2-1)(F&B+B-3W), PP = 2p V stages, per-chunk F, full B, W, F&B (deepseek-ai/DualPipe)
    1f1b, k token slices   (p-1)(T_F+T_B+T_W) / k: TeraPipe's (K + p - 1) max t_i step over K = m k
                  equal slices (Li et al. 2021, eq. 1; slices of equal cost: attention's growth left out)

Peak activations are in whole-stage micro-batches (in-flight chunks / v): published 1F1B and ZB-H1 p,
GPipe m, ZB-H2 2p-1, ZB-V p (1F1B's: Qi et al.), DualPipeV PP+1 chunks = p + 1/2. ZB-V's bubble and
interleaving's memory have no closed form here (shown as "-"); nor has 1F1B over token slices
(p - 1 + k slices on rank 0: (p - 1 + k) / k micro-batches, from the generator).
"""

from __future__ import annotations

from mpformer.core.errors import ConfigError
from mpformer.core.layout import V_SCHEDULES, check_args
from mpformer.pipeline.schedules import SCHEDULES, build_schedule
from mpformer.pipeline.simulate import Costs, simulate, steady_state_bubble

VPP = {"interleaved": 2, **{name: 2 for name in V_SCHEDULES}}  # chunks per rank in the table
SLICED = (2, 4)  # 1f1b's rows with token slices


def _published(name: str, p: int, m: int, v: int, f: float, b: float, w: float, fb: float | None, k: int = 1
               ) -> tuple[float | None, float | None]:
    """(idle time per rank, peak activations in stages) as published, None where there is none."""
    if k > 1:
        return (p - 1) * (f + b + w) / k, None
    if name in ("gpipe", "1f1b"):
        return (p - 1) * (f + b + w), float(m if name == "gpipe" else min(p, m))
    if name == "interleaved":
        return (p - 1) * (f + b + w) / v, None
    if name == "zb-h1":
        return (p - 1) * (f + b - w), float(min(p, m))
    if name == "zb-h2":
        return (p - 1) * (f + b - 2 * w), float(min(2 * p - 1, m))
    if name == "zb-v":
        return None, float(p)
    if name == "dualpipev":
        cf, cb, cw = f / 2, (b + w) / 2, w / 2  # per chunk: forward, full backward, weight pass
        pair = fb if fb is not None else cf + cb
        return (p - 1) * (pair + cb - 3 * cw), p + 0.5
    raise ConfigError(f"schedule {name!r} has no published row; valid: {', '.join(SCHEDULES)}")


def schedule_table(pp: int, microbatches: int, f: float = 1.0, b: float = 1.0, w: float = 1.0,
                   fb: float | None = None) -> list[dict]:
    """One row per schedule the arguments allow (those whose minimum micro-batches they meet)."""
    rows = []
    for name, k in [(n, 1) for n in SCHEDULES] + [("1f1b", k) for k in SLICED]:
        v = VPP.get(name, 1)
        try:
            check_args(name, pp, microbatches, v)
        except ConfigError:
            continue
        s = build_schedule(name, pp, microbatches, v, slices=k)
        costs = Costs(f=f / v / k, b=b / v / k, w=w / v / k, fb=fb)  # a slice: 1/k of the micro-batch's work
        res = simulate(s, costs)
        busy = microbatches * (f + b + w)
        idle, peak = _published(name, pp, microbatches, v, f, b, w, fb, k)
        rows.append({"schedule": name if k == 1 else f"{name}, {k} token slices", "vpp": v, "slices": k,
                     "bubble": res.bubble_fraction, "bubble_back_to_back": sum(steady_state_bubble(s, costs)) / pp,
                     "bubble_published": None if idle is None else idle / (idle + busy),
                     "peak_stages": max(res.peak_inflight) / v / k, "peak_published": peak, "params": 1.0})
    return rows


def markdown(rows: list[dict], pp: int, microbatches: int) -> str:
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    out = [f"p = {pp}, m = {microbatches}, T_F = T_B = T_W",
           "",
           "| schedule | vpp | bubble (simulated) | back to back | published | peak activations (stages) | "
           "published | parameters per rank |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['schedule']} | {r['vpp']} | {r['bubble']:.3f} | {r['bubble_back_to_back']:.3f} | "
                   f"{num(r['bubble_published'], '.3f')} | {r['peak_stages']:g} | {num(r['peak_published'], 'g')} | "
                   f"{r['params']:g}x |")
    return "\n".join(out) + "\n"
