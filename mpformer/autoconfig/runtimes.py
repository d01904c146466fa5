"""Whose software runs a plan: mpformer's own, or another framework's for the published runs.

The auto-configurator models mpformer's runtime (``Workload.runtime`` defaults to MPFORMER). The
published runs it is checked against ran on other frameworks, which keep other things live (memory.py,
tests/unit/test_memory_published.py) and run or overlap other kernels (cost.py, kernels.py):

    kernels      how elementwise ops run: "fused" (Megatron-LM's / Transformer Engine's fused norm,
                 bias-GeLU, SwiGLU, rotary, bias-dropout-add kernels, or torch.compile), "eager"
                 (PyTorch op by op with torch's fused norm kernels: mpformer), "composite" (RMSNorm as
                 elementwise ops too: torch before its fused rms_norm, Hugging Face's LlamaRMSNorm)
    overlaps     gradient reduction during backward (Megatron-LM only since --overlap-grad-reduce,
                 September 2023), pipeline send/receive without blocking the rank (MegaScale lists it
                 among its additions to Megatron-LM), tensor-parallel collectives hidden in GEMMs
                 (Transformer Engine's --tp-comm-overlap)

    mpformer     ZeRO-3 units: the embedding, each layer, the head, gathered whole with the next one
                 prefetched (optim/gather.py); each unit's gradients collected in the parameter dtype
                 from a pool, MAX_IN_FLIGHT reducing beside the one filling (walked by step_memory.py);
                 16 bytes per parameter of shards over N_d (fp32 masters, gradients, Adam's moments)
    torchtitan   FSDP2: the same units and prefetch; autograd's gradients of a unit copied into an fp32
                 reduce-scatter input (torchtitan's default mixed_precision_reduce=float32), the
                 previous unit's held until the next is issued; 16 bytes of shards (fp32 parameters,
                 gradients, Adam). Its selective recompute is op-level (torchtitan's SAC: the outputs
                 of the matmuls, every second one recomputed, and of the attention kernel)
    deepspeed    ZeRO-3 gathers each submodule as it runs, releasing once stage3_max_live_parameters
                 elements are gathered (default 1e9) and prefetching up to stage3_prefetch_bucket_size
                 (5e7); a submodule's gradient is copied into a reduce bucket (reduce_bucket_size 5e8
                 elements, in the parameter dtype; one counted); the ZeRO paper's 2 + 2 + 12 bytes of
                 16-bit parameter and gradient partitions, fp32 masters and Adam over N_d
"""

from __future__ import annotations

from dataclasses import dataclass

from mpformer.optim.engine import MAX_IN_FLIGHT


@dataclass(frozen=True)
class Runtime:
    name: str
    units: str = "layer"  # "layer": whole units with the next prefetched; "module": each submodule as it runs
    in_flight: int = MAX_IN_FLIGHT  # unit reductions in flight beside the one filling (mpformer's pool)
    reduce_bytes: int | None = None  # of the gradient collective; None: the parameter dtype
    pooled: bool = True  # mpformer's gradient pool (walked by step_memory.py); else ``zero3_extras``
    max_live: float = 0.0  # DeepSpeed: elements gathered before it releases
    prefetch_bucket: float = 0.0  # DeepSpeed: elements prefetched
    reduce_bucket: float = 0.0  # DeepSpeed: elements of its reduce bucket
    shard_bytes: tuple[int, int, int, int] | None = None  # ZeRO-3 (w, g, m, k); None: mpformer's engine
    selective: str = "attention"  # recompute=selective: "attention" (Korthikanti; mpformer) or "op" (torchtitan)
    kernels: str = "eager"  # elementwise ops: fused | eager | composite (kernels.py)
    overlap_grad_reduce: bool = True  # buckets reduced during the backward
    overlap_p2p: bool = True  # False: each send/receive group blocks its rank until it completes
    tp_comm_overlap: bool = False  # tensor-parallel collectives chunked into the adjacent GEMMs


MPFORMER = Runtime("mpformer")
TORCHTITAN = Runtime("torchtitan", in_flight=1, reduce_bytes=4, pooled=False, shard_bytes=(0, 4, 4, 8),
                     selective="op", kernels="composite")  # December 2024's eager torch; compiled: fused
DEEPSPEED = Runtime("deepspeed", units="module", in_flight=1, pooled=False, max_live=1e9, prefetch_bucket=5e7,
                    reduce_bucket=5e8, shard_bytes=(2, 2, 4, 8), kernels="fused", overlap_grad_reduce=False,
                    overlap_p2p=False)  # with Megatron-LM's fused kernels and its pipeline engine (2021-2022)
# Megatron-LM as the published runs used it: before --overlap-grad-reduce and p2p overlap (2021-2023),
# and Megatron-Core with Transformer Engine and every overlap on (its 2024 weak-scaling table).
MEGATRON = Runtime("megatron-lm", kernels="fused", overlap_grad_reduce=False, overlap_p2p=False)
MEGATRON_CORE = Runtime("megatron-core", kernels="fused", tp_comm_overlap=True)


def zero3_extras(rt: Runtime, sizes: list[float], biggest: list[float], reads: list[bool], wb: int,
                 dp: int) -> list[float]:
    """Per unit (backward order: head, layers, embedding): the bytes a ZeRO-3 runtime holds while that
    unit's backward runs: what is gathered (the unit, or its submodules up to ``max_live``, and what is
    prefetched: the next unit whose backward reads weights) and, for a runtime not walked by
    step_memory.py, its gradient buffers. ``biggest``: each unit's largest parameter (a submodule's)."""
    out = []
    for k, p in enumerate(sizes):
        nxt = sizes[k + 1] if k + 1 < len(sizes) and reads[k + 1] else 0.0
        mine = p if reads[k] else 0.0
        if rt.units == "layer":
            gathered = mine + nxt
        else:
            gathered = min(mine, max(rt.max_live, biggest[k])) + min(rt.prefetch_bucket, nxt)
        grads = 0.0
        rb = rt.reduce_bytes or wb
        if not rt.pooled and rt.units == "layer":  # autograd's gradients, this unit's and the previous input
            grads = p * wb + (p + (sizes[k - 1] if k else 0.0)) * rb * (1 + 1 / dp)
        elif not rt.pooled:  # a submodule's gradient before its copy, the reduce bucket
            grads = biggest[k] * wb + min(rt.reduce_bucket, sum(sizes)) * rb
        out.append(gathered * wb + grads)
    return out


def gathered_at_head(rt: Runtime, head: float, biggest: float, wb: int) -> float:
    """What a ZeRO-3 runtime has gathered while the head runs forward (bytes)."""
    return (head if rt.units == "layer" else min(head, max(rt.max_live, biggest))) * wb
