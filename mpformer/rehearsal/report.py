"""A rehearsal's report: which ranks, the memory model's figures beside the rehearsed ones, the table.

The memory model (autoconfig/memory.py ``plan_memory``) gives each pipeline stage its peak as model
state, activations and transients. By kind:

    weights, grads, master, optimizer   the model state split as the ZeRO formula's terms (w, g, m, k)
    activations                         what the micro-batches in flight keep for backward at the peak
    other                               the transients (the head's chunk, buckets, gathered units,
                                        reductions' buffers) and a speculative step's saved copy

The rehearsal counts what the runtime's tensors hold (probe.py): its kinds follow the storages (ZeRO-3's
gathered units are weights there, transients here), so the totals are what is compared; neither
counts the CUDA context, NCCL's buffers or the caching allocator's fragmentation (devices.py).
"""

from __future__ import annotations

from dataclasses import replace

from mpformer.core.config import Config
from mpformer.core.layout import ParallelLayout
from mpformer.rehearsal.devices import GpuTarget
from mpformer.rehearsal.probe import KINDS

GB = 1e9


def default_ranks(layout: ParallelLayout) -> list[int]:
    """One rank of each distinct shape: every pipeline stage, its first and last tp and cp rank (dp 0)."""
    topo = layout.topology
    out = {topo.rank(pp=p, dp=0, cp=c, tp=t) for p in range(layout.pp) for c in {0, layout.cp - 1}
           for t in {0, layout.tp - 1}}
    return sorted(out)


def check_ranks(ranks: list[int], world_size: int) -> None:
    from mpformer.core.errors import ConfigError

    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"rehearse.ranks has {bad[0]}, outside the world of {world_size} ranks; "
                          f"valid: 0..{world_size - 1}")


def predicted(cfg: Config, layout: ParallelLayout, stage: int) -> dict:
    """The memory model's peak for pipeline rank ``stage`` of this run on a GPU, by kind."""
    from mpformer.autoconfig.layer_memory import BYTES
    from mpformer.autoconfig.memory import Workload, plan_memory
    from mpformer.autoconfig.runtimes import mpformer_runtime
    from mpformer.optim.memory import zero_formula_bytes

    t = cfg.train
    w = Workload(t.global_batch_size, t.micro_batch_size, t.seq_length, t.precision,
                 fused_cross_entropy=t.fused_cross_entropy, cross_entropy_chunk=t.cross_entropy_chunk,
                 runtime=mpformer_runtime(t))
    mem = plan_memory(cfg.model, layout, w, device="cuda", bucket_mb=t.grad_bucket_mb)[stage]
    wb, n_d, n = BYTES[t.precision], layout.dp * layout.cp, mem.params
    stage3 = layout.zero == 3
    terms = {"weights": dict(w=0 if stage3 and wb < 4 else wb, g=0, m=0, k=0), "grads": dict(w=0, g=4, m=0, k=0),
             "master": dict(w=0, g=0, m=4 if wb < 4 else 0, k=0), "optimizer": dict(w=0, g=0, m=0, k=8)}
    by_kind = {kind: zero_formula_bytes(layout.zero, n, n_d, **x) for kind, x in terms.items()}
    scale = mem.model_state / sum(by_kind.values()) if sum(by_kind.values()) else 1.0  # another runtime's split
    by_kind = {k: v * scale for k, v in by_kind.items()}
    by_kind["activations"] = mem.activations
    by_kind["other"] = mem.transients + mem.speculation
    return {"predicted_peak_bytes": int(mem.live), "predicted_by_kind": {k: int(by_kind[k]) for k in KINDS},
            "predicted_where": mem.phase, "predicted_params": int(mem.params)}


def with_formulas(cfg: Config, layout: ParallelLayout, report: dict) -> dict:
    """A rank's report with the memory model's figures and the communication formula's beside its own
    (volumes.py): ``comm_formula_bytes`` per collective (None: no closed form) and ``comm_formula_error``,
    the largest |formula / ledger - 1| of those with one."""
    from mpformer.rehearsal.volumes import comm_agreement, comm_formula

    report.update(predicted(cfg, layout, stage_of(layout, report["rank"])))
    formula = comm_formula(cfg, layout, report["rank"], report["predicted_params"])
    report["comm_formula_bytes"] = formula
    report["comm_formula_error"] = comm_agreement(report["comm_bytes"], formula)
    return report


def most_loaded_rank(cfg: Config, layout: ParallelLayout) -> int:
    """The first rank (dp, cp, tp 0) of the pipeline stage the memory model holds the largest: the rank a
    plan's fit is decided on (autoconfig.rehearse)."""
    stages = [predicted(cfg, layout, p)["predicted_peak_bytes"] for p in range(layout.pp)]
    return layout.topology.rank(pp=stages.index(max(stages)), dp=0, cp=0, tp=0)


def stage_of(layout: ParallelLayout, rank: int) -> int:
    return layout.topology.coords(rank)["pp"]


def table(reports: list[dict], device: GpuTarget) -> str:
    """One line per rank: rehearsed peak beside the model's, the kinds, kernels, squares, syncs."""
    head = (f"{'rank':>5} {'coords':<22} {'peak GB':>8} {'model GB':>8} {'diff':>6} {'fits':>5} "
            + " ".join(f"{k[:6]:>7}" for k in KINDS) + "  kernels           [s,s]  syncs(in step)  comm/formula  where")
    c = device.preset
    lines = [f"rehearsed on {device.name}: {device.usable_bytes / GB:.1f} GB usable of {device.total_bytes / GB:.1f} "
             f"(less the CUDA context {c.context_gb:g} GB, NCCL's buffers {c.nccl_gb:g} GB and a "
             f"{c.reserve_fraction:.0%} allocator reserve: configs/cluster/{c.name}.yaml)", head]
    for r in reports:
        c = r["coords"]
        coords = f"pp{c['pp']} dp{c['dp']} cp{c['cp']} tp{c['tp']}"
        peak, model = r["peak_bytes"], r.get("predicted_peak_bytes", 0)
        diff = f"{100 * (model - peak) / peak:+.1f}%" if peak and model else "-"
        fits = "yes" if peak <= device.usable_bytes else "NO"
        kinds = " ".join(f"{r['peak_by_kind'][k] / GB:7.2f}" for k in KINDS)
        kernels = ",".join(f"{k}:{v}" for k, v in sorted(r["attention_kernels"].items())) or "-"
        inside = sum(1 for s in r["host_syncs"] if not s.get("boundary"))
        err = r.get("comm_formula_error")
        comm = "-" if err is None else f"{100 * err:.2g}%"
        lines.append(f"{r['rank']:>5} {coords:<22} {peak / GB:8.2f} {model / GB:8.2f} {diff:>6} {fits:>5} {kinds}  "
                     f"{kernels:<17} {len(r['square_tensors']):>5}  {len(r['host_syncs']):>3} ({inside:>2})      "
                     f"{comm:>12}  {r['peak_where']}")
    return "\n".join(lines)


def with_layout_dp(layout: ParallelLayout, world_size: int) -> ParallelLayout:
    return replace(layout, dp=world_size // (layout.tp * layout.pp * layout.cp))
