"""What one layer and the LM head hold per micro-batch on one rank, as memory.py's walk places them.

A layer keeps its ``saved`` bytes from its forward to its backward and adds ``backward`` while its
backward runs; the head also adds its forward's chunk at the end of the forward. Whose block counts:
mpformer's own (layer_memory.py ``layer_bytes``: PyTorch autograd's, torchtitan's too) or Megatron's
(``megatron_layer_bytes``, for the runtimes that run it and for an attention that writes its scores),
plus what a cp kind keeps beyond the rank's own K/V and what token slices keep of the earlier slices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mpformer.autoconfig.layer_memory import (
    BYTES,
    layer_bytes,
    megatron_layer_bytes,
    norm_bytes,
    recompute_bytes,
    shape,
)
from mpformer.autoconfig.runtimes import Runtime
from mpformer.autoconfig.workload import Workload
from mpformer.core.layout import ParallelLayout, ulysses_degree
from mpformer.core.model_config import ModelConfig


@dataclass(frozen=True)
class LayerLive:
    """One layer's bytes per micro-batch under one recompute mode."""

    saved: float  # kept from its forward to its backward
    backward: float  # live above ``saved`` in its backward: recomputed activations, the backward's own


@dataclass(frozen=True)
class HeadLive:
    """The last stage's head per micro-batch (final norm, LM head, cross entropy)."""

    saved: float  # kept from its forward to its backward
    forward: float  # what its forward's chunk adds at the end of the forward
    backward: float  # what its backward adds


def cp_extra_bytes_per_layer(m: ModelConfig, L: ParallelLayout, w: Workload) -> float:
    """Bytes a cp kind keeps per layer for the backward beyond the rank's own K/V (which the layer's
    activations already count), without recompute (a recomputed attention core keeps only its inputs).

    allgather  the K/V gathered over the whole sequence: 2 s b k d, less the rank's own 2 (s/cp) b k d
    ulysses    after the all-to-all each rank keeps q, k, v of U s/cp positions and 1/U of the heads;
               with kv heads repeated to U (U > k): 2 (s/cp) b (U - k) d more
    hybrid     the same for its Ulysses degree; the ring keeps only the rank's own K/V
    (k kv heads per tp rank, d head size, s the whole sequence.)"""
    if L.cp == 1 or L.recompute != "none":
        return 0.0
    seq, b, d, wb = w.seq_length // L.cp, w.micro_batch_size, m.head_size, BYTES[w.precision]
    kv, u = max(m.kv_heads // L.tp, 1), ulysses_degree(L)
    if L.cp_kind == "allgather":
        return 2.0 * (L.cp - 1) * seq * b * kv * d * wb
    return 2.0 * seq * b * (max(kv, u) - kv) * d * wb


def slice_kv_bytes(m: ModelConfig, L: ParallelLayout, w: Workload, mode: str) -> float:
    """Token slices (context_parallel/token_slices.py): what a slice keeps per layer beyond an s/k
    sequence's activations (``w`` is the slice's workload). Its own keys and values, kept for the later
    slices; and, unless the layer recomputes, the attention core's saved keys and values reach back over
    the earlier slices: (j + 1) slices' for slice j, counted at their mean (k + 1) / 2, less the one
    slice's the activations count."""
    k = L.pp_token_slices
    if k == 1:
        return 0.0
    own = 2.0 * w.seq_length * w.micro_batch_size * max(1, m.kv_heads // L.tp) * m.head_size * BYTES[w.precision]
    return own * (1.0 if mode == "full" else (k + 1) / 2)


def layer_live(m: ModelConfig, L: ParallelLayout, w: Workload, mode: str, rt: Runtime,
               sunk: bool = False, kind: str = "dense") -> LayerLive:
    """One layer under recompute ``mode``; ``sunk``: its projections' weight gradients go straight into
    the gradient buffers (mpformer's ZeRO-3); ``kind``: its MLP kind (a sparse layer's: expert_memory.py)."""
    Lm = replace(L, recompute=mode, recompute_layers=None)
    kept = cp_extra_bytes_per_layer(m, Lm, w) + slice_kv_bytes(m, L, w, mode)
    again = cp_extra_bytes_per_layer(m, replace(Lm, recompute="none"), w) if mode != "none" and L.cp > 1 else 0.0
    x, wb = shape(m, L, w.seq_length, w.micro_batch_size), BYTES[w.precision]
    tokens = x.s_n * x.b
    if w.flash_attention and rt.block == "mpformer":  # mpformer's own block (and torchtitan's)
        args = (w.seq_length, w.micro_batch_size, w.precision)
        # mpformer's ZeRO-3 (sunk) gathers the float8 layers' weights in float8 (optim/fp8_gather.py): a
        # forward uses the unit's view, saving no weight copy of its own (fp8_terms.py)
        lb = layer_bytes(m, Lm, *args, sunk=sunk, kind=kind, fp8=rt.fp8, fused_casts=rt.kernels == "fused",
                         fp8_gathered=sunk)
        if mode == "selective" and rt.selective == "op":  # torchtitan's op-level SAC (runtimes.py)
            saved = wb * x.s_r * x.b * x.h + wb * tokens * (2 * x.q + x.kv + x.f + x.h) + 4 * x.a * tokens
            again = layer_bytes(m, Lm, *args, recompute="none", fp8=rt.fp8).saved - saved
            return LayerLive(saved + kept, again + lb.backward)
        again += recompute_bytes(m, Lm, *args, kind=kind, fp8=rt.fp8, fp8_gathered=sunk)
        return LayerLive(lb.saved + kept, lb.backward + again)
    # Megatron's block (layer_memory.megatron_layer_bytes; without a flash kernel, whoever runs it). A
    # recomputed layer's activations come back in its backward, which adds the gradients of the MLP's
    # wide activations (while all of them live) or, once the MLP's are freed, the gradient of the
    # attention probabilities.
    args = (w.seq_length, w.micro_batch_size, w.precision, w.flash_attention)
    saved = megatron_layer_bytes(m, Lm, *args)
    again += megatron_layer_bytes(m, Lm, *args, recompute="none") - saved
    mlp_part = (wb + (1 if m.hidden_dropout > 0 else 0)) * x.s_r * x.b * x.h + 2 * wb * tokens * x.f
    probs = wb * x.a * x.s_n * tokens if L.cp == 1 and not w.flash_attention else 0.0
    return LayerLive(saved + kept, again + max(2 * wb * tokens * x.f, probs - mlp_part))


def head_live(m: ModelConfig, L: ParallelLayout, w: Workload) -> HeadLive:
    """Fused (layers/fused_cross_entropy.py): fp32 dX [n, h] and dW [v, h] kept; a chunk's fp32 logits
    with, in 16-bit, their 16-bit original, or the 16-bit gradient and dW's 16-bit product; backward
    casts dX and dW to the compute dtype. Unfused: the fp32 log-softmax [n, v] kept, its gradient and
    16-bit cast in backward."""
    x, wb = shape(m, L, w.seq_length, w.micro_batch_size), BYTES[w.precision]
    n, v, h = x.s_n * x.b, -(-m.vocab_size // L.tp), m.hidden_size
    norm = norm_bytes(m, x, wb) if w.flash_attention else wb * x.s_r * x.b * h
    if not w.fused_cross_entropy:  # logits (16-bit), their fp32 copy and log-softmax; its two fp32 gradients
        return HeadLive(norm + 4 * n * v + wb * n * h, (wb if wb < 4 else 0) * n * v + 4 * n * v, 8 * n * v)
    c = min(w.cross_entropy_chunk, n)
    chunk = 4 * c * v if wb == 4 else max((wb + 4) * c * v, wb * c * v + wb * v * h + wb * c * h)
    return HeadLive(norm + 4 * (n * h + v * h), chunk, (wb * (n * h + v * h) if wb < 4 else 0.0))  # fp32: no cast
