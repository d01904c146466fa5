"""What a measured profile's reference model corrects in the cost model (profile.py measures it).

    compute    measured / modelled forward + backward of the reference model on one rank alone: what
               the kernel-level terms miss on this machine (framework and autograd overhead, the small
               ops they do not list); scales every compute term
    split      how much longer the backward takes split into input and weight gradients, as the
               zero-bubble schedules run it, than in one pass; scales their backward
    pipeline   by pipeline depth: the reference model's measured step in that pipeline (1F1B, ranks
               sharing the host's cores) over the processor-sharing timeline's prediction for it,
               both relative to a step of as many micro-batches with every rank busy without a break
               (measured in the same round, modelled as the time alone x slowdown(ranks), so that the
               machine's drift and the slowdowns' own error cancel). What the timeline misses: ranks that
               compute in bursts and wait in between are scheduled worse than ranks that compute
               without a break (wake-ups, a core shared while the other idles), and the hand-offs.
               Scales the pipeline's timeline on that host; linear in the depth between measured ones.
               The zero-bubble H1 schedule at the deepest depth gives a further factor for the
               schedules that split the backward (more and shorter bursts, deferred weight GEMMs)
    tp         by tensor-parallel degree: the reference model's measured tensor-parallel step over its
               prediction, the miss put on the collectives tensor parallelism waits in (on shared
               cores a collective waits for its partners to be scheduled); scales those waits at that
               degree only (other group sizes keep their own collectives' fits)

Each is a ratio of the same reference model measured and modelled, never a fit to the runs it is
checked against (benchmarks/bench_autoconfig.py trains a different model). Worked out once per
profile, not per candidate. Not corrected: data-parallel and ZeRO collectives (their alpha-beta fits
stand), the optimizer step, anything on accelerators (their presets have no reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.sharing import interpolate, slowdowns

# A correction outside this range means the measurement, not the model, is off: clamped.
LIMITS = (0.5, 4.0)
SPLIT = ("zb-h1", "zb-h2")  # schedules that split the backward


@dataclass(frozen=True)
class Calibration:
    compute: float = 1.0
    split: float = 1.0
    pipeline: dict[int, float] = field(default_factory=dict)  # pipeline depth -> factor
    tp: dict[int, float] = field(default_factory=dict)  # tensor-parallel degree -> factor
    zero_bubble: float = 1.0  # a zero-bubble schedule's further factor over 1F1B's

    def pipeline_factor(self, pp: int, schedule: str = "1f1b") -> float:
        """The factor for a pipeline of depth ``pp``: measured depths, linear between them (from 1 at
        depth 1), the deepest one's beyond; times ``zero_bubble`` for the split-backward schedules."""
        if pp <= 1 or not self.pipeline:
            return 1.0
        return interpolate({1: 1.0, **self.pipeline}, pp) * (self.zero_bubble if schedule in SPLIT else 1.0)

    def tp_factor(self, tp: int) -> float:
        return self.tp.get(tp, 1.0)

    def to_dict(self) -> dict:
        return {"compute": self.compute, "split_backward": self.split, "zero_bubble": self.zero_bubble,
                "pipeline": {str(k): v for k, v in sorted(self.pipeline.items())},
                "tp": {str(k): v for k, v in sorted(self.tp.items())}}


def _clamp(x: float) -> float:
    return min(max(x, LIMITS[0]), LIMITS[1])


def calibration(c: Cluster) -> Calibration:
    """The cluster's corrections from its profile (all 1 without one)."""
    ref = c.measured.get("reference")
    if not ref:
        return Calibration()
    layouts = c.measured.get("layouts") or {}
    # Keyed by the profile (held, so that its id is not reused) and the cluster's other fields: the
    # factors depend on both (cores, rates), not on the candidate.
    key = (id(c.measured), repr(replace(c, measured={})))
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is c.measured:
        return cached[1]
    base = _alone(c, ref)
    out = _from_layouts(replace(c, measured={k: v for k, v in c.measured.items() if k != "layouts"}),
                        ref, layouts, base) if layouts and slowdowns(c) is not None else base
    _CACHE[key] = (c.measured, out)
    return out


_CACHE: dict[tuple[int, str], tuple[dict, Calibration]] = {}


def _alone(c: Cluster, ref: dict) -> Calibration:
    from mpformer.autoconfig.cost import stage_costs
    from mpformer.autoconfig.memory import Workload
    from mpformer.models.config import ModelConfig
    from mpformer.parallel.layout import ParallelLayout

    m = ModelConfig(**ref["model"])
    w = Workload(ref["micro_batch_size"], ref["micro_batch_size"], ref["seq_length"], ref["precision"])
    bare = replace(c, measured={k: v for k, v in c.measured.items() if k not in ("reference", "layouts")})
    fc, bc, wc, _ = stage_costs(m, ParallelLayout(dp=1), w, bare)
    compute = ref["seconds"] / (sum(fc) + sum(bc) + sum(wc))
    if "split_backward_ratio" in ref:  # measured back to back with a one-pass backward
        extra = (ref["split_backward_ratio"] - 1.0) * ref["seconds"]
    else:
        extra = ref.get("seconds_split_backward", ref["seconds"]) - ref["seconds"]
    return Calibration(compute, 1.0 + max(extra, 0.0) / (compute * sum(bc)))


def _from_layouts(c: Cluster, ref: dict, layouts: dict, base: Calibration) -> Calibration:
    """Predict each reference layout as it ran (no gradient reduction, no optimizer step) on a host of
    its world with only the compute and split corrections (``c`` has no layouts), and compare."""
    from mpformer.autoconfig.cost import iteration_time, tp_step_time
    from mpformer.autoconfig.memory import Workload
    from mpformer.models.config import ModelConfig
    from mpformer.parallel.layout import ParallelLayout

    m = ModelConfig(**ref["model"])
    pipeline, split_pipeline, tp = {}, {}, {}
    for row in layouts.values():
        L = ParallelLayout(**row["layout"])
        host = replace(c, devices_per_node=row["world"], nodes=1)
        w = Workload(row["microbatches"], 1, ref["seq_length"], ref["precision"])
        b = iteration_time(m, L, w, host, params_per_rank=0)
        predicted = b.iteration_s - b.dp_comm_exposed_s - b.optimizer_s
        # Measured as a ratio to the same round's step with every rank computing the same number of
        # micro-batches without a break (a second or so each, back to back: the machine's drift
        # cancels), whose model is the time alone x slowdown(world).
        busy = 2 * ref["seconds"] * interpolate(slowdowns(host), row["world"])
        measured = row["relative_to_busy"] * busy
        if L.pp > 1 and L.tp == 1 and L.schedule in SPLIT:
            split_pipeline[L.pp] = measured / predicted
        elif L.pp > 1 and L.tp == 1:
            pipeline[L.pp] = _clamp(measured / predicted)
        elif L.tp > 1 and L.pp == 1:
            # The step the profile ran has no once-per-step all-reduce of the replicated gradients
            # (the trainer's, after the pipeline): out of the prediction and of the waits scaled.
            waits = b.tp_comm_s - tp_step_time(m, L, host)
            if waits > 0:
                tp[L.tp] = _clamp((measured - (predicted - b.tp_comm_s)) / waits)
    # A zero-bubble schedule against 1F1B at the same depth: its extra over 1F1B's correction.
    zb = [split_pipeline[p] / pipeline[p] for p in split_pipeline if p in pipeline]
    return replace(base, pipeline=pipeline, tp=tp, zero_bubble=_clamp(zb[0]) if zb else 1.0)
