"""Which ``train.precision`` a plan runs in: the device's rates decide among those the user allows.

``autoconfig.precisions`` (empty: the run's own ``train.precision``) lists what tools/autoconfig.py and
``parallel=auto`` may choose from; each is searched on its own (the memory and cost models read the
precision: fp8's float8 GEMMs at the device's FP8 rate, its saved float8 copies, autoconfig/fp8_terms.py)
and the fastest plan of all wins, its precision with it.

A precision the device has no rate for is refused in one line when asked for alone, and left out of a
list that names others too (an A100 has no float8 tensor cores: fp8 there is bf16 with extra casts).
fp8 trains on every layout (dense layers and routed experts alike), so its search has the same space.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mpformer.autoconfig.candidates import SearchResult
from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.workload import Workload
from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.fp8_config import compute_precision
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
        runs.append((search(model, cluster, wp, fixed=fixed, top_k=top_k, device=device), wp))
    for res, wp in runs:  # the plan runs in the precision it was priced in (parallel=auto sets it)
        for c in res.top:
            c.precision = wp.precision
    with_plan = [r for r in runs if r[0].top]
    if not with_plan:
        return runs[0]
    return min(with_plan, key=lambda r: r[0].top[0].time.iteration_s)

