"""Which recompute mode and activation offload make a structure fit, and how little of either: the
memory side of the search (search.py enumerates the structures and ranks what fits).

Per structure (a layout but for recompute and offload, with its cp kinds), the cheapest recompute mode
that fits (none < selective < full in time), and for selective and full the fewest layers per chunk
that must recompute (bisection: memory falls as more recompute); activation offload where a host link
is there, tried at each mode that does not fit without it, and where offloading everything fits, the
largest budget of units kept on the device that fits (offload=auto: the fewest copies).
"""

from __future__ import annotations

from dataclasses import replace

from mpformer.autoconfig.candidates import Candidate, Pins, SearchResult, short_plan, with_mbs
from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.cost import Breakdown, cp_layer_times, iteration_time
from mpformer.autoconfig.inflight import inflight
from mpformer.autoconfig.memory import Workload, plan_memory
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.pipeline_plan import stage_counts


def recompute_choice(model: ModelConfig, cluster: Cluster, w: Workload, result: SearchResult, options: Pins,
                      device: str, bases: list[ParallelLayout], mbs: int) -> None:
    """The cheapest recompute mode that fits (none < selective < full in time), unless pinned; at
    each, the layout's cp kinds (``bases``: valid, alike but for cp_kind / cp_ulysses) fastest first."""
    ww, valid = with_mbs(w, mbs), bases
    search_k = "recompute" not in options and "recompute_layers" not in options
    # Activation offload is the other way to fit: tried at each recompute mode that does not fit without
    # it, on a host link; where offload=all fits, offload=auto with the largest budget that fits (the
    # fewest copies) is taken instead.
    offloads = options("offload", ["none", "all"] if bases[0].pp > 1 and cluster.host_bandwidth > 0 else ["none"])
    if "offload_keep" in options and "offload" not in options:
        offloads = ["auto"]  # a budget is offload=auto's
    budget_free = "offload_keep" not in options
    found: list[Candidate] = []
    for rec in options("recompute", ["none", "selective", "full"]):
        for off in offloads:
            keep = options("offload_keep", [1])[0] if off == "auto" else 1
            layouts = [replace(L, recompute=rec, offload=off, offload_keep=keep) for L in valid]
            if rec != "none" and "recompute_layers" in options:
                layouts = [replace(L, recompute_layers=options("recompute_layers", [None])[0]) for L in layouts]
            if len(layouts) > 1:  # the kinds differ only in the attention's exposed traffic
                layouts.sort(key=lambda L: sum(cp_layer_times(model, L, ww, cluster)))
            fitted = False
            for L in layouts:
                fit = fits(model, cluster, ww, result, L, mbs, device)
                if fit is None:
                    continue
                if search_k and rec != "none":
                    L, fit = fewest_recomputed(model, cluster, ww, result, L, mbs, device, fit)
                if budget_free and (off == "auto" or (off == "all" and "offload" not in options)):
                    L, fit = largest_budget(model, cluster, ww, result, L, mbs, device, fit)
                b = iteration_time(model, L, ww, cluster, params_per_rank=fit[1], simulate_pipeline=False)
                b.extra["estimate"] = "bound"
                found.append(Candidate(L, mbs, fit[0], b))
                fitted = True
                break
            if fitted and off == "none":
                break  # fits without moving anything: offloading cannot be faster
        if any(c.layout.recompute == "none" and c.layout.offload == "none" for c in found):
            break  # nothing recomputed or moved fits: neither can be faster
    if found:
        result.add(min(found, key=lambda c: c.time.iteration_s))


def fits(model: ModelConfig, cluster: Cluster, w: Workload, result: SearchResult, L: ParallelLayout, mbs: int,
          device: str) -> tuple[float, int] | None:
    """(bytes per device, parameters per rank) of the layout's most loaded stage when it fits."""
    result.count()
    stages = plan_memory(model, L, w, device=device)
    need = max(s.total for s in stages)
    params = max(s.params for s in stages)
    if need > cluster.usable_bytes:
        result.offer_smallest(Candidate(L, mbs, need, Breakdown(extra={"params": params})))
        result.reject("out of memory", f"{short_plan(L, mbs)} needs {need / 1e9:.1f} GB per device")
        return None
    host = max(s.host for s in stages) * cluster.devices_per_node  # every device of a node offloads alike
    if cluster.host_memory_gb and host > cluster.host_memory_gb * 1e9:
        result.reject("out of host memory", f"{short_plan(L, mbs)} offloads {host / 1e9:.0f} GB per node, more "
                                            f"than its {cluster.host_memory_gb:g} GB")
        return None
    return need, params


def largest_budget(model: ModelConfig, cluster: Cluster, w: Workload, result: SearchResult, L: ParallelLayout,
                    mbs: int, device: str, fit: tuple[float, int]) -> tuple[ParallelLayout, tuple[float, int]]:
    """offload=auto with the largest budget (offload_keep) that still fits, given that ``L`` (offload all,
    or auto with budget 1) fits: memory grows with the budget and the copies shrink (bisection); ``L``
    when none does. A budget of the peak less one moves nothing: offload=none, which did not fit."""
    micro = w.global_batch_size // (mbs * L.dp)
    peak = max(inflight(L.schedule, L.pp, micro, L.vpp, L.pp_token_slices))
    lo, hi, best = 1 if L.offload == "all" else 2, peak - 2, (L, fit)
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = replace(L, offload="auto", offload_keep=mid)
        got = fits(model, cluster, w, result, cand, mbs, device)
        if got is None:
            hi = mid - 1
        else:
            best, lo = (cand, got), mid + 1
    return best


def fewest_recomputed(model: ModelConfig, cluster: Cluster, w: Workload, result: SearchResult, L: ParallelLayout,
                       mbs: int, device: str, fit: tuple[float, int]) -> tuple[ParallelLayout, tuple[float, int]]:
    """The layout recomputing the fewest layers per chunk that still fits (memory falls as more layers
    recompute: bisection), given that recomputing all of them fits (``fit``)."""
    most = max(stage_counts(model, L, w.seq_length))
    lo, hi, best = 1, most - 1, (L, fit)
    while lo <= hi:
        k = (lo + hi) // 2
        trial = replace(L, recompute_layers=k)
        result.count()
        stages = plan_memory(model, trial, w, device=device)
        need = max(s.total for s in stages)
        if need <= cluster.usable_bytes:
            best, hi = (trial, (need, max(s.params for s in stages))), k - 1
        else:
            lo = k + 1
    return best
