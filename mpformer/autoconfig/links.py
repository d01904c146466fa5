"""Time on the links between devices: ring collectives and point-to-point transfers (alpha-beta).

A cluster preset gives each link's bandwidth and latency, and the share of the link's rate NCCL's
bus bandwidth reaches on it (``bus_fraction``: protocol overhead, measured by nccl-tests; the preset
names its source); a measured profile's alpha-beta fit of an op and group size (taken with every
rank busy) replaces them (cost.py, cp_cost.py).
"""

from __future__ import annotations

from mpformer.autoconfig.cluster import Cluster

RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def _collective(c: Cluster, kind: str, nbytes: float, n: int, spans_nodes: bool) -> float:
    """Ring time: all-reduce moves 2 (n-1)/n of the buffer, all-gather / reduce-scatter / all-to-all
    (n-1)/n (docs/formulas.md section 5; all-to-all: every rank keeps 1/n of its buffer). A measured
    profile's alpha-beta fit of this op and group size (taken with every rank busy) wins."""
    if n <= 1:
        return 0.0
    fit = c.measured.get("fits", {}).get(f"{kind}/{n}")
    if fit is not None and not spans_nodes:
        return fit["alpha_s"] + RING_FACTOR[kind] * nbytes * (n - 1) / n / fit["beta_bytes_per_s"]
    bw, lat = c.link(spans_nodes)
    return RING_FACTOR[kind] * ((n - 1) * lat + nbytes * (n - 1) / n / (bw * c.bus_fraction[spans_nodes]))


def _p2p(c: Cluster, nbytes: float, spans_nodes: bool) -> float:
    """One send/receive between pipeline stages: a measured 2-rank all-gather moves the same bytes."""
    fit = c.measured.get("fits", {}).get("all_gather/2")
    if fit is not None and not spans_nodes:
        return fit["alpha_s"] + nbytes / fit["beta_bytes_per_s"]
    bw, lat = c.link(spans_nodes)
    return lat + nbytes / (bw * c.bus_fraction[spans_nodes])
