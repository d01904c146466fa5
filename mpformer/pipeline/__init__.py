"""Pipeline parallelism: schedules as verified data (docs/architecture.md, principle 3).

actions.py    the IR: Action (rank, op, microbatch, chunk), Schedule, text and CSV forms
schedules.py  generators (gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipev) and build_schedule
verify.py     matching, ordering, deadlock freedom and peak activations, before anything runs
simulate.py   the timeline of the same action lists from per-op costs; Chrome traces
engine.py     the executor: a dispatch table over the same actions (p2p.py, stage.py, trace.py)

Which layers each stage holds is pure arithmetic in mpformer.core (partition.py, pipeline_plan.py).
"""

from mpformer.pipeline.actions import Action, Op, Schedule, ScheduleError, load_schedule
from mpformer.pipeline.schedules import SCHEDULES, build_schedule
from mpformer.pipeline.simulate import Costs, SimResult, simulate
from mpformer.pipeline.verify import TimedAction, VerifyResult, execute, verify

__all__ = [
    "SCHEDULES",
    "Action",
    "Costs",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "TimedAction",
    "VerifyResult",
    "build_schedule",
    "execute",
    "load_schedule",
    "simulate",
    "verify",
]
