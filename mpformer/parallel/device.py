"""Device abstraction: cpu + gloo, or cuda + nccl. The only module that touches torch.cuda."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mpformer.core.errors import ConfigError

DEVICE_KINDS = ("auto", "cpu", "cuda")
# What module constructors accept for their parameters' placement.
DeviceLike = torch.device | str | None


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" or "cuda"
    local_rank: int = 0

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.kind == "cuda" else torch.device("cpu")

    def activate(self) -> None:
        """Bind this process to its device (one GPU per process under torchrun)."""
        if self.kind == "cuda":
            torch.cuda.set_device(self.local_rank)

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.local_rank)

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated on the device, or None where the allocator does not track it (CPU)."""
        return torch.cuda.max_memory_allocated(self.local_rank) if self.kind == "cuda" else None

    def reset_peak_memory(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.local_rank)

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The generators dropout draws from: the CPU one, and this GPU's when on cuda."""
        state = {"torch": torch.get_rng_state()}
        if self.kind == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.local_rank)
        return state

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["torch"])
        if self.kind == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.local_rank)

    def name(self) -> str:
        """What the device is, for reports ("NVIDIA H200", or the CPU's vector ISA)."""
        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.local_rank)
        return f"cpu ({torch.backends.cpu.get_cpu_capability()})"

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if self.kind == "cuda" and dtype == torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        return True


def resolve_device(kind: str = "auto", local_rank: int | None = None) -> Device:
    """Pick the device for this process: 'auto' takes cuda when a GPU is visible, else cpu."""
    if kind not in DEVICE_KINDS:
        raise ConfigError(f"train.device={kind!r} is unknown; valid: {', '.join(DEVICE_KINDS)}")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    has_cuda = torch.cuda.is_available()
    if kind == "cuda" and not has_cuda:
        raise ConfigError("train.device=cuda but no CUDA device is visible; valid here: cpu, auto")
    if kind == "auto":
        kind = "cuda" if has_cuda else "cpu"
    if kind == "cuda" and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible")
    return Device(kind, local_rank)
