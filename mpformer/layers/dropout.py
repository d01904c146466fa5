"""Dropout through torch's fused kernel on every device.

``F.dropout`` takes the fused kernel (``aten.native_dropout``: a 1-byte mask kept for backward) only
for CUDA tensors; elsewhere, a meta tensor included, it draws a mask in the input's dtype and
multiplies, and autograd keeps that mask: 2 bytes an element in bf16, 4 in fp32. Calling the fused op
directly keeps the 1-byte mask a GPU keeps (Korthikanti et al.'s count) on the CPU too, so the code the
tests and the rehearsal run is the code a GPU runs.
"""

from __future__ import annotations

import torch
from torch import nn


class Dropout(nn.Dropout):
    """nn.Dropout (same ``p``, same module tree) computed by ``torch.native_dropout``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:  # the fused op's scale is 1 / (1 - p)
            return x * 0.0
        return torch.native_dropout(x, self.p, True)[0]
