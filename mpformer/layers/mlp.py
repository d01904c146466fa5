"""Feed-forward blocks: SwiGLU (Llama family) with one fused gate/up projection, or GELU (GPT-2).

Shape legend: s sequence, b micro-batch, h hidden, f ffn hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpformer.core.layer_spec import DEFAULT_LINEAR, LinearKind, resolve
from mpformer.core.model_config import ModelConfig
from mpformer.core.shards import Shard
from mpformer.layers.linear import WeightGradStore
from mpformer.layers.parallel import fused_shards, param_shards
from mpformer.parallel.device import DeviceLike
from mpformer.parallel.tensor_parallel import Part, TPContext


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate|up fused row-wise; GELU: down(gelu(up(x)))."""

    def __init__(self, cfg: ModelConfig, *, tp: TPContext | None = None, store: WeightGradStore | None = None,
                 linear: LinearKind = DEFAULT_LINEAR, device: DeviceLike = None,
                 dtype: torch.dtype | None = None) -> None:
        """With ``tp``: gate|up column-parallel (each part split over tp), down row-parallel; the
        layers of the ``linear`` kind (core/layer_spec.py)."""
        super().__init__()
        self.gated = cfg.gated_mlp
        self.ffn = cfg.ffn_size
        self.activation = cfg.activation
        kw = {"store": store, "device": device, "dtype": dtype}
        if tp is None:
            width = 2 * self.ffn if self.gated else self.ffn
            plain = resolve(linear.plain)
            self.up = plain(cfg.hidden_size, width, bias=cfg.mlp_bias, **kw)
            self.down = plain(self.ffn, cfg.hidden_size, bias=cfg.mlp_bias, **kw)
        else:
            parts = [Part("gate", self.ffn), Part("up", self.ffn)] if self.gated else [Part("up", self.ffn)]
            self.up = resolve(linear.column)(cfg.hidden_size, parts, tp, bias=cfg.mlp_bias, **kw)
            self.down = resolve(linear.row)(self.ffn, cfg.hidden_size, tp, bias=cfg.mlp_bias, **kw)

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        if self.gated:  # gate and up as the linear kind computes a fused projection's parts
            gate_sbf, val_sbf = self.up.forward_parts(x_sbh, 2)
            act_sbf = F.silu(gate_sbf) * val_sbf
        else:
            up_sbf = self.up(x_sbh)
            act_sbf = F.gelu(up_sbf, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down(act_sbf)

    def parts(self) -> list[tuple[str, list[nn.Module]]]:
        """Parameter-holding submodules in forward order, as ZeRO-3 gathers them (the block adds the norm)."""
        return [("mlp_in", [self.up]), ("mlp_out", [self.down])]

    def canonical_shards(self, prefix: str) -> dict[str, Shard]:
        """gate and up stored apart (so any tensor-parallel slice is contiguous), and down."""
        parts = ("gate", "up") if self.gated else ("up",)
        out = fused_shards(self.up, {n: f"{prefix}.{n}" for n in parts}, (self.ffn,) * len(parts))
        out.update(param_shards(f"{prefix}.down", self.down))
        return out
