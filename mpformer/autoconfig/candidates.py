"""The search's plans and its result: which fields a plan holds (``PLAN_FIELDS``), the pinned ones
(``Pins``), a timed and sized plan (``Candidate``), and what a search found and rejected
(``SearchResult``); shared by search.py, fit.py and the reports (explain.py, plan.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from mpformer.autoconfig.cost import Breakdown
from mpformer.autoconfig.memory import Workload
from mpformer.core.config import FixedPlan
from mpformer.core.layout import ParallelLayout

# The plan: every ParallelLayout field but these, and the micro-batch size. pp_split is the user's,
# pp_partition is searched but reported beside the plan, grad_reduce_dtype is not a layout choice,
# pp_token_slices is priced when a layout has it (cost.py, memory.py) but not searched; the expert-parallel
# fields (ep, etp, ep_dispatcher) are searched for a mixture of experts only (search.py ``expert_options``)
# and reported in its plans (``EXPERT_FIELDS``), so a dense model's plans read as before.
NOT_SEARCHED = ("pp_split", "grad_reduce_dtype", "pp_token_slices", "ep", "etp", "ep_dispatcher")
EXPERT_FIELDS = ("ep", "etp", "ep_dispatcher")
PLAN_FIELDS = (*(f.name for f in fields(ParallelLayout) if f.name not in (*NOT_SEARCHED, "pp_partition")),
               "micro_batch_size")
# What autoconfig.fixed may pin: the plan, pp_partition, and the fields the search takes as given (priced at
# the pinned value, the layout's default otherwise); pp_split is refused with a reason (search.py).
PINNABLE = tuple(f.name for f in fields(FixedPlan))
assert set(PINNABLE) == {*PLAN_FIELDS, *NOT_SEARCHED, "pp_partition"}, "autoconfig.fixed must name every layout field"


class Pins:
    """The pinned plan fields: ``pins(name, values)`` is [the pinned value] or the values to search."""

    def __init__(self, fixed: dict[str, Any]) -> None:
        self.fixed = fixed

    def __call__(self, name: str, values: list) -> list:
        return [self.fixed[name]] if name in self.fixed else values

    def __contains__(self, name: str) -> bool:
        return name in self.fixed


@dataclass
class Candidate:
    layout: ParallelLayout
    micro_batch_size: int
    memory_bytes: float
    time: Breakdown
    # autoconfig.rehearse: its most loaded rank run on the cluster's GPU (cli/rehearse.py rehearse_plans):
    # {"rank", "peak_bytes", "device", "usable_bytes"}; None when not rehearsed
    rehearsed: dict[str, Any] | None = None
    # train.precision when the search chose it among autoconfig.precisions (precision.py); None: the run's own
    precision: str | None = None

    def plan(self) -> dict[str, Any]:
        out = {k: self.micro_batch_size if k == "micro_batch_size" else getattr(self.layout, k) for k in PLAN_FIELDS}
        if has_experts(self.layout):
            out.update({k: getattr(self.layout, k) for k in EXPERT_FIELDS})
        return out

    def overrides(self) -> str:
        """The plan as pretrain's command-line overrides."""
        p = self.plan()
        parts = [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in p.items()
                 if k != "micro_batch_size" and v is not None]
        if self.layout.pp_partition != "uniform":
            parts.append(f"parallel.pp_partition={self.layout.pp_partition}")
        parts.append(f"train.micro_batch_size={p['micro_batch_size']}")
        return " ".join([*parts, *([f"train.precision={self.precision}"] if self.precision else [])])


@dataclass
class SearchResult:
    top: list[Candidate]
    feasible: list[Candidate]
    rejected: dict[str, dict[str, Any]] = field(default_factory=dict)  # class -> {"count", "example"}
    smallest: Candidate | None = None  # the least memory among valid plans (when none fits)
    evaluated: int = 0
    seconds: float = 0.0
    structures: list[tuple[list[ParallelLayout], int]] = field(default_factory=list)  # (cp-kind variants, mbs)
    pruned: int = 0  # structures never evaluated: their closed form could not enter the top k

    def count(self) -> None:
        """One more layout evaluated."""
        self.evaluated += 1

    def reject(self, cls: str, why: str) -> None:
        r = self.rejected.setdefault(cls, {"count": 0, "example": why})
        r["count"] += 1

    def add(self, c: Candidate) -> None:
        self.feasible.append(c)

    def offer_smallest(self, c: Candidate) -> None:
        """A plan that does not fit: kept if it needs the least memory so far (the error names it)."""
        if self.smallest is None or c.memory_bytes < self.smallest.memory_bytes:
            self.smallest = c

    def finished(self, top: list[Candidate], seconds: float) -> SearchResult:
        self.top, self.seconds = top, seconds
        return self


def has_experts(L: ParallelLayout) -> bool:
    """Whether a plan sets the expert-parallel fields (the search sets etp explicitly for a mixture of experts)."""
    return L.ep > 1 or L.etp is not None or L.ep_dispatcher != "alltoall"


def with_mbs(w: Workload, mbs: int) -> Workload:
    """The workload at micro-batch size ``mbs``."""
    return replace(w, micro_batch_size=mbs)


def short_plan(L: ParallelLayout, mbs: int) -> str:
    """A plan in one line (rejection examples)."""
    kind = "" if L.cp == 1 else f" {L.cp_kind}" + (f" cp_ulysses={L.cp_ulysses}" if L.cp_kind == "hybrid" else "")
    return (f"dp={L.dp} tp={L.tp} pp={L.pp} cp={L.cp}{kind} vpp={L.vpp} {L.schedule} mbs={mbs} zero={L.zero} "
            f"recompute={L.recompute}" + (" sp" if L.sequence_parallel else "")
            + (f" offload={L.offload}" if L.offload != "none" else "")
            + (f" offload_keep={L.offload_keep}" if L.offload == "auto" else "")
            + (f" ep={L.ep} etp={L.etp} {L.ep_dispatcher}" if has_experts(L) else ""))
