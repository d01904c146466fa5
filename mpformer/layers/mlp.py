"""Feed-forward blocks: SwiGLU (Llama family) with one fused gate/up projection, or GELU (GPT-2).

Shape legend: s sequence, b micro-batch, h hidden, f ffn hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpformer.core.model_config import ModelConfig
from mpformer.core.shards import Shard
from mpformer.layers.linear import Linear, WeightGradStore, grad_sink, linear
from mpformer.layers.parallel import ColumnParallelLinear, RowParallelLinear, fused_shards, param_shards
from mpformer.parallel.device import DeviceLike
from mpformer.parallel.tensor_parallel import Part, TPContext


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate|up fused row-wise; GELU: down(gelu(up(x)))."""

    def __init__(self, cfg: ModelConfig, *, tp: TPContext | None = None, store: WeightGradStore | None = None,
                 device: DeviceLike = None, dtype: torch.dtype | None = None) -> None:
        """With ``tp``: gate|up column-parallel (each part split over tp), down row-parallel."""
        super().__init__()
        self.gated = cfg.gated_mlp
        self.ffn = cfg.ffn_size
        self.activation = cfg.activation
        kw = {"store": store, "device": device, "dtype": dtype}
        if tp is None:
            width = 2 * self.ffn if self.gated else self.ffn
            self.up = Linear(cfg.hidden_size, width, bias=cfg.mlp_bias, **kw)
            self.down = Linear(self.ffn, cfg.hidden_size, bias=cfg.mlp_bias, **kw)
        else:
            parts = [Part("gate", self.ffn), Part("up", self.ffn)] if self.gated else [Part("up", self.ffn)]
            self.up = ColumnParallelLinear(cfg.hidden_size, parts, tp, bias=cfg.mlp_bias, **kw)
            self.down = RowParallelLinear(self.ffn, cfg.hidden_size, tp, bias=cfg.mlp_bias, **kw)

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        # Single device only (parallel layers own their collectives), not when weight gradients are
        # deferred (the store accumulates into whole parameters, not row views), and not under ZeRO-3
        # (a gradient sink): its units are gathered and collected around each projection's own call.
        if self.gated and type(self.up) is Linear and self.up.store is None and grad_sink(self.up.weight) is None:
            # Two GEMMs on the row halves of the fused weight: storage stays fused (one parameter,
            # contiguous tensor-parallel slices); the two narrower GEMMs run faster on CPU (measured
            # in benchmarks/bench_throughput.py) and need no split/concat of the activations.
            w_gate, w_up = self.up.weight.chunk(2, dim=0)
            b_gate, b_up = self.up.bias.chunk(2, dim=0) if self.up.bias is not None else (None, None)
            return self.down(F.silu(linear(x_sbh, w_gate, b_gate)) * linear(x_sbh, w_up, b_up))
        up_sbf = self.up(x_sbh)
        if self.gated:
            gate_sbf, val_sbf = up_sbf.chunk(2, dim=-1)
            act_sbf = F.silu(gate_sbf) * val_sbf
        else:
            act_sbf = F.gelu(up_sbf, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down(act_sbf)

    def canonical_shards(self, prefix: str) -> dict[str, Shard]:
        """gate and up stored apart (so any tensor-parallel slice is contiguous), and down."""
        parts = ("gate", "up") if self.gated else ("up",)
        out = fused_shards(self.up, {n: f"{prefix}.{n}" for n in parts}, (self.ffn,) * len(parts))
        out.update(param_shards(f"{prefix}.down", self.down))
        return out
