"""train.precision=fp8 in the memory and cost models: which projections run float8 and what they add.

Under fp8 the run is bf16 (parameters, activations, autocast; ``BYTES["fp8"] = 2``) except the block's
``Linear`` projections that no ``train.fp8.keep_bf16`` pattern keeps (models/fp8.py: qkv, o, up, down,
a MoE's shared experts; never the embedding, the LM head, the routers or the routed experts' grouped
GEMMs). Each of those runs ``layers/fp8_linear.py``; per layer, one micro-batch, one rank, for a
projection of ``k`` inputs and ``n`` outputs over ``M`` rows (its input's rows: s_r b for qkv and up,
whose input is the sequence-parallel shard, s_n b for o and down):

    saved input    tensorwise, delayed: the float8 x8 [M, k] (1 byte an element) instead of the bf16
                   input; rowwise: the bf16 input as given (the same bytes as bf16). Under sequence
                   parallelism the column-parallel projections save the float8 *shard* (cast before
                   the all-gather, gathered again in backward), so M = s_r b.
    weight copy    tensorwise, delayed: the float8 W8 [n, k] saved for dgrad (1 byte an element, one per
                   micro-batch in flight: each forward casts its own) and its scale; rowwise: the bf16
                   parameter itself (nothing new)
    scales         two fp32 scalars (x's and W's) per projection (tensorwise, delayed)
    cast peak      ``cast_to_fp8`` of a bf16 tensor of E elements holds t.float() and t / scale (fp32)
                   at once, then the clamp's fp32 and the float8 result: 8 E bytes at its height.
                   Backward casts dY [M, n] (tensorwise, delayed: once, for both GEMMs); dgrad lays W8^T
                   out column-major (an n k float8 copy) and writes dX (2 M k); wgrad copies dY8^T and
                   x8^T (M n + M k) and writes dW (2 n k). Rowwise re-casts dY, W and x in backward
                   (8 bytes an element of each at its cast, one M n less for dY: see fp8_layer_bytes).
                   The forward's weight cast (8 n k) is taken at the layer's backward: the walk has no
                   point inside a forward, and a layer's backward holds at least what its forward did.
                   Measured: a block's saved bytes to the byte, its backward within 1-5% of the saved
                   bytes (tests/unit/test_fp8_memory.py), whole runs within 0.6% on CPU
                   (tests/distributed/test_memory_model.py) and 2% rehearsed at 1B-8B; under full
                   recompute at 8B 5% over (the MLP's recomputed activations are freed by dY's cast).
    delayed state  the amax history [3, H] and the scales [3] in fp32 per float8 projection: persistent
                   (model state), 4 (3 H + 3) bytes
    ZeRO-3         (tensorwise, delayed; optim/fp8_gather.py) the weights are cast shard by shard before
                   the all-gather and arrive in the unit's float8 buffer (1 byte an element: counted
                   with the gathered units, ``gathered_bytes``); the forward uses that view as it is: no
                   W8 of its own, no weight cast. The W8 it saves is the view, whose storage is freed
                   with the unit after the forward and gathered again for the backward, so nothing per
                   micro-batch is kept beyond x8 and x's scale (counting a W8 per micro-batch put
                   Llama 3 8B at dp8 13% over its rehearsed peak).

Routed experts (``layers.<i>.mlp.experts`` unless a ``keep_bf16`` pattern names them; their grouped GEMMs,
layers/fp8_expert_gemm.py), per sparse layer and micro-batch, with M the rows the rank's E_l experts get
(expert_memory.py), f_e = f / etp, and M_p = M + E_l (16 - 1) / 2 the rows after each expert's block is
zero-padded to a multiple of 16 (a mean; ``padded`` gives the real count). Against the bf16 experts'
count (wb M h dispatched rows, 4 wb M f_e SwiGLU), without recompute (selective recompute saves only the
dispatched rows, as bf16; full saves nothing):

    tensorwise, delayed  x8 [M_p, h] and a8 [M_p, f_e] (1 byte) for the two GEMMs' inputs, the up output
                         [M_p, 2 f_e] and silu(gate) in bf16 (3 wb M_p f_e), each expert's float8 weights
                         (E_l 3 f_e h bytes: cast per forward, kept for dgrad) and 4 fp32 scales per expert
    rowwise              the padded bf16 rows and SwiGLU (wb M_p (h + 4 f_e)); no weight copy
    both                 the padded rows' int64 destinations (8 M), kept by the pad and the unpad
    cast peak            each projection's as a dense one's with M_p rows and one expert's n k weight (the
                         weights are cast expert by expert: layers/fp8_expert_gemm.py cast_experts)
    delayed state        2 projections x E_l experts x 4 (3 H + 3) bytes

Cost (cost.py, compute.py): the three GEMMs of a float8 projection at the device's FP8 rate with 1-byte
operands; per cast of a bf16 tensor (layers/fp8.py, eager): abs (read 2, write 2), amax (read 2), the
scale (scalar kernels), float (2 + 4), divide (4 + 4), clamp (4 + 4), to float8 (4 + 1): 33 bytes an
element over 10 kernels (fused runtimes, Transformer Engine's cast-transpose or torch.compile: read 2,
write 1); the layout copies of W8^T, dY8^T, x8^T (read and write 1 byte each); under tp or cp each
cast's amax is all-reduced (one latency-bound collective); under sequence parallelism (tensorwise,
delayed) the all-gathers of the column-parallel projections' inputs move the float8 shard (1 byte an
element), their reduce-scatters stay bf16.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from functools import lru_cache

from mpformer.core.fp8_config import Fp8Options
from mpformer.core.layer_spec import attention_kind, mlp_kind
from mpformer.core.model_config import ModelConfig

# Projections that are ``layers.linear.Linear`` (models/fp8.py turns them float8); the routed experts'
# grouped GEMMs and the router are not (kept bf16).
_SUBLAYER = {"qkv": "attn", "o": "attn", "up": "mlp", "down": "mlp", "shared_up": "mlp", "shared_down": "mlp"}
_PARTS = {"qkv": ("q", "k", "v"), "up": ("gate", "up")}  # a fused projection matches its parts' names too
INPUT_ROWS_SHARDED = ("qkv", "up", "shared_up")  # column-parallel: their input is the sequence-parallel shard
CAST_BYTES_EAGER = 33.0  # bytes read + written per element of one eager cast (abs, amax, float, div, clamp, to)
CAST_KERNELS_EAGER = 10  # abs, amax, the scale's clamp/where, float, div, clamp, to
CAST_BYTES_FUSED = 3.0  # a fused amax-and-cast kernel: read 2, write 1
PEAK_PER_CAST = 8.0  # bytes an element at the height of one eager cast of a bf16 tensor


ALIGN = 16  # layers/fp8.py ALIGN: every expert's rows are zero-padded to a multiple of it


def experts_fp8(m: ModelConfig, o: Fp8Options) -> bool:
    """Whether a model's routed experts run float8 (no ``keep_bf16`` pattern names them in any layer)."""
    names = [f"layers.{i}.mlp.experts" for i in range(m.num_layers)]
    return m.num_experts > 0 and not any(fnmatch.filter(names, p) for p in o.keep_bf16)


def saves_fp8(o: Fp8Options) -> bool:
    """Whether the recipe saves float8 copies of x and W for backward (tensorwise, delayed)."""
    return o.recipe != "rowwise"


@dataclass(frozen=True)
class Fp8Proj:
    """A float8 projection of one layer on one rank: ``k`` in, ``n`` out, its input's rows sharded under
    sequence parallelism (``sharded``)."""

    name: str
    k: int
    n: int
    sharded: bool


def fp8_projections(m: ModelConfig, tp: int, o: Fp8Options, kind: str | None = None) -> tuple[Fp8Proj, ...]:
    """The layer's projections that run float8 on a tp rank (``kind``: its MLP kind). A projection counts
    as float8 when no ``keep_bf16`` pattern keeps it in any layer (a pattern naming some layers only,
    ``layers.0.mlp.down``, keeps it bf16 in the model: the counts are per layer, not per index)."""
    kind = m.mlp_kind if kind is None else kind
    projs = list(attention_kind(m.attention_kind).projections(m, tp)) + list(mlp_kind(kind).projections(m, tp))
    return tuple(Fp8Proj(p.name, p.k, p.n, p.name in INPUT_ROWS_SHARDED) for p in projs
                 if p.name in _SUBLAYER and not _kept(p.name, m.num_layers, o.keep_bf16))


@lru_cache(maxsize=1024)
def _kept(name: str, layers: int, patterns: tuple[str, ...]) -> bool:
    sub = _SUBLAYER[name]
    names = [f"layers.{i}.{sub}.{leaf}" for i in range(layers) for leaf in (name, *_PARTS.get(name, ()))]
    return any(fnmatch.filter(names, pat) for pat in patterns)


def rows(p: Fp8Proj, s_n: float, s_r: float, b: int) -> float:
    """The rows of the projection's input on this rank (its saved x8: the shard for a column-parallel one)."""
    return (s_r if p.sharded else s_n) * b


@dataclass(frozen=True)
class Fp8LayerBytes:
    """What the float8 projections change in one layer's bytes (one micro-batch, one rank)."""

    input_saving: float  # bytes the saved inputs shrink by (bf16 -> float8): subtract from the saved
    weight_copies: float  # the float8 W8 and the scales kept for backward: add to the saved
    cast_peak: float  # live above the backward the model counts for bf16, at the layer's height
    state: float  # delayed scaling's persistent buffers (model state)


def fp8_layer_bytes(projs: tuple[Fp8Proj, ...], o: Fp8Options, s_n: float, s_r: float, b: int,
                    fused: bool = False, gathered: bool = False) -> Fp8LayerBytes:
    """The module docstring's terms for one layer's float8 projections ``projs``; ``fused``: a runtime whose
    casts are one kernel (torch.compile, Transformer Engine), holding only the float8 result (1 byte an
    element at a cast's height, not eager's 8); ``gathered``: mpformer's ZeRO-3, whose weights arrive
    in float8 (module docstring: no weight copy, no weight cast in the forward)."""
    per_cast = 1.0 if fused else PEAK_PER_CAST
    save8 = saves_fp8(o)
    own_w8 = save8 and not gathered  # a float8 weight cast (and saved) by each forward itself
    saving = sum(rows(p, s_n, s_r, b) * p.k for p in projs) if save8 else 0.0  # 2 -> 1 byte an element
    # Gathered: x's scale alone (the saved W8 and its scale are the unit's, freed with it after the forward)
    copies = sum((p.n * p.k + 8) if own_w8 else 4 for p in projs) if save8 else 0.0
    peak = 0.0
    for p in projs:
        mr, n, k = s_n * b, p.n, p.k  # dY and dX are whole-sequence (the gathered rows under sp)
        if save8:  # dY cast; dgrad (dY8, W8^T, dX); wgrad (dY8, dY8^T, x8^T, dX kept, dW); forward W cast
            here = max(per_cast * mr * n, 2 * mr * n + n * k + mr * k, per_cast * n * k if own_w8 else 0.0)
        else:  # rowwise: each GEMM re-casts both operands; by dY's cast the projection after it (down for up)
            # has freed its bf16 input, not a float8 one: one M n less at the height (measured 5.9-6.8 M n above
            # the bf16 count, against 7.3-8.0 for tensorwise: tests/unit/test_fp8_memory.py)
            here = max(max(per_cast - 1, 1) * mr * n, per_cast * n * k + mr * n, per_cast * mr * k + mr * n)
        peak = max(peak, here)
    return Fp8LayerBytes(saving, copies, peak, delayed_state_bytes(projs, o))


def _proj_peak(save8: bool, per_cast: float, mr: float, n: float, k: float, w: float) -> float:
    """The cast peak of one float8 GEMM's backward (fp8_layer_bytes' terms): ``mr`` rows, ``n`` out,
    ``k`` in, ``w`` weight elements."""
    if save8:
        return max(per_cast * mr * n, 2 * mr * n + w + mr * k, per_cast * w)
    return max(max(per_cast - 1, 1) * mr * n, per_cast * w + mr * n, per_cast * mr * k + mr * n)


def fp8_expert_bytes(o: Fp8Options, h: int, f_e: int, local: int, rows: float, wb: int, mode: str,
                     fused: bool = False, padded: float | None = None) -> Fp8LayerBytes:
    """The routed experts' float8 terms of one sparse layer (module docstring) against the bf16 experts'
    count: ``local`` experts of ``f_e`` per rank, ``rows`` M routed to them, ``mode`` the layer's
    recompute, ``padded`` the rows after padding (default: the mean, M + E_l (ALIGN - 1) / 2)."""
    mp = padded if padded is not None else rows + (local * (ALIGN - 1) / 2 if rows else 0.0)
    save8, per_cast = saves_fp8(o), 1.0 if fused else PEAK_PER_CAST
    state = expert_state_bytes(o, local)
    # weights are cast (and laid out for dgrad) expert by expert: one expert's n k at a time
    peak = max(_proj_peak(save8, per_cast, mp, 2 * f_e, h, 2 * f_e * h),
               _proj_peak(save8, per_cast, mp, h, f_e, h * f_e))
    if mode != "none":  # selective: the checkpoint keeps the dispatched rows (as bf16); full: nothing
        return Fp8LayerBytes(0.0, 0.0, peak, state)
    bf16 = wb * rows * h + 4 * wb * rows * f_e
    if save8:
        acts, weights = mp * h + 3 * wb * mp * f_e + mp * f_e, local * 3 * f_e * h + 16.0 * local
    else:
        acts, weights = wb * mp * (h + 4 * f_e), 0.0
    return Fp8LayerBytes(bf16 - acts - 8 * rows, weights, peak, state)


def expert_state_bytes(o: Fp8Options, local: int) -> float:
    """Delayed scaling's persistent buffers of one sparse layer's ``local`` float8 experts (2 projections)."""
    return 4.0 * (3 * o.amax_history_len + 3) * 2 * local if o.recipe == "delayed" else 0.0


def delayed_state_bytes(projs: tuple[Fp8Proj, ...], o: Fp8Options) -> float:
    """Delayed scaling's persistent buffers of one layer: amax history [3, H] and scales [3], fp32."""
    return 4.0 * (3 * o.amax_history_len + 3) * len(projs) if o.recipe == "delayed" else 0.0


def gathered_bytes(params: tuple[int, ...] | list[int], projs: tuple[Fp8Proj, ...], o: Fp8Options, wb: int) -> float:
    """Bytes of a ZeRO-3 unit gathered under fp8: its float8 projections' weights in 1 byte an element
    (tensorwise, delayed: the shards are cast before the all-gather, with their scale), the rest (norm
    gains, biases, bf16 layers) in ``wb``; rowwise gathers bf16."""
    if not saves_fp8(o):
        return float(sum(params)) * wb
    left = [p.n * p.k for p in projs]
    total = 0.0
    for n in params:
        if n in left:
            left.remove(n)
            total += n
        else:
            total += n * wb
    return total


def cast_stream(elems: float, fused: bool) -> tuple[float, int]:
    """(bytes read + written, kernels) of one amax-scale-cast of ``elems`` bf16 elements."""
    return (CAST_BYTES_FUSED * elems, 1) if fused else (CAST_BYTES_EAGER * elems, CAST_KERNELS_EAGER)


def casts_per_pass(p: Fp8Proj, o: Fp8Options, tokens: float) -> tuple[list[float], list[float], list[float]]:
    """The elements cast in the forward, dgrad and wgrad passes of one float8 projection (``tokens``: the
    rows its GEMMs run over). Tensorwise/delayed: x and W in forward, dY once in dgrad (wgrad reuses it);
    rowwise: each GEMM casts both of its operands."""
    x, w, dy = tokens * p.k, float(p.n * p.k), tokens * p.n
    if saves_fp8(o):
        return [x, w], [dy], []
    return [x, w], [dy, w], [dy, x]


def copies_per_pass(p: Fp8Proj, o: Fp8Options, tokens: float) -> tuple[float, float]:
    """Bytes read + written by the float8 layout copies _scaled_mm needs in dgrad (W8^T column-major) and
    wgrad (dY8^T row-major, x8^T column-major): 1 byte an element each way."""
    x, w, dy = tokens * p.k, float(p.n * p.k), tokens * p.n
    return 2 * w, 2 * (dy + x)


def amax_reductions(p: Fp8Proj, o: Fp8Options) -> tuple[int, int]:
    """Amax all-reduces a float8 projection issues per micro-batch under tp or cp, (forward, backward): one
    per cast whose tensor is sharded (every cast, so that all ranks cast each element as one process would)."""
    f, bi, bw = casts_per_pass(p, o, 1.0)
    return len(f), len(bi) + len(bw)
