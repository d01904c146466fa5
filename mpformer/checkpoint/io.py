"""Layout-free checkpoints on torch.distributed.checkpoint (DCP).

Every tensor is stored under its canonical global name (Transformer.canonical_shards):
``model.<name>`` for weights and ``optim.<state>.<name>`` for per-parameter optimizer state, with
its global shape. DCP writes each rank's share and reads back exactly the slices a rank asks for,
so a later layout (TP, ZeRO) loads any checkpoint by asking for its own slices under the same names.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from mpformer.checkpoint.manifest import (
    Manifest,
    check_files,
    read_manifest,
    resolve_checkpoint_dir,
)
from mpformer.checkpoint.rows import canonical_rows, state_chunks
from mpformer.checkpoint.safe_metadata import SafeReader, read_checkpoint_metadata
from mpformer.checkpoint.shards import ShardLoadPlanner
from mpformer.core.buffers import Piece
from mpformer.core.errors import ConfigError
from mpformer.core.shards import Shard, stored_name

MODEL_PREFIX = "model."
# Non-parameter state a checkpoint keeps (Transformer.canonical_buffers: a router's selection bias).
BUFFER_PREFIX = "buffers."
OPTIM_PREFIX = "optim."


# ---- canonical views of parameters and of per-parameter state -------------------------------
def _owner(view: torch.Tensor, params: Iterable[nn.Parameter]) -> nn.Parameter | None:
    """The parameter ``view`` looks into, if it is one of ``params`` (frozen ones are not)."""
    ptr = view.untyped_storage().data_ptr()
    for p in params:
        if p.untyped_storage().data_ptr() == ptr:
            return p
    return None


def views_like(canonical: dict[str, torch.Tensor], params: list[nn.Parameter],
               per_param: Callable[[nn.Parameter], torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Apply each canonical view's slicing of its parameter to ``per_param(param)`` instead.

    Used for optimizer state: exp_avg of the fused QKV weight is cut into q, k, v exactly as the
    weight is. Both tensors must be contiguous with the parameter's shape.
    """
    out = {}
    for name, v in canonical.items():
        p = _owner(v, params)
        t = per_param(p) if p is not None else None
        if t is None:
            continue
        assert t.shape == p.shape and t.is_contiguous() and p.is_contiguous(), name
        offset = v.storage_offset() - p.storage_offset()
        out[name] = t.as_strided(v.shape, v.stride(), t.storage_offset() + offset)
    return out


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create zero Adam/AdamW state (as the first step would) so DCP can load into it in place."""
    for group in optimizer.param_groups:
        fused_or_capturable = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            st = optimizer.state[p]
            if st:
                continue
            st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused_or_capturable
                          else torch.tensor(0.0, dtype=torch.float32))
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The state each optimizer's first step creates, as zeros, so DCP can load into it in place:
    Adam's moments and step; SGD's momentum buffer (zeros then grad equals torch's clone of the first
    gradient, with dampening 0). Plain SGD keeps nothing."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        init_adam_state(optimizer)
    elif isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group["momentum"]:
                for p in group["params"]:
                    optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


def model_state(model: nn.Module) -> dict[str, Shard]:
    """model.<canonical name> -> this rank's shard of the weight."""
    return {MODEL_PREFIX + k: sh for k, sh in model.canonical_shards().items()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Shard]:
    """optim.<key>.<canonical name> -> this rank's block of the per-parameter state of an optimizer
    over the model's own (whole) parameters, through the same row map as ZeRO's shards (each
    parameter is one piece: exp_avg of the fused QKV weight is cut into q, k, v as the weight is);
    the step count once."""
    init_optimizer_state(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pieces = [(Piece(i, 0, p.numel(), 0), p) for i, p in enumerate(params)]
    out, step = state_chunks(canonical_rows(model, params), pieces, optimizer, OPTIM_PREFIX)
    out[OPTIM_PREFIX + "step"] = Shard.full(torch.tensor([step or 0.0]))
    return out


def set_optimizer_step(optimizer: torch.optim.Optimizer, step_tensor: torch.Tensor) -> None:
    """Every parameter's step count from the checkpoint's single one."""
    for g in optimizer.param_groups:
        for p in g["params"]:
            if "step" in optimizer.state[p]:
                optimizer.state[p]["step"].fill_(float(step_tensor.reshape(-1)[0]))


# ---- load / save -------------------------------------------------------------------------------
@contextlib.contextmanager
def quiet_dcp():
    """DCP warns that it 'assumes a single process' even when told so with no_dist=True."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        yield


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _dcp_load(state_dict: dict[str, torch.Tensor], ckpt_dir: str | Path, **kwargs: Any) -> None:
    """dcp.load through the reader that runs no code from ``.metadata``; a refusal of it surfaces as
    its own one-line ConfigError, not inside the CheckpointException DCP wraps it in."""
    reader = SafeReader(str(ckpt_dir))
    try:
        with quiet_dcp():
            dcp.load(state_dict, storage_reader=reader, **kwargs)
    except CheckpointException:
        if reader.refusal is not None:
            raise reader.refusal from None
        raise


def stored_metadata(ckpt_dir: str | Path) -> dict[str, Any]:
    """name -> (shape, dtype) of every tensor in a checkpoint, without loading any (nor running code
    from its ``.metadata``: every read of a checkpoint goes through safe_metadata.SafeReader)."""
    md = read_checkpoint_metadata(resolve_checkpoint_dir(ckpt_dir))
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if hasattr(v, "size")}


def load_tensors(ckpt_dir: str | Path, targets: dict[str, Shard]) -> None:
    """Fill each shard's ``local`` in place with its block of the stored tensor (dtype cast on copy)."""
    stored = stored_metadata(ckpt_dir)
    names = {k: stored_name(k, sh) for k, sh in targets.items()}
    missing = sorted({n for n in names.values() if n not in stored})
    if missing:
        raise ConfigError(f"checkpoint {ckpt_dir} lacks {len(missing)} tensors, first: {missing[0]}")
    bad = [(names[k], stored[names[k]][0], sh.global_shape) for k, sh in targets.items()
           if stored[names[k]][0] != tuple(sh.global_shape)]
    if bad:
        k, got, want = bad[0]
        raise ConfigError(f"checkpoint {ckpt_dir}: tensor {k} has shape {list(got)}, the model needs {list(want)}")
    _dcp_load({k: sh.local for k, sh in targets.items()}, ckpt_dir, planner=ShardLoadPlanner(targets),
              no_dist=_no_dist())


def read_all_tensors(ckpt_dir: str | Path, prefix: str = MODEL_PREFIX) -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` as a full CPU tensor in its stored dtype (single process)."""
    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    stored = stored_metadata(ckpt_dir)
    out = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in stored.items() if k.startswith(prefix)}
    if out:
        _dcp_load(out, ckpt_dir, no_dist=True)
    return {k[len(prefix):]: v for k, v in out.items()}


def open_checkpoint(ckpt_dir: str | Path) -> Manifest:
    """The manifest of a checkpoint whose files are all present and intact (``path``: its step dir)."""
    manifest = read_manifest(ckpt_dir)
    check_files(manifest)
    return manifest


def verify_checksums(manifest: Manifest) -> str | None:
    """Collective: every rank hashes its share of the checkpoint's files (every world-th file), so no rank
    reads them all while the others wait; the first mismatch any rank found (None: all intact), the
    same on every rank."""
    rank, world = (0, 1) if _no_dist() else (dist.get_rank(), dist.get_world_size())
    try:
        check_files(manifest, checksums=True, share=(rank, world))
        bad = None
    except ConfigError as e:
        bad = str(e)
    if world == 1:
        return bad
    found: list[str | None] = [None] * world
    dist.all_gather_object(found, bad)
    return next((b for b in found if b is not None), None)


def load_checkpoint(ckpt_dir: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Manifest:
    """Load weights (and optimizer state if the checkpoint has it); returns the manifest, with
    ``loaded_optimizer`` saying which."""
    manifest = open_checkpoint(ckpt_dir)
    load_tensors(manifest.path, model_state(model))
    buffers = getattr(model, "canonical_buffers", dict)()
    stored = stored_metadata(manifest.path)
    # where the checkpoint has them (a converted HF file does; an older or dense one starts them at 0)
    targets = {BUFFER_PREFIX + k: sh for k, sh in buffers.items() if BUFFER_PREFIX + k in stored}
    if targets:
        load_tensors(manifest.path, targets)
    loaded = optimizer is not None and manifest.has_optimizer
    if loaded:
        targets = optimizer_state(model, optimizer)
        load_tensors(manifest.path, targets)
        set_optimizer_step(optimizer, targets[OPTIM_PREFIX + "step"].local)
    return manifest.with_entries(loaded_optimizer=loaded)
