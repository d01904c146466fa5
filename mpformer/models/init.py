"""Blocked initialisation: any block of a canonical tensor, drawn without drawing the whole tensor.

Every canonical tensor (models/transformer.py's layout-free names) of global shape ``[R, C]`` (a
vector: ``[R, 1]``) is cut into row blocks of ``max(1, BLOCK_ELEMENTS // C)`` rows. Block ``i`` is
drawn whole, as one ``[rows_i, C]`` fp32 tensor, from its own generator seeded by (seed, name, i).
A rank that holds rows ``[a, b)`` and columns ``[c, d)`` of the tensor (a tensor-parallel slice, a
ZeRO-3 shard's rectangle, a pipeline stage's layers) draws only the blocks that meet rows ``[a, b)``,
one at a time, and keeps columns ``[c, d)``: its transient is one block (at most BLOCK_ELEMENTS
elements, or one row when a row is longer), and its values are bit for bit those of the
single-device model, which draws every block the same way. (A block is never drawn in part: CPU
``normal_`` fills 16 values at a time, so a part drawn alone would not equal the same part of the
whole draw.)

    canonical tensor                 value
    *.bias                           0
    *norm*.weight                    1
    layers.*.attn.o, layers.*.mlp.down   N(0, init_std / sqrt(2 num_layers))   (Megatron's scaled output init)
    every other weight               N(0, init_std)
    vocabulary padding rows          0 (no canonical tensor covers them; parameters start at zero)

``materialise`` turns a module built on the meta device into this rank's real parameters: it
allocates only what the module holds (its tensor-parallel blocks and pipeline stage), re-creates the
non-parameter buffers and fills every block. The gradient engine fills its flat buffers with the same
``ModelInit`` directly (optim/materialise.py), so a ZeRO-3 rank draws only its shard.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpformer.core.layer_spec import attention_kind, mlp_kind
from mpformer.core.model_config import ModelConfig
from mpformer.core.shards import Shard, stored_name
from mpformer.parallel.device import DeviceLike

BLOCK_ELEMENTS = 1 << 20  # 4 MiB of fp32: the most one rank draws beyond what it keeps


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of block ``block`` of canonical tensor ``name`` (a stable 63-bit hash)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rows_per_block(global_shape: Sequence[int]) -> int:
    row = math.prod(global_shape[1:]) if len(global_shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


@dataclass(frozen=True)
class ModelInit:
    """Megatron-style initial values of a model's canonical tensors, block by block."""

    cfg: ModelConfig
    seed: int

    def std(self, name: str) -> float | None:
        """The normal's std of a weight; None for the constants (biases 0, norm gains 1)."""
        if name.endswith(".bias") or "norm" in name:
            return None
        std = self.cfg.init_std
        out = any(fnmatch.fnmatchcase(name, p) for p in self._out_projections)
        return std / math.sqrt(2.0 * self.cfg.num_layers) if out else std

    @property
    def _out_projections(self) -> tuple[str, ...]:
        """Patterns of the weights fed back into the residual stream, as the block's kinds name them
        (dense: attn.o, mlp.down; experts: mlp.experts.*.down)."""
        kinds = [("attn", attention_kind(self.cfg.attention_kind))]
        kinds += [("mlp", mlp_kind(k)) for k in sorted(set(self.cfg.layer_kinds()))]
        return tuple(f"*.{prefix}.{p}.weight" for prefix, kind in kinds for p in kind.out_projections)

    @torch.no_grad()
    def fill(self, out: torch.Tensor, name: str, global_shape: Sequence[int], offsets: Sequence[int]) -> None:
        """Write the block of ``name`` (a tensor of ``global_shape``) that starts at ``offsets`` and has
        ``out``'s shape into ``out`` (any dtype: drawn in fp32, then cast)."""
        assert out.dim() == len(global_shape) <= 2, (name, tuple(out.shape), tuple(global_shape))
        if out.is_meta:  # a rehearsal's data-free tensor: nothing to draw
            return
        std = self.std(name)
        if std is None:
            out.fill_(0.0 if name.endswith(".bias") else 1.0)
            return
        if out.numel() == 0:
            return
        a, b = offsets[0], offsets[0] + out.shape[0]
        c, d = (offsets[1], offsets[1] + out.shape[1]) if out.dim() == 2 else (0, 1)
        row, k = (global_shape[1] if len(global_shape) == 2 else 1), rows_per_block(global_shape)
        out2 = out if out.dim() == 2 else out.unsqueeze(1)
        for i in range(a // k, (b - 1) // k + 1):  # the blocks that meet rows [a, b)
            r0, r1 = i * k, min((i + 1) * k, global_shape[0])
            g = torch.Generator().manual_seed(block_seed(self.seed, name, i))
            blk = torch.empty(r1 - r0, row, dtype=torch.float32).normal_(0.0, std, generator=g)
            lo, hi = max(a, r0), min(b, r1)
            out2[lo - a:hi - a].copy_(blk[lo - r0:hi - r0, c:d])

    def fill_shard(self, key: str, sh: Shard) -> None:
        """``sh.local`` is its block of the canonical tensor named by ``key`` (or ``sh.name``)."""
        self.fill(sh.local, stored_name(key, sh), sh.global_shape, sh.offsets)


@torch.no_grad()
def init_weights(model: nn.Module, init: ModelInit) -> None:
    """Every parameter of a materialised model from ``init``: zeros first (vocabulary padding rows
    are no canonical tensor's block and stay 0), then each canonical block."""
    for p in model.parameters():
        p.zero_()
    for key, sh in model.canonical_shards().items():
        init.fill_shard(key, sh)


def materialise_buffers(model: nn.Module, device: DeviceLike) -> None:
    """The non-parameter buffers of a meta-built module, re-created on ``device`` (each module that
    holds one computes it in ``reset_buffers``); none may be left on meta unless ``device`` is meta (a
    rehearsal)."""
    for m in model.modules():
        reset = getattr(m, "reset_buffers", None)
        if reset is not None:
            reset(device)
    left = [n for n, b in model.named_buffers() if b.is_meta and torch.device(device).type != "meta"]
    assert not left, f"buffers left on the meta device (give their module a reset_buffers): {left}"


def materialise(model: nn.Module, device: DeviceLike, init: ModelInit | None) -> nn.Module:
    """A meta-built module's parameters allocated on ``device`` (only the blocks it holds) and filled
    from ``init`` (None: left uninitialised, e.g. for a checkpoint to fill), its buffers re-created."""
    model.to_empty(device=device)
    materialise_buffers(model, device)
    if init is not None:
        init_weights(model, init)
    return model
