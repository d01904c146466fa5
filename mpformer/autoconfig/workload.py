"""What one training step computes, as the memory and cost models take it (kept apart from memory.py so
the modules memory.py is built from can read it without importing their parent)."""

from __future__ import annotations

from dataclasses import dataclass

from mpformer.autoconfig.runtimes import MPFORMER, Runtime


@dataclass(frozen=True)
class Workload:
    """What one step computes: the global batch, the sequence, the precision."""

    global_batch_size: int
    micro_batch_size: int
    seq_length: int
    precision: str = "bf16"
    flash_attention: bool = True  # False: attention scores materialised (Megatron before FlashAttention)
    fused_cross_entropy: bool = True  # train.fused_cross_entropy (layers/fused_cross_entropy.py)
    cross_entropy_chunk: int = 1024  # train.cross_entropy_chunk: tokens per chunk of the fused head
    runtime: Runtime = MPFORMER  # whose software runs it (runtimes.py): mpformer's, or a published run's
