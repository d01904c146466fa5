"""What a measured profile's reference model corrects in the cost model (profile.py measures it).

    compute    measured / modelled forward + backward of the reference model on one rank alone: what
               the kernel-level terms miss on this machine in proportion to the work (the small ops
               they do not list, the GEMM table's nearest shapes); scales every compute term
    launch     the host's seconds per kernel launched (kernels.py's counts) beyond the kernels' work:
               eager dispatch and autograd, the same per kernel whatever its size. Separated from
               ``compute`` by the same tokens run as four short micro-batches (the same kernels four
               times on a quarter of the rows). Transfer: every layout launches the same kernels per
               layer and micro-batch, so one that splits the work thinner (tensor parallelism's
               narrower GEMMs, context parallelism's shorter sequences, more micro-batches per rank)
               pays the launches on less work; a compute factor alone would shrink them with the work
    split      how much longer the backward takes split into input and weight gradients, as the
               zero-bubble schedules run it, than in one pass; scales their backward
    pipeline   by pipeline depth: the reference model's measured step in that pipeline (1F1B, ranks
               sharing the host's cores) over the processor-sharing timeline's prediction for it,
               both relative to a step of as many micro-batches with every rank busy without a break
               (measured in the same round, modelled as the time alone x slowdown(ranks), so that the
               machine's drift and the slowdowns' own error cancel). What the timeline misses: ranks that
               compute in bursts and wait in between are scheduled worse than ranks that compute
               without a break (wake-ups, a core shared while the other idles), and the hand-offs.
               Scales the pipeline's timeline on that host, whatever its schedule; linear in the
               depth between measured ones. Transfer: interleaving and the zero-bubble schedules run
               the same hand-offs between stages and ranks that idle between bursts; what differs
               (more and shorter chunks, the split backward's own cost) is in the timeline simulated
               on their action lists and in ``split``. A zero-bubble layout in the profile gave a
               further factor indistinguishable from 1 (0.98-1.37 over four profiles of one machine
               within ten minutes), so none is taken
    tp         by tensor-parallel degree: the reference model's tensor-parallel step beyond its
               modelled compute over the modelled waits from the collectives' fits. The fits are
               taken with every rank computing between collectives at its own pace; a tensor-parallel
               group computes the same work in lockstep and arrives together, and while it waits it
               lends its core to the other ranks (the step grows by less than the waits the ledger
               times, which the profile records beside it: ``tp_waits_relative_to_busy``). A ratio
               that is the group's pattern, not the message's: scales the waits at that degree and,
               on each degree's own fits, at the nearest measured degree's value elsewhere

Each is a ratio of the same reference model measured and modelled, never a fit to the runs it is
checked against (benchmarks/bench_autoconfig.py trains a different model). Worked out once per
profile, not per candidate: ``cost.calibration(cluster)`` works them out from the profile with the
cost model itself (so the lookup lives beside the model, and this module holds only the factors).
Not corrected: data-parallel and ZeRO collectives (their alpha-beta fits
stand), the optimizer step, anything on accelerators (their presets have no reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpformer.autoconfig.sharing import interpolate

# A correction outside this range means the measurement, not the model, is off: clamped.
LIMITS = (0.5, 4.0)


@dataclass(frozen=True)
class Calibration:
    compute: float = 1.0
    split: float = 1.0
    pipeline: dict[int, float] = field(default_factory=dict)  # pipeline depth -> factor
    tp: dict[int, float] = field(default_factory=dict)  # tensor-parallel degree -> factor
    launch: float = 0.0  # host seconds per kernel launched, beyond the kernels' work (CPU: eager dispatch)

    def pipeline_factor(self, pp: int, schedule: str = "1f1b") -> float:
        """The factor for a pipeline of depth ``pp`` (any schedule): measured depths, linear between
        them (from 1 at depth 1), the deepest one's beyond."""
        if pp <= 1 or not self.pipeline:
            return 1.0
        return interpolate({1: 1.0, **self.pipeline}, pp)

    def tp_factor(self, tp: int) -> float:
        """The measured degree's factor; elsewhere the nearest measured degree's (1 without any)."""
        if tp <= 1 or not self.tp:
            return 1.0
        return self.tp[min(self.tp, key=lambda d: (abs(d - tp), d))]

    def to_dict(self) -> dict:
        return {"compute": self.compute, "launch_s": self.launch, "split_backward": self.split,
                "pipeline": {str(k): v for k, v in sorted(self.pipeline.items())},
                "tp": {str(k): v for k, v in sorted(self.tp.items())}}


def clamp(x: float) -> float:
    return min(max(x, LIMITS[0]), LIMITS[1])
