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
    if "MASTER_ADDR" not in os.environ:  # not launched by torchrun: a world of one
        from mpformer.testing.spawn import free_port

        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                           "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    device.activate()
    dist.init_process_group(device.backend, timeout=datetime.timedelta(seconds=timeout_s))


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
