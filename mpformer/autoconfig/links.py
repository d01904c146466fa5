"""Time on the links between devices: ring collectives and point-to-point transfers (alpha-beta).

A cluster preset gives each link's bandwidth and latency, and the share of the link's rate NCCL's
bus bandwidth reaches on it (``bus_fraction``: protocol overhead, measured by nccl-tests; the preset
names its source); a measured profile's alpha-beta fit of an op and group size (taken with every
rank busy) replaces them (cost.py, cp_cost.py).

A collective overlapped with compute is not free: NCCL runs each channel as one CTA on an SM of its
own for as long as the collective lasts, so the kernels beside it have ``comm_sms`` fewer SMs
(``beside``). On an H100 (132 SMs) a running ncclAllGather held 24 (NVIDIA developer forum, "Compute-
Communication Overlap Causes Severe GEMM Performance Degradation because of Tail Effect", an nsys
trace of FSDP's prefetch): 18% of the SMs, the size of the 18.9% mean compute slowdown under overlap
that Lee et al. measured on A100, H100, MI250 and MI210 (arXiv 2507.03114, 2025).
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


def beside(c: Cluster, comm: float, window: float) -> float:
    """What a collective of ``comm`` seconds costs a rank that runs it beside ``window`` seconds of
    compute: the part the window cannot cover, plus the compute the collective's SMs take while it
    runs (the SMs it holds over the device's, for as long as it overlaps)."""
    hidden = max(0.0, min(comm, window))
    return comm - hidden + sm_share(c) * hidden


def sm_share(c: Cluster) -> float:
    """The share of the device's SMs a running collective holds (``comm_sms``; 0 where not stated)."""
    return c.comm_sms / c.sm_count if c.comm_sms and c.sm_count else 0.0
