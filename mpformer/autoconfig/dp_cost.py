"""The data-parallel terms of a step: the gradient reduction (and ZeRO's parameter gathers) that the
backward and the next forward cannot hide, per ZeRO stage, and the optimizer step's memory traffic.

    stages 0-2  gradients reduce in the runtime's buckets (``Runtime.buckets``) behind the last
                micro-batch's backward, the parameter all-gather (stages 1-2) behind the next forward
    stage 3     per unit as the runtime makes them (runtimes.py): each gathered ahead of its use when
                the prefetch budget allows, each unit's gradients reduce-scattered behind the next's
                backward; the first gather and the last reduce-scatter always exposed
    step        AdamW's bytes over the shard at the device's streaming rate

cost.py adds them to the timeline; a CPU host whose ranks share the cores hides nothing.
"""

from __future__ import annotations

import itertools

from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.compute import stream_rate
from mpformer.autoconfig.fp8_terms import fp8_projections, gathered_bytes
from mpformer.autoconfig.links import _collective, beside
from mpformer.autoconfig.memory import BYTES, Workload, layer_params_per_rank, layer_part_sizes
from mpformer.core.buffers import zero3_groups
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig


def _dp_time(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, params: int, micro: int,
             first_forward: float, last_backward: float, cores_shared: bool) -> float:
    """Exposed data-parallel time of a step on the rank that finishes last (pipeline rank 0).

    Gradients reduce (over dp x cp: the same weights) in the runtime's buckets (``Runtime.buckets``), each
    launched as soon as backward has produced it, on one communication stream: n buckets ready at
    equal steps through a backward of length B, T to reduce them all, finish max(B + T/n, B/n + T)
    after the backward began, i.e. max(T/n, T - B (1 - 1/n)) after it ends (the last bucket, which
    holds the first layers and the embedding, can never hide). Stages 0-1 reduce after the last
    micro-batch only (B: its backward); stage 2 after every micro-batch; ZeRO-1/2's parameter
    all-gather after the step hides the same way behind the next step's first forward (each block
    waits for its bucket: param_gather.py). ZeRO-3 (one unit per layer and one for the embedding and
    head, pp = 1) gathers unit i+1 while unit i computes and reduce-scatters a unit's gradients behind
    the next unit's backward: per micro-batch the first gather and the last reduce-scatter are
    exposed, and each unit's traffic beyond its compute. What hides still takes the SMs its CTAs hold
    from the compute beside it (links.beside). A run that reduces after the backward
    (``Runtime.overlap_grad_reduce=False``: Megatron-LM before September 2023) exposes all of it.
    On a CPU host whose ranks share the cores
    nothing hides (the collectives' copies and sums need the same cores; their measured fits were
    taken with every rank busy) and the collectives' latency counts once per kind."""
    dp_ranks = L.dp * L.cp
    if dp_ranks <= 1:
        return 0.0
    spans = L.tp * L.cp * L.dp > c.devices_per_node
    reduce_bytes = 2 if L.grad_reduce_dtype == "bf16" else 4
    grads, wbytes = params * float(reduce_bytes), params * float(BYTES[w.precision])

    def coll(kind: str, total: float, pieces: int) -> float:
        return pieces * _collective(c, kind, total / pieces, dp_ranks, spans)

    n = w.runtime.buckets(params, reduce_bytes, dp_ranks)

    def hidden(kind: str, total: float, behind: float) -> float:
        t = coll(kind, total, n)
        if cores_shared or not w.runtime.overlap_grad_reduce:
            return t
        exposed = max(t / n, t - behind * (1 - 1 / n))
        return beside(c, t, t - exposed)  # the rest runs beside the compute, holding some of its SMs

    if L.zero == 3:
        return micro * _zero3_exposed(m, L, w, c, params, first_forward, last_backward, cores_shared, dp_ranks,
                                      spans)
    if L.zero == 0:
        return hidden("all_reduce", grads, last_backward)
    exposed = hidden("reduce_scatter", grads, last_backward) + hidden("all_gather", wbytes, first_forward)
    if L.zero == 2:
        exposed += (micro - 1) * hidden("reduce_scatter", grads, last_backward)
    return exposed


def _zero3_exposed(m: ModelConfig, L: ParallelLayout, w: Workload, c: Cluster, params: int, forward: float,
                   backward: float, cores_shared: bool, ranks: int, spans: bool) -> float:
    """ZeRO-3's exposed traffic in one micro-batch (pp = 1). Units as the runtime makes them
    (runtimes.py: mpformer's parts of a layer merged up to ``unit_numel``, whole layers for FSDP2,
    submodules for DeepSpeed), plus the embedding and the head, each gathered in forward and again in
    backward (the embedding's backward reads no weight) and reduce-scattered in the parameter dtype
    (or the runtime's). A unit that fits the prefetch budget is gathered while the unit before it
    computes (hidden up to that unit's time, compute split among units by their parameters); a larger
    one when it is used (all of it exposed); a unit's reduce-scatter runs behind the next unit's
    backward; the first gather and the last reduce-scatter are always exposed. Under full recompute the
    recomputed forward gathers a layer's units once more."""
    rt, wb = w.runtime, BYTES[w.precision]
    rb = rt.reduce_bytes or wb
    if rt.units == "layer":
        layer = [float(layer_params_per_rank(m, L.tp))]
    else:
        parts = [float(sum(p)) for p in layer_part_sizes(m, L.tp)]
        cap = rt.unit_numel if rt.units == "parts" else 0.0  # DeepSpeed: each submodule
        layer = [float(sum(parts[j] for j in g)) for g in zero3_groups(parts, cap)]
    edges = max(0.0, params - m.num_layers * sum(layer)) / 2
    sizes = [edges, *layer * m.num_layers, edges]  # embedding, the layers' units, the head
    total = sum(sizes) or 1.0
    budget = rt.prefetch_numel if rt.units != "module" else rt.prefetch_bucket
    # fp8 (tensorwise, delayed): a layer's float8 weights gathered in 1 byte an element (fp8_terms.py)
    layer_wb = wb
    if w.precision == "fp8":
        flat = [n for part in layer_part_sizes(m, L.tp) for n in part]
        layer_wb = gathered_bytes(flat, fp8_projections(m, L.tp, rt.fp8), rt.fp8, wb) / max(sum(flat), 1)
    unit_wb = [wb, *[layer_wb] * (len(sizes) - 2), wb]

    def ag(n: float, b: float = wb) -> float:
        return _collective(c, "all_gather", n * b, ranks, spans)

    def rs(n: float) -> float:
        return _collective(c, "reduce_scatter", n * rb, ranks, spans)

    if cores_shared:  # nothing hides on shared cores
        return sum(2 * ag(n, b) + rs(n) for n, b in zip(sizes, unit_wb, strict=True))
    out = ag(sizes[0]) + rs(sizes[0])
    regathers = len(layer) - 1 if L.recompute == "full" else 0
    for (prev, n), b in zip(itertools.pairwise(sizes), unit_wb[1:], strict=True):
        behind_f, behind_b = forward * prev / total, backward * prev / total
        hide_f = behind_f if n <= budget else 0.0
        out += beside(c, ag(n, b), hide_f) + beside(c, ag(n, b) + rs(prev), behind_b if n <= budget else 0.0)
    out += regathers * m.num_layers * ag(max(layer), layer_wb) * (0.0 if max(layer) <= budget else 1.0)
    return out


def optimizer_time(L: ParallelLayout, w: Workload, c: Cluster, params: int) -> float:
    """The optimizer step streams its shard (ZeRO shards over dp x cp): AdamW reads the fp32 gradient,
    master, m and v and writes master, m and v back (28 bytes a parameter; no master in fp32: 24), the
    16-bit parameter written from the master (2); the global gradient norm reads the gradients (4);
    the full gradient buffer is zeroed for the next step (4 a parameter of the rank, not the shard)."""
    shard = params / (L.dp * L.cp if L.zero >= 1 else 1)
    per = (28 + 2) if BYTES[w.precision] < 4 else 24
    return (shard * (per + 4) + params * 4) / stream_rate(c)
