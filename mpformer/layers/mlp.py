"""Feed-forward blocks: SwiGLU (Llama family) with one fused gate/up projection, or GELU (GPT-2).

Shape legend: s sequence, b micro-batch, h hidden, f ffn hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpformer.layers.linear import Linear
from mpformer.models.config import ModelConfig
from mpformer.parallel.device import DeviceLike


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up on the fused ``[..., 2f]`` projection output.

    Saves only that input (autograd would also keep silu(gate)) and writes d(gate) | d(up) straight
    into one buffer, so backward needs no concatenation of the two halves' gradients.
    """

    @staticmethod
    def forward(ctx, gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        ctx.save_for_backward(gu)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (gu,) = ctx.saved_tensors
        gate, up = gu.chunk(2, dim=-1)
        d_gu = torch.empty_like(gu)
        d_gate, d_up = d_gu.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        torch.mul(dy, gate * sig, out=d_up)
        torch.mul(dy * up, sig * (1 + gate * (1 - sig)), out=d_gate)  # silu'(g) = s(g) (1 + g (1 - s(g)))
        return d_gu


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gu)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate|up fused row-wise; GELU: down(gelu(up(x)))."""

    def __init__(self, cfg: ModelConfig, device: DeviceLike = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gated = cfg.gated_mlp
        self.ffn = cfg.ffn_size
        self.activation = cfg.activation
        width = 2 * self.ffn if self.gated else self.ffn
        self.up = Linear(cfg.hidden_size, width, bias=cfg.mlp_bias, device=device, dtype=dtype)
        self.down = Linear(self.ffn, cfg.hidden_size, bias=cfg.mlp_bias, device=device, dtype=dtype)

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        up_sbf = self.up(x_sbh)
        if self.gated:
            act_sbf = swiglu(up_sbf)
        else:
            act_sbf = F.gelu(up_sbf, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down(act_sbf)

    def canonical_tensors(self) -> dict[str, torch.Tensor]:
        """Layout-free views: gate and up stored apart so any tensor-parallel slice is contiguous."""
        out: dict[str, torch.Tensor] = {}
        if self.gated:
            gate, up = self.up.weight.split(self.ffn, dim=0)
            out["gate.weight"], out["up.weight"] = gate, up
            if self.up.bias is not None:
                gb, ub = self.up.bias.split(self.ffn, dim=0)
                out["gate.bias"], out["up.bias"] = gb, ub
        else:
            out["up.weight"] = self.up.weight
            if self.up.bias is not None:
                out["up.bias"] = self.up.bias
        out["down.weight"] = self.down.weight
        if self.down.bias is not None:
            out["down.bias"] = self.down.bias
        return out

