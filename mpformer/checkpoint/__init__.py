"""Layout-free checkpoints. io (torch.distributed.checkpoint) is imported lazily: the pure manifest
checks run before torch is even loaded, which keeps bad-input exits fast."""

from typing import Any

from mpformer.checkpoint.manifest import read_manifest, resolve_checkpoint_dir

__all__ = ["load_checkpoint", "read_all_tensors", "read_manifest", "resolve_checkpoint_dir", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    if name in ("load_checkpoint", "read_all_tensors", "save_checkpoint"):
        from mpformer.checkpoint import io

        return getattr(io, name)
    raise AttributeError(name)
