"""Ops that wait for the device: what a hot path on CUDA must not run, found on CPU.

A CUDA kernel launch returns at once, and the host runs ahead; an op whose output shape or value the
host needs (a boolean index, ``nonzero``, ``.item()``, ``masked_select``) waits for every kernel before
it. ``HostSyncs`` is a dispatch mode that records such ops wherever they run, so a CPU test can prove a
path free of them (a rehearsal reports them, rehearsal/probe.py): ``with HostSyncs() as s: ...`` then
``s.ops`` (empty: none).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# The record_function name of a step's one reporting boundary: the host reads of the step check (the
# global norm, the loss, the stop flag) and fp16's overflow flag (training/overlap.py, optim/stepping.py).
# A rehearsal (rehearsal/probe.py) counts a host sync inside it as the boundary's, any other as a defect.
REPORT_BOUNDARY = "mpformer.step_report"

# Each needs a device value on the host: its output's size (nonzero, masked_select, unique, a boolean
# index, which dispatches to nonzero) or a scalar (item, tolist and bool(tensor) call _local_scalar_dense).
SYNC_OPS = {_aten.nonzero.default, _aten.masked_select.default, _aten._local_scalar_dense.default,
            _aten._unique2.default, _aten.unique_consecutive.default, _aten.repeat_interleave.Tensor}


# Indexing ops, a sync when an index is a boolean mask (its true count decides the output's shape).
INDEX_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def is_sync(func: object, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether the op ``func`` called with ``args`` and ``kwargs`` needs a device value on the host."""
    if func is _aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is not None:
        return False  # the output's size given by the host: no read (layers/moe_dispatch.py's regroup)
    return func in SYNC_OPS or (func in INDEX_OPS and _bool_index(args))


class HostSyncs(TorchDispatchMode):
    """Records the ops of SYNC_OPS, and boolean-mask indexing, run inside it (``ops``: their names)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        if is_sync(func, args, kwargs):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
