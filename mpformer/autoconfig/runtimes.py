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
    buckets      how many collectives reduce the gradients (``Runtime.buckets``): DDP-style MiB,
                 Megatron-Core's max(4e7, 1e6 dp) parameters, one buffer, DeepSpeed's 5e8 elements
    block        what a layer keeps for backward: PyTorch autograd's (mpformer, torchtitan) or
                 Megatron's block (layer_memory.py)
    capabilities the schedules and ZeRO stages the software had, for the fields a published run leaves
                 to the search (a 2021 Megatron-LM run is never given a zero-bubble schedule)

    mpformer     ZeRO-3 units (optim/units.py, gather.py): the embedding, the head, and each layer's
                 parts (attention norm + qkv, output projection, MLP norm + up, down) merged up to
                 ``unit_numel`` elements; the next unit in use order prefetched when it has at most
                 ``prefetch_numel`` (``parts_gathered``); a fully recomputed layer gathered again unit by
                 unit in its recomputed forward. Each unit's gradients formed in a buffer in the parameter
                 dtype (its projections' weight gradients straight into it), taken once the reductions in
                 flight and it hold at most ``reduce_numel`` elements (walked by step_memory.py); 16 bytes
                 per parameter of shards over N_d (fp32 masters, gradients, Adam's moments)
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

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

from mpformer.core.buffers import ZERO3_PREFETCH_NUMEL, ZERO3_REDUCE_NUMEL, ZERO3_UNIT_NUMEL
from mpformer.core.config import TrainConfig
from mpformer.core.fp8_config import Fp8Options


@dataclass(frozen=True)
class Runtime:
    name: str
    # "parts": mpformer's units of a layer's parts; "layer": whole layers with the next prefetched (FSDP2);
    # "module": each submodule gathered as it runs (DeepSpeed)
    units: str = "parts"
    unit_numel: float = ZERO3_UNIT_NUMEL  # mpformer: train.zero3_unit_numel (core/buffers.py)
    prefetch_numel: float = ZERO3_PREFETCH_NUMEL  # mpformer: train.zero3_prefetch_numel
    reduce_numel: float = ZERO3_REDUCE_NUMEL  # mpformer: train.zero3_reduce_numel
    reduce_bytes: int | None = None  # of the gradient collective; None: the parameter dtype
    pooled: bool = True  # mpformer's gradient pool (walked by step_memory.py); else ``zero3_extras``
    max_live: float = 0.0  # DeepSpeed: elements gathered before it releases
    prefetch_bucket: float = 0.0  # DeepSpeed: elements prefetched
    reduce_bucket: float = 0.0  # DeepSpeed: elements of its reduce bucket
    shard_bytes: tuple[int, int, int, int] | None = None  # ZeRO-3 (w, g, m, k); None: mpformer's engine
    block: str = "mpformer"  # what a layer keeps for backward: "mpformer" (PyTorch's autograd: layer_memory.py
    # layer_bytes) or "megatron" (Megatron's block: megatron_layer_bytes; Megatron-DeepSpeed runs it too)
    selective: str = "attention"  # recompute=selective: "attention" (Korthikanti; mpformer) or "op" (torchtitan)
    post_validation: bool = False  # train.post_validation: a copy of the optimizer's shard during the step
    overlap_validation: bool = False  # train.overlap_validation: that copy and the gradients', through the next step
    kernels: str = "eager"  # elementwise ops: fused | eager | composite (kernels.py)
    tf32: bool = False  # fp32 GEMMs at the device's TF32 rate (mpformer: train.tf32, on by default)
    overlap_grad_reduce: bool = True  # buckets reduced during the backward
    overlap_p2p: bool = True  # False: each send/receive group blocks its rank until it completes
    tp_comm_overlap: bool = False  # tensor-parallel collectives chunked into the adjacent GEMMs
    # Each tensor-parallel rank sends 1/t of a stage boundary even without sequence parallelism (Megatron-LM's
    # scatter/gather optimisation, Narayanan et al. 2021 section 4.1; mpformer sends the whole boundary then)
    p2p_split: bool = False
    # What the software could run, for the fields a published run leaves to the search: its pipeline
    # schedules and ZeRO stages (None: every one mpformer has). A pinned field is taken as published.
    schedules: tuple[str, ...] | None = None
    zero_stages: tuple[int, ...] | None = None
    # Gradient buckets (each one collective): of ``bucket_mb`` MiB of reduced gradients (mpformer:
    # train.grad_bucket_mb; torch DDP's default is the same 25), inf for one collective over every
    # gradient; or of ``bucket_numel`` = (a, b): max(a, b * dp) parameters (Megatron-Core's default).
    bucket_mb: float = 25.0
    bucket_numel: tuple[float, float] | None = None
    # train.fp8 (read under precision fp8 only, autoconfig/fp8_terms.py): the recipe, its amax window and
    # the layers kept in bf16
    fp8: Fp8Options = field(default_factory=Fp8Options)

    def buckets(self, params: float, reduce_bytes: int, dp: int) -> int:
        """How many collectives reduce ``params`` gradients of ``reduce_bytes`` over ``dp`` ranks."""
        if self.bucket_numel is not None:
            return max(1, math.ceil(params / max(self.bucket_numel[0], self.bucket_numel[1] * dp)))
        return max(1, math.ceil(params * reduce_bytes / (self.bucket_mb * 2**20)))


MPFORMER = Runtime("mpformer", tf32=True)
TORCHTITAN = Runtime("torchtitan", units="layer", reduce_bytes=4, pooled=False, shard_bytes=(0, 4, 4, 8),
                     selective="op", kernels="composite")  # December 2024's eager torch; compiled: fused
DEEPSPEED = Runtime("deepspeed", block="megatron", units="module", pooled=False, max_live=1e9, prefetch_bucket=5e7,
                    reduce_bucket=5e8, shard_bytes=(2, 2, 4, 8), kernels="fused", overlap_grad_reduce=False,
                    overlap_p2p=False, schedules=("1f1b",), bucket_numel=(5e8, 0.0))
# (Megatron-LM's fused kernels, its 1F1B pipeline engine; reduce_bucket_size 5e8 elements)
# Megatron-LM (2021-2023) and Megatron-Core (2024) ran 1F1B and its interleaved form (no zero-bubble
# schedule), and ZeRO no further than stage 1 (--use-distributed-optimizer; Megatron-Core's FSDP came later).
# Without --overlap-grad-reduce Megatron reduces its contiguous gradient buffer in one collective; with
# it, in buckets of max(4e7, 1e6 dp) parameters (DistributedDataParallelConfig.bucket_size: "larger DP
# sizes need larger buckets to ensure collectives do not become latency-bound").
_MEGATRON_SCHEDULES = ("1f1b", "interleaved")
# Megatron-LM as the published runs used it: before --overlap-grad-reduce and p2p overlap (2021-2023),
# and Megatron-Core with Transformer Engine and every overlap on (its 2024 weak-scaling table).
MEGATRON = Runtime("megatron-lm", block="megatron", kernels="fused", overlap_grad_reduce=False, overlap_p2p=False,
                   p2p_split=True, schedules=_MEGATRON_SCHEDULES, zero_stages=(0, 1), bucket_mb=math.inf)
MEGATRON_CORE = Runtime("megatron-core", block="megatron", kernels="fused", tp_comm_overlap=True,
                        schedules=_MEGATRON_SCHEDULES, zero_stages=(0, 1), bucket_numel=(4e7, 1e6))


def mpformer_runtime(t: TrainConfig) -> Runtime:
    """mpformer's runtime as a training config sets it up (its train.zero3_* settings)."""
    return replace(MPFORMER, unit_numel=t.zero3_unit_numel, prefetch_numel=t.zero3_prefetch_numel,
                   reduce_numel=t.zero3_reduce_numel, bucket_mb=t.grad_bucket_mb, post_validation=t.post_validation,
                   overlap_validation=t.overlap_validation, tf32=t.tf32, fp8=Fp8Options.from_config(t.fp8))


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
    return (head if rt.units != "module" else min(head, max(rt.max_live, biggest))) * wb


def parts_gathered(sizes: Sequence[float], reads: Sequence[bool], layers: Sequence[Hashable | None],
                   recomputed: Sequence[bool], prefetch: float, nbytes: Sequence[float] | None = None) -> list[float]:
    """mpformer's ZeRO-3 (optim/gather.py): per unit in backward order (head, each layer's units from its
    last, the embedding), the elements gathered while its backward runs. The units are used in this
    order: the head; per layer, if fully recomputed its units in forward order (the recomputed forward),
    then its units in backward order; the embedding's backward reads none. At each use the unit is
    gathered, and the next distinct unit used if it has at most ``prefetch`` elements. A recomputed
    layer's forward happens at the point of its first unit in backward (the activations walked there
    include the recomputed ones), so that point takes the largest of those uses too. ``layers``: the
    layer each unit belongs to (None: the head, the embedding). ``nbytes``: each unit's gathered bytes
    (fp8: its float8 weights at 1 byte an element); then the result is in bytes, not elements."""
    uses: list[tuple[int, int]] = []  # (unit, the walk point it falls at)
    k, n = 0, len(sizes)
    while k < n:
        if layers[k] is None:
            uses += [(k, k)] if reads[k] else []
            k += 1
            continue
        end = k
        while end < n and layers[end] == layers[k]:
            end += 1
        if recomputed[k]:
            uses += [(q, k) for q in reversed(range(k, end))]
        uses += [(q, q) for q in range(k, end)]
        k = end
    out = [0.0] * n
    for t, (q, point) in enumerate(uses):
        nxt = next((u for u, _ in uses[t + 1:] if u != q), None)
        held = sizes if nbytes is None else nbytes
        ahead = held[nxt] if nxt is not None and sizes[nxt] <= prefetch else 0.0
        out[point] = max(out[point], held[q] + ahead)
    return out
