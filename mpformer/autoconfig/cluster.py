"""Clusters the auto-configurator plans for: devices, peak rates, memory, links.

A cluster is a preset in configs/cluster/NAME.yaml (vendor data-sheet numbers; local-cpu from a
measured profile) with the node count chosen per search. Bandwidths are bytes/s per device per
direction: intra-node (NVLink, or loopback for local-cpu) and inter-node (one NIC per GPU).

Memory: ``memory_gb`` is the device's total as the driver reports it; what a plan's tensors may take
(``usable_bytes``) is that less the CUDA context (``context_gb``), NCCL's buffers (``nccl_gb``) and a
reserve for the caching allocator (``reserve_fraction`` of the device), each stated with its source in
the preset. The memory model (memory.py) predicts the tensors; the preset says what they may fill.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from mpformer.core.errors import ConfigError, format_choices


@dataclass(frozen=True)
class Cluster:
    name: str
    devices_per_node: int
    nodes: int
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s per device
    memory_gb: float  # per device, as the driver reports it; a CPU host's (``cores`` set) total, shared by its ranks
    memory_bandwidth: float  # bytes/s
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    cores: int | None = None  # local-cpu: processes share this many cores
    profile: str | None = None  # a measured profile (profile.py) next to the preset
    # Measured device rates (GPU presets, each with its source in the preset; compute.py, links.py).
    # Unset: the generic efficiency curve and the links' data-sheet rates.
    sm_count: int | None = None  # streaming multiprocessors: the GEMMs' wave quantisation
    gemm_fraction: float | None = None  # maximum achievable matmul rate / peak
    # Measured GEMMs for the size curve: {"peak": FLOP/s, "mamf": FLOP/s of their dtype, "rows": [[m, n, k, TFLOP/s]]}
    gemm_measured: dict[str, Any] | None = field(default=None, compare=False)
    stream_fraction: float = 1.0  # a streaming kernel's bytes/s / memory_bandwidth
    attention_fraction: tuple[float, float] | None = None  # flash attention forward, backward / peak
    launch_s: float = 0.0  # host time to issue one kernel (eager PyTorch)
    bus_fraction: tuple[float, float] = (1.0, 1.0)  # NCCL bus bandwidth / link bandwidth: intra, inter node
    # SMs a running NCCL collective holds (one CTA per channel): compute beside an overlapped collective
    # runs on the others (dp_cost.contention). 0: not modelled (CPU hosts: nothing overlaps there).
    comm_sms: int = 0
    # Bytes/s one device copies to pinned host memory or back (activation offload, pipeline/offload.py);
    # 0: no host link (a CPU host: its memory is the device's).
    host_bandwidth: float = 0.0
    host_memory_gb: float = 0.0  # a node's host memory, which offloaded activations share; 0: not checked
    # What the device holds besides the plan's tensors (per process; each figure's source in the preset):
    context_gb: float = 0.0  # the CUDA context and the cuBLAS/cuDNN handles and workspaces (CPU: torch itself)
    nccl_gb: float = 0.0  # NCCL's buffers over the run's communicators
    reserve_fraction: float = 0.0  # of the device: what the caching allocator's fragmentation keeps from use
    measured: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def memory_bytes(self) -> float:
        """Per device. A CPU host (``cores`` set) shares its memory among the ranks on it."""
        return self.memory_gb * 1e9 / (self.devices_per_node if self.cores else 1)

    @property
    def usable_bytes(self) -> float:
        """What one process's tensors may take: the device's memory less the context, NCCL's buffers and
        the allocator's reserve. Plans are fitted against this (fit.py)."""
        return self.memory_bytes * (1 - self.reserve_fraction) - (self.context_gb + self.nccl_gb) * 1e9

    def memory_note(self) -> str:
        """The usable figure and what it leaves out, in one line (tables and errors)."""
        return (f"{self.usable_bytes / 1e9:.1f} GB usable of {self.memory_bytes / 1e9:.1f} GB per device, less "
                f"context {self.context_gb:g} GB, NCCL {self.nccl_gb:g} GB, allocator reserve "
                f"{self.reserve_fraction:.0%}")

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ConfigError(f"cluster {self.name} has no peak rate for {dtype}; valid: "
                              f"{format_choices(sorted(self.peak_flops))}")
        return self.peak_flops[dtype]

    def link(self, group_span_nodes: bool) -> tuple[float, float]:
        """(bandwidth, latency) of a collective's slowest hop: inter-node when the group spans nodes."""
        if group_span_nodes:
            return self.inter_bandwidth, self.inter_latency
        return self.intra_bandwidth, self.intra_latency

    def with_nodes(self, nodes: int) -> Cluster:
        if nodes < 1:
            raise ConfigError(f"cluster nodes={nodes} must be >= 1")
        return replace(self, nodes=nodes)


OPTIONAL = ("cores", "profile", "sm_count", "gemm_fraction", "gemm_measured", "stream_fraction", "attention_fraction",
            "launch_s", "bus_fraction", "comm_sms", "host_bandwidth", "host_memory_gb", "context_gb", "nccl_gb",
            "reserve_fraction")


def cluster_dir() -> Path:
    from mpformer.core.composed import config_dir

    return config_dir() / "cluster"


def cluster_names() -> list[str]:
    return sorted(p.stem for p in cluster_dir().glob("*.yaml"))


# Checked on load: each a finite number, the first group above 0, the second at least 0, fractions in (0, 1]
POSITIVE = ("memory_gb", "memory_bandwidth", "intra_bandwidth", "inter_bandwidth", "sm_count", "cores")
AT_LEAST_ZERO = ("intra_latency", "inter_latency", "launch_s", "host_bandwidth", "host_memory_gb")
FRACTIONS = ("gemm_fraction", "stream_fraction", "attention_fraction", "bus_fraction")


def _check_number(path: Path, key: str, v: Any, *, positive: bool) -> bool:
    """One line naming the field unless ``v`` is a finite number (above 0, or at least 0); False if it is."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ConfigError(f"cluster file {path}: {key}={v!r} must be a finite number {'>' if positive else '>='} 0")
    return False


def load_cluster(name_or_path: str, nodes: int | None = None) -> Cluster:
    """A preset by name (configs/cluster/NAME.yaml) or a YAML path; ``nodes`` overrides the preset's."""
    from omegaconf import OmegaConf

    path = Path(name_or_path)
    if not path.suffix:
        path = cluster_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown cluster {name_or_path!r}; valid: {format_choices(cluster_names())} "
                          "(or a path to a cluster YAML)")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # yaml's parser errors, OmegaConf's interpolation errors: say which file
        raise ConfigError(f"cluster file {path} is not valid YAML ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"cluster file {path} must be a mapping of keys to values")
    known = {f.name for f in fields(Cluster)} - {"measured"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"cluster file {path}: unknown keys {unknown}; valid: {format_choices(sorted(known))}")
    missing = sorted(k for k in known - set(raw) if k not in OPTIONAL)
    if missing:
        raise ConfigError(f"cluster file {path} lacks {missing}")
    measured: dict[str, Any] = {}
    if raw.get("profile"):
        prof = path.parent / str(raw["profile"])
        if prof.is_file():
            measured = json.loads(prof.read_text())
            raw.update({k: v for k, v in measured.get("cluster", {}).items() if k in known})
    for key in ("devices_per_node", "nodes"):
        if not isinstance(raw.get(key), int) or raw[key] < 1:
            raise ConfigError(f"cluster file {path}: {key}={raw.get(key)!r} must be a whole number >= 1")
    for key in ("memory_gb", "context_gb", "nccl_gb", "reserve_fraction", *AT_LEAST_ZERO):
        _check_number(path, key, raw.get(key, 0.0), positive=False)
    for key in POSITIVE:  # a rate or a size of 0 or below would price plans at negative or infinite times
        if raw.get(key) is not None:
            _check_number(path, key, raw[key], positive=True)
    if not isinstance(raw["peak_flops"], dict) or not raw["peak_flops"]:
        raise ConfigError(f"cluster file {path}: peak_flops={raw['peak_flops']!r} must map dtypes to FLOP/s, "
                          "e.g. {bf16: 989.0e12}")
    for key, v in raw["peak_flops"].items():
        _check_number(path, f"peak_flops.{key}", v, positive=True)
    for key in FRACTIONS:
        for v in raw[key] if isinstance(raw.get(key), list | tuple) else (raw.get(key),):
            if v is not None and (_check_number(path, key, v, positive=True) or v > 1):
                raise ConfigError(f"cluster file {path}: {key}={raw[key]!r} must be a fraction in (0, 1]")
    for key in ("attention_fraction", "bus_fraction"):
        if raw.get(key) is not None:
            if not isinstance(raw[key], list | tuple) or len(raw[key]) != 2:
                raise ConfigError(f"cluster file {path}: {key}={raw[key]!r} must be a pair [a, b]")
            raw[key] = tuple(float(v) for v in raw[key])
    sms, held = raw.get("sm_count"), raw.get("comm_sms", 0)
    if not isinstance(held, int) or held < 0 or (held and (not sms or held >= sms)):
        raise ConfigError(f"cluster file {path}: comm_sms={held!r} must be a whole number >= 0 and below "
                          f"sm_count ({sms})")
    if raw.get("reserve_fraction", 0.0) >= 1:
        raise ConfigError(f"cluster file {path}: reserve_fraction={raw['reserve_fraction']!r} must be below 1 "
                          "(a fraction of the device)")
    cluster = Cluster(**{k: v for k, v in raw.items()}, measured=measured)
    if cluster.usable_bytes <= 0:
        raise ConfigError(f"cluster file {path}: nothing is left for tensors: {cluster.memory_note()}")
    return cluster.with_nodes(nodes) if nodes is not None else cluster
