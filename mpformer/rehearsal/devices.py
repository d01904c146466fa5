"""The GPUs a rehearsal stands in for (``rehearse.device``): their memory and what the kernel choice reads.

Each GPU names the cluster preset (configs/cluster/) that holds its figures, each with its source there:
the device's memory as the driver reports it, and what a training process cannot fill with tensors (the
CUDA context, NCCL's buffers, the caching allocator's reserve). ``usable_bytes`` is the preset's
(autoconfig/cluster.py): the rehearsal reports each rank's peak against it, and the auto-configurator fits
its plans to the same figure. A GPU sold in two sizes with one node preset (the A100 40GB) gives its own
total and takes the rest from its sibling's preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mpformer.autoconfig.cluster import Cluster, load_cluster
from mpformer.core.errors import ConfigError, format_choices

GiB = 2**30


@dataclass(frozen=True)
class GpuTarget:
    name: str
    capability: tuple[int, int]  # compute capability: flash attention needs 8.0 (A100) or later
    cluster: str  # the configs/cluster preset with this GPU's rates and memory figures
    memory_gb: float | None = None  # the driver's total where it differs from the preset's

    @cached_property
    def preset(self) -> Cluster:
        return load_cluster(self.cluster)

    @property
    def total_bytes(self) -> float:
        return self.memory_gb * 1e9 if self.memory_gb is not None else self.preset.memory_bytes

    @property
    def usable_bytes(self) -> float:
        """What the plan's tensors may take: the total less the context, NCCL's buffers and the reserve."""
        c = self.preset
        return self.total_bytes * (1 - c.reserve_fraction) - (c.context_gb + c.nccl_gb) * 1e9

    def to_dict(self) -> dict:
        c = self.preset
        return {"name": self.name, "total_bytes": self.total_bytes, "usable_bytes": self.usable_bytes,
                "capability": list(self.capability), "cluster": self.cluster, "context_bytes": c.context_gb * 1e9,
                "nccl_bytes": c.nccl_gb * 1e9, "reserve_fraction": c.reserve_fraction}


DEVICES = {g.name: g for g in (
    GpuTarget("h100-80gb", (9, 0), "dgx-h100"),  # H100 SXM5 80GB
    GpuTarget("h100-96gb", (9, 0), "grand-teton-h100-96gb"),  # H100 96GB (Meta's Grand Teton)
    GpuTarget("h200-141gb", (9, 0), "h200-node"),  # H200 SXM 141GB
    GpuTarget("a100-80gb", (8, 0), "dgx-a100-80gb"),  # A100 SXM4 80GB
    # A100 SXM4 40GB: 39.50 GiB, torch's "total capacity" in an out-of-memory message (TianheWu/CoSeR#10)
    GpuTarget("a100-40gb", (8, 0), "dgx-a100-80gb", memory_gb=39.50 * GiB / 1e9),
)}


def gpu_target(name: str) -> GpuTarget:
    if name not in DEVICES:
        raise ConfigError(f"rehearse.device={name!r} is unknown; valid: {format_choices(sorted(DEVICES))}")
    return DEVICES[name]


def gpu_of_cluster(cluster: Cluster) -> GpuTarget | None:
    """The GPU a cluster preset's devices are (autoconfig.rehearse); None for a CPU host or an unknown GPU."""
    if cluster.cores:
        return None
    return next((g for g in DEVICES.values() if g.cluster == cluster.name and g.memory_gb is None), None)
