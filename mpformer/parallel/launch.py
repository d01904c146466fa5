"""Process-group start-up under torchrun (env://) or as a single plain process."""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpformer.parallel.device import Device


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it; 1 for a plain ``python pretrain/pretrain_gpt.py``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: Device, timeout_s: float) -> None:
    """init_process_group with the device's backend; a single process gets a private local store."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    device.activate()
    timeout = datetime.timedelta(seconds=timeout_s)
    # Binding the group to this rank's GPU lets NCCL set up eagerly and barriers use the right device.
    device_id = device.torch_device if device.kind == "cuda" else None
    if "MASTER_ADDR" not in os.environ:  # not launched by torchrun: a world of one, no port needed
        dist.init_process_group(device.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device_id)
        return
    dist.init_process_group(device.backend, timeout=timeout, device_id=device_id)


def broadcast_str(value: str, src: int = 0) -> str:
    """Rank ``src``'s string on every rank (e.g. the run directory, which embeds a timestamp)."""
    import torch.distributed as dist

    obj = [value]
    dist.broadcast_object_list(obj, src=src)
    return obj[0]


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
