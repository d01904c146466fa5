"""The kernels of a layer, of the head and of the embedding timed on the device, with their caches:
kernels.py lists a pass's kernels (work, launches), compute.py times them; cost.py adds the
collectives, recompute and the pipeline. The search asks for the same few thousand shapes again and
again, so each is computed once per (model, the layout fields the kernels read, micro-batch, cluster,
profile)."""

from __future__ import annotations

from dataclasses import replace

from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.compute import LayerTimes, layer_times_from, matmul_dtype, measured_attention, pass_time
from mpformer.autoconfig.kernels import attention_kernel, dims, embedding_work, head_work, layer_work
from mpformer.autoconfig.memory import Workload
from mpformer.core.fp8_config import compute_precision
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig


def layer_compute(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, kind: str | None = None) -> LayerTimes:
    """The layer's kernels (kernels.py) timed on the device (compute.py), without recompute; ``kind``: its
    MLP kind (default the model's)."""
    key = (repr(m), _compute_key(L), _work_key(w), _cluster_key(c), id(c.measured), kind)
    hit = _LAYER_CACHE.get(key)
    if hit is None or hit[0] is not c.measured:
        hit = _LAYER_CACHE[key] = (c.measured, _layer_compute(m, key[1], key[2], c, kind))
    return hit[1]


def _compute_key(L: ParallelLayout) -> ParallelLayout:
    """The layout fields a layer's kernels depend on (the rest would only split the cache)."""
    return ParallelLayout(tp=L.tp, cp=L.cp, sequence_parallel=L.sequence_parallel, ep=L.ep, etp=L.etp)


def _work_key(w: Workload) -> Workload:
    return replace(w, global_batch_size=w.micro_batch_size)


# Layer and edge times by (model repr, compute layout, micro-batch workload, cluster, profile identity):
# ``measured`` is not part of a cluster's equality, and the entry holds the profile, so its id is not
# reused while the entry lives. The search asks for the same few thousand shapes again and again.
_LAYER_CACHE: dict[tuple, tuple[dict, LayerTimes]] = {}
_EDGE_CACHE: dict[tuple, tuple[dict, tuple[float, float, float]]] = {}


def _cluster_key(c: Cluster) -> str:
    return repr(replace(c, measured={}))


def fused_attention(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster) -> bool:
    """Whether the runtime's attention core is a fused kernel on this device (kernels.attention_kernel)."""
    return attention_kernel(m, L, w.seq_length, w.runtime.name, w.flash_attention, c.cores is not None,
                            w.precision) != "math"


def _layer_compute(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, kind: str | None = None) -> LayerTimes:
    # fp8: the device's bf16 rates outside the float8 GEMMs, which carry their own dtype (kernels.Gemm)
    dt, flash = compute_precision(w.precision), fused_attention(m, L, w, c)
    work = layer_work(m, L, w.seq_length, w.micro_batch_size, w.precision, w.runtime.kernels, flash, kind=kind,
                      fp8=w.runtime.fp8)
    x = dims(m, L, w.seq_length, w.micro_batch_size)
    measured = measured_attention(c, dt, x["s"], x["s_k"], x["d"], x["b"] * x["heads"]) if flash else None
    return layer_times_from(c, dt, work, measured, matmul_dtype(c, dt, w.runtime.tf32))


def head_times(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster) -> tuple[float, float, float]:
    """The last stage's final norm, LM head and cross entropy: (F, BI, BW) seconds per micro-batch."""
    return _edge_times(m, L, w, c, True)


def embedding_times(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster) -> tuple[float, float, float]:
    """The first stage's embedding lookup and its gradient: (F, BI, BW) seconds per micro-batch."""
    return _edge_times(m, L, w, c, False)


def _edge_times(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, head: bool) -> tuple[float, float, float]:
    key = (repr(m), _compute_key(L), _work_key(w), _cluster_key(c), id(c.measured), head)
    hit = _EDGE_CACHE.get(key)
    if hit is None or hit[0] is not c.measured:
        hit = _EDGE_CACHE[key] = (c.measured, _edge_compute(m, key[1], key[2], c, head))
    return hit[1]


def _edge_compute(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, head: bool) -> tuple[float, float, float]:
    dt = compute_precision(w.precision)  # the head and the embedding stay bf16 under fp8
    work = (head_work(m, L, w.seq_length, w.micro_batch_size, dt, w.runtime.kernels, w.fused_cross_entropy) if head
            else embedding_work(m, L, w.seq_length, w.micro_batch_size, dt))
    mm = matmul_dtype(c, dt, w.runtime.tf32)
    f, bi, bw_ = (pass_time(c, dt, p, backward=k > 0, gemm_dtype=mm).total
                  for k, p in enumerate((work.f, work.bi, work.bw)))
    return f, bi, bw_


_PARTS = ("layers", "head", "embedding")


def kernel_launches(m: ModelConfig, L: ParallelLayout, w: Workload, part: str) -> tuple[int, int, int]:
    """Kernels one micro-batch launches in one layer (``part="layers"``), the head or the embedding:
    forward, input gradients (with what recompute reruns), weight gradients; kernels.py's counts."""
    key = (repr(m), replace(_compute_key(L), recompute=L.recompute), _work_key(w), part)
    hit = _LAUNCH_CACHE.get(key)
    if hit is not None:
        return hit
    if part == "head":
        work = head_work(m, L, w.seq_length, w.micro_batch_size, w.precision, w.runtime.kernels, w.fused_cross_entropy)
    elif part == "embedding":
        work = embedding_work(m, L, w.seq_length, w.micro_batch_size, w.precision)
    else:
        work = layer_work(m, L, w.seq_length, w.micro_batch_size, w.precision, w.runtime.kernels, w.flash_attention,
                          fp8=w.runtime.fp8)
    f, bi = work.f.launches + work.attn_f.launches, work.bi.launches + work.attn_b.launches
    if part == "layers":  # recompute reruns the attention core's forward (selective) or all of it (full)
        bi += {"selective": work.attn_f.launches, "full": f}.get(L.recompute, 0)
    _LAUNCH_CACHE[key] = (f, bi, work.bw.launches)
    return _LAUNCH_CACHE[key]


_LAUNCH_CACHE: dict[tuple, tuple[int, int, int]] = {}
