"""The GPUs a rehearsal stands in for (``rehearse.device``): their memory and what the kernel choice reads.

``total_bytes`` is the device memory torch reports (``torch.cuda.get_device_properties(i).total_memory``,
nvidia-smi's "Total" in MiB). What a training process can fill with tensors is less:

    context     the CUDA context, cuBLAS/cuDNN handles and their workspaces: about 0.5-1 GB once the
                first kernels have run (PyTorch's CUDA semantics notes; nvidia-smi of an idle process
                after init shows 500-600 MiB on H100 with CUDA 12); 1.0 GB is taken
    nccl        NCCL's buffers: NCCL_BUFFSIZE (4 MiB) per channel per peer per protocol; with the 16-32
                channels of an NVLink/IB H100 node and the communicators of a 4-D layout (tp, dp, pp, cp
                groups, each its own), about 1-2 GB (NCCL's environment-variable docs; Megatron-LM and
                torchtitan runs report 1-3 GB); 2.0 GB is taken
    reserve     the caching allocator's fragmentation over a step (blocks of freed sizes that a larger
                request cannot reuse): ``memory_reserved`` exceeds the peak allocated by 3-10% in
                PyTorch's allocator studies; 5% of the device is kept free

``usable_bytes`` (what a plan's tensors may take) is the total less all three. The rehearsal reports
its peak against it; the auto-configurator (autoconfig/plan.py) drops plans above it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpformer.core.errors import ConfigError, format_choices

MiB = 2**20
CONTEXT_BYTES = 1.0e9
NCCL_BYTES = 2.0e9
RESERVE_FRACTION = 0.05


@dataclass(frozen=True)
class GpuTarget:
    name: str
    total_bytes: int
    capability: tuple[int, int]  # compute capability: flash attention needs 8.0 (A100) or later
    cluster: str  # the configs/cluster preset with this GPU's rates

    @property
    def usable_bytes(self) -> float:
        """What the plan's tensors may take: the total less the context, NCCL's buffers and the reserve."""
        return self.total_bytes * (1 - RESERVE_FRACTION) - CONTEXT_BYTES - NCCL_BYTES

    def to_dict(self) -> dict:
        return {"name": self.name, "total_bytes": self.total_bytes, "usable_bytes": self.usable_bytes,
                "capability": list(self.capability), "context_bytes": CONTEXT_BYTES, "nccl_bytes": NCCL_BYTES,
                "reserve_fraction": RESERVE_FRACTION}


DEVICES = {g.name: g for g in (
    GpuTarget("h100-80gb", 81559 * MiB, (9, 0), "dgx-h100"),  # H100 SXM5 80GB
    GpuTarget("h200-141gb", 143771 * MiB, (9, 0), "h200-node"),  # H200 SXM 141GB
    GpuTarget("a100-80gb", 81920 * MiB, (8, 0), "dgx-a100-80gb"),  # A100 SXM4 80GB
    GpuTarget("a100-40gb", 40960 * MiB, (8, 0), "dgx-a100-80gb"),  # A100 SXM4 40GB: the 80GB's rates
)}


def gpu_target(name: str) -> GpuTarget:
    if name not in DEVICES:
        raise ConfigError(f"rehearse.device={name!r} is unknown; valid: {format_choices(sorted(DEVICES))}")
    return DEVICES[name]
