"""Which ``train.precision`` a plan runs in: the device's rates decide among those the user allows.

``autoconfig.precisions`` (empty: the run's own ``train.precision``) lists what tools/autoconfig.py and
``parallel=auto`` may choose from; each is searched on its own (the memory and cost models read the
precision: fp8's float8 GEMMs at the device's FP8 rate, its saved float8 copies, autoconfig/fp8_terms.py)
and the fastest plan of all wins, its precision with it.

A precision the device has no rate for is refused in one line when asked for alone, and left out of a
list that names others too (an A100 has no float8 tensor cores: fp8 there is bf16 with extra casts).
fp8 trains on the layouts core/fp8_config.py allows (``fp8_layout_limits``: every layout of a dense
model; cp and etp pinned to 1 where routed experts go float8): its search pins those to 1 and tries
every ZeRO stage it allows, so the plan it returns runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mpformer.autoconfig.candidates import Candidate, SearchResult
from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.workload import Workload
from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.fp8_config import compute_precision, fp8_layout_limits
from mpformer.core.model_config import ModelConfig


def rate_dtype(precision: str) -> str:
    """The peak_flops key a precision's GEMMs need: fp8's float8 GEMMs need "fp8" (its bf16 rest, "bf16")."""
    return "fp8" if precision == "fp8" else compute_precision(precision)


def supports(c: Cluster, precision: str) -> bool:
    return rate_dtype(precision) in c.peak_flops and compute_precision(precision) in c.peak_flops


def check_precision(c: Cluster, precision: str) -> None:
    """One line when the cluster's device has no rate for ``precision`` (fp8 on an A100, say)."""
    if supports(c, precision):
        return
    have = [p for p in ("fp32", "bf16", "fp16", "fp8") if supports(c, p)]
    why = (" (float8 GEMMs need tensor cores of compute capability 8.9 or 9.0: H100, H200, L40S, not A100)"
           if precision == "fp8" else "")
    raise ConfigError(f"train.precision={precision}: cluster {c.name} has no {rate_dtype(precision)} rate in its "
                      f"peak_flops{why}; valid: {format_choices(have)}")


def allowed(c: Cluster, requested: Sequence[str], own: str) -> list[str]:
    """The precisions to search: ``requested`` (or the run's ``own``) that the device has rates for; asked
    for one precision the device lacks, a one-line error."""
    wanted = list(dict.fromkeys(requested)) or [own]
    if len(wanted) == 1:
        check_precision(c, wanted[0])
    ok = [p for p in wanted if supports(c, p)]
    if not ok:
        check_precision(c, wanted[0])
    return ok


def search_precisions(model: ModelConfig, cluster: Cluster, w: Workload, precisions: Sequence[str], *,
                      fixed: dict[str, Any], top_k: int, device: str) -> tuple[SearchResult, Workload]:
    """The search in each allowed precision; the result whose best plan is fastest, with its workload
    (its top plans carry their precision)."""
    from mpformer.autoconfig.search import search

    runs: list[tuple[SearchResult, Workload]] = []
    for p in precisions:
        wp = replace(w, precision=p)
        if p != "fp8":
            runs.append((search(model, cluster, wp, fixed=fixed, top_k=top_k, device=device), wp))
            continue
        limits = fp8_layout_limits(model.num_experts > 0)
        pins = {k: 1 for k in limits["ones"]}
        if any(k in fixed and fixed[k] != 1 for k in pins) or fixed.get("zero", 0) > limits["max_zero"]:
            if len(precisions) == 1:  # asked for fp8 alone: the training config's rule says why, in one line
                bad = next((k for k in pins if fixed.get(k, 1) != 1), "zero")
                raise ConfigError(f"autoconfig.fixed.{bad}={fixed[bad]} with train.precision=fp8: fp8 trains at "
                                  f"{', '.join(f'{k}=1' for k in pins)} and zero <= {limits['max_zero']} today; "
                                  "valid: unpin it, or train.precision=bf16")
            continue
        zeros = [fixed["zero"]] if "zero" in fixed else list(range(limits["max_zero"] + 1))
        parts = [search(model, cluster, wp, fixed={**fixed, **pins, "zero": z}, top_k=top_k, device=device)
                 for z in zeros]
        runs.append((_merge(parts, top_k), wp))
    for res, wp in runs:  # the plan runs in the precision it was priced in (parallel=auto sets it)
        for c in res.top:
            c.precision = wp.precision
    with_plan = [r for r in runs if r[0].top]
    if not with_plan:
        return runs[0]
    return min(with_plan, key=lambda r: r[0].top[0].time.iteration_s)


def _merge(parts: list[SearchResult], top_k: int) -> SearchResult:
    """Searches of one precision under different pins as one result (the fastest top_k of all)."""
    out = parts[0]
    for r in parts[1:]:
        out.feasible += r.feasible
        out.evaluated += r.evaluated
        out.seconds += r.seconds
        out.pruned += r.pruned
        for cls, v in r.rejected.items():
            mine = out.rejected.setdefault(cls, {"count": 0, "example": v["example"]})
            mine["count"] += v["count"]
        if r.smallest is not None:
            out.offer_smallest(r.smallest)
    tops: list[Candidate] = [c for r in parts for c in r.top]
    out.top = sorted(tops, key=lambda c: c.time.iteration_s)[:top_k]
    return out
