"""Each rank's communication in one step from the model's shape and the layout alone, beside what the
ledger (parallel/comm.py ``CommLedger``) recorded in a rehearsal. Ring-adjusted bytes per rank, as the
ledger counts them: an all-gather or reduce-scatter of n bytes over g ranks moves (g - 1) / g * n, an
all-reduce twice that, a send its n.

    tp  sequence parallel: per layer and micro-batch two all-gathers and two reduce-scatters of the
        [s/cp, b, h] activations in forward, the same mirrored in backward, and two all-gathers more
        there (the qkv and MLP inputs gathered again: only their shards are kept); the embedding adds one of
        each on the first stage, the head on the last; full recompute repeats a layer's two all-gathers
        and its attention's reduce-scatter (the MLP's output is not needed again). Once a step the
        gradients of replicated parameters that see only a slice of the tokens (norms, row biases,
        learned positions) are all-reduced in fp32 (under ZeRO the part of them in the rank's shard:
        left out), and on the last stage the vocab-parallel cross
        entropy all-reduces three [s/cp, b] fp32 tensors a micro-batch (parallel/volumes.py
        ``tp_step_bytes`` is the one-stage form, checked against the ledger in
        tests/distributed/test_tensor_parallel.py)
    pp  a micro-batch's activation to the next stage and its gradient to the one before, both in the
        compute dtype, [s/(cp tp), b, h] under sequence parallelism, for each chunk of the rank
    dp  ZeRO 1-2: a reduce-scatter of the rank's gradients (``grad_reduce_dtype``) over dp x cp and an
        all-gather of its updated parameters (their dtype), once a step; ZeRO-3: a micro-batch's
        gathers of every unit in forward and backward (optim/units.py) and its gradients' reduce-scatter
        (fp8, tensorwise and delayed: the float8 layers' weights in 1 byte an element and one 4-byte amax
        each per forward, ``dp.fp8.all_reduce``; under sequence parallelism the float8 layers'
        column-parallel inputs are gathered in float8 too, rowwise's forward with its rows' fp32 scales)

    ep  mixture of experts: per sparse layer and micro-batch, layers/moe_dispatch.py ``dispatch_bytes`` for
        the rank's T tokens (s/cp b, over tp under sequence parallelism with etp = 1: each tp rank routes
        its own chunk; etp = tp gathers them first), under the uniform routing a rehearsal stands in
        (exact there: its dispatchers read uniform counts, parallel/device.py ``host_ints``)

What has no closed form here is left out (``None``): an MoE model's dp and tp terms (its expert
gradients reduce over the expert-data view and, at etp = 1, over tp; the memory model's parameter count
does not split them yet), ep under full recompute, ZeRO-3 under full recompute (which units stay
gathered from the recomputed forward into backward), context parallelism's hops (they depend on the
kind and the mask), tp without sequence parallelism under full recompute, and ZeRO-0's all-reduce.
"""

from __future__ import annotations

from mpformer.core.config import Config
from mpformer.core.layout import ParallelLayout
from mpformer.core.moe_config import is_moe_layer
from mpformer.core.pipeline_plan import rank_ends, stage_counts, stage_index
from mpformer.layers.moe_dispatch import ID_BYTES, dispatch_bytes

# fp8: bf16 parameters, activations and gradients; its float8 gathers (``_fp8``) move 1 byte an element
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


def _fp8(cfg: Config, layout: ParallelLayout) -> tuple[float, int, int]:
    """train.precision=fp8, per layer of this rank: the elements of its float8 weights gathered by ZeRO-3 in
    float8 (tensorwise, delayed), their count, and how many of its column-parallel inputs sequence
    parallelism gathers in float8 (autoconfig/fp8_terms.py; 0s when none)."""
    from mpformer.autoconfig.fp8_terms import fp8_projections, saves_fp8
    from mpformer.core.fp8_config import Fp8Options

    if cfg.train.precision != "fp8":
        return 0.0, 0, 0
    o = Fp8Options.from_config(cfg.train.fp8)
    projs = fp8_projections(cfg.model, layout.tp, o)
    weights = float(sum(p.n * p.k for p in projs)) if saves_fp8(o) else 0.0
    return weights, len(projs), sum(p.sharded for p in projs)


def _replicated_partial(cfg: Config, layers: int, first: bool, last: bool) -> int:
    """Elements of the rank's replicated parameters whose gradients are partial under sequence parallelism."""
    m = cfg.model
    norms = (2 * layers + last) * m.hidden_size * (2 if m.norm_bias else 1)
    row_biases = 2 * layers * m.hidden_size if m.mlp_bias else 0
    positions = m.max_position_embeddings * m.hidden_size if (m.learned_positions and first) else 0
    return norms + row_biases + positions


def comm_formula(cfg: Config, layout: ParallelLayout, rank: int, params: int) -> dict[str, float | None]:
    """Bytes per collective (the ledger's names) rank ``rank`` moves in one step; ``params`` is what the
    rank holds before ZeRO's sharding (the memory model's count)."""
    m, t, L = cfg.model, cfg.train, layout
    pp_rank = L.topology.coords(rank)["pp"]
    e, h = BYTES[t.precision], m.hidden_size
    micro = t.global_batch_size // (L.dp * t.micro_batch_size)
    s, b = t.seq_length // L.cp, t.micro_batch_size
    counts = stage_counts(m, L, t.seq_length)
    stages = [stage_index(L, pp_rank, c) for c in range(L.vpp)]
    layers = sum(counts[g] for g in stages)
    first, last = rank_ends(L, pp_rank)
    out: dict[str, float | None] = {}
    if L.tp > 1:
        g, ar = (L.tp - 1) / L.tp, 2 * (L.tp - 1) / L.tp
        unit = micro * s * b * h * e
        recomputed = 0
        if L.recompute == "full":
            recomputed = layers if L.recompute_layers is None else min(layers, L.recompute_layers * L.vpp)
        ce = 3 * micro * s * b * 4 * ar if last else 0.0
        if L.sequence_parallel:
            ends = 4 * layers + first + last
            out["tp.all_gather"] = g * unit * (ends + 2 * layers + 2 * recomputed)
            _, _, cols = _fp8(cfg, L)
            if cols:  # a float8 column-parallel input: cast before its gathers (forward, backward, recompute)
                if cfg.train.fp8.recipe == "rowwise":  # forwards: x8 and its rows' fp32 scales; backward: bf16 x
                    out["tp.all_gather"] -= g * unit * cols * (layers + recomputed) * (1 - (1 + 4 / h) / e)
                else:  # 1 byte an element in every gather
                    out["tp.all_gather"] -= g * unit * cols * (2 * layers + recomputed) * (1 - 1 / e)
                out["tp.all_reduce"] = None  # the amaxes' all-reduces: vectors under rowwise (not a formula)
            out["tp.reduce_scatter"] = g * unit * (ends + recomputed)
            partial = _replicated_partial(cfg, layers, first, last)
            # Under ZeRO each rank all-reduces the part of them its shard of the flat gradient buffer holds,
            # after the data-parallel reduce-scatter: where the shard boundaries fall, not a formula
            sharded = L.zero >= 1 and L.dp * L.cp > 1
            out["tp.all_reduce"] = None if sharded and partial else ar * 4 * partial + ce
        else:
            out["tp.all_reduce"] = None if recomputed else ar * unit * (4 * layers + first + last) + ce
    if L.pp > 1:
        total = L.pp * L.vpp
        hops = sum((gs < total - 1) + (gs > 0) for gs in stages)
        if L.schedule in ("zb-v", "dualpipev"):  # a V rank's own two chunks meet without a send
            hops -= 2 * sum(1 for gs in stages if gs == L.pp - 1)
        out["pp.send"] = micro * hops * s // (L.tp if L.sequence_parallel else 1) * b * h * e
    n_d = L.dp * L.cp
    if n_d > 1:
        g = (n_d - 1) / n_d
        if L.zero in (1, 2):
            out["dp.reduce_scatter"] = g * params * BYTES[L.grad_reduce_dtype]
            out["dp.all_gather"] = g * params * e
        elif L.zero == 3 and L.recompute != "full":
            # each micro-batch gathers every unit in forward and again in backward, but the embedding's
            # (its backward reads no weight), which a tied head reads twice more (the whole unit);
            # gradients are reduce-scattered a micro-batch at a time in the parameters' 16-bit dtype
            emb = -(-m.vocab_size // L.tp) * h + (m.max_position_embeddings * h if m.learned_positions else 0)
            gathered = 2 * params + (emb if m.tie_embeddings else -emb)
            reduce = e if t.precision != "fp32" else BYTES[L.grad_reduce_dtype]
            out["dp.all_gather"] = g * micro * gathered * e
            out["dp.reduce_scatter"] = g * micro * params * reduce
            f8, n8, _ = _fp8(cfg, L)
            if f8:  # float8 weights: 1 byte an element in forward and backward; their amaxes, once a forward
                out["dp.all_gather"] -= g * micro * 2 * layers * f8 * (e - 1)
                out["dp.fp8.all_reduce"] = 2 * g * micro * 4 * layers * n8
        else:
            out["dp.reduce_scatter" if L.zero == 3 else "dp.all_reduce"] = None
            out["dp.all_gather" if L.zero == 3 else "dp.all_reduce"] = None
    if L.cp > 1:
        out["cp"] = None
    if m.num_experts:
        out.update(dict.fromkeys([k for k in out if k.startswith(("dp.", "tp."))], None))
        if L.ep > 1:
            starts = [sum(counts[:g]) for g in range(len(counts))]
            sparse = sum(is_moe_layer(m, i) for g in stages for i in range(starts[g], starts[g] + counts[g]))
            out.update(_ep_formula(cfg, L, micro * sparse, s * b))
    return out


def _ep_formula(cfg: Config, L: ParallelLayout, passes: int, tokens: int) -> dict[str, float | None]:
    """The ep group's bytes for ``passes`` (sparse layer, micro-batch) pairs of ``tokens`` tokens each."""
    m, e = cfg.model, BYTES[cfg.train.precision]
    kinds = {"alltoall": ("ep.all_to_all",), "allgather": ("ep.all_gather", "ep.reduce_scatter")}[L.ep_dispatcher]
    if L.recompute == "full":  # a recomputed forward dispatches again: which layers, the recompute's choice
        return dict.fromkeys(kinds, None)
    etp = L.etp if L.etp is not None else L.tp
    if L.sequence_parallel and etp == 1:
        tokens //= L.tp
    k, h = m.num_experts_per_tok, m.hidden_size
    f = dispatch_bytes(L.ep_dispatcher, tokens, k, h, L.ep, e, num_experts=m.num_experts)
    if L.ep_dispatcher == "alltoall":
        return {"ep.all_to_all": passes * (f["forward"] + f["backward"])}
    # all-gathers: forward's tokens and ids, backward's [S, h]; reduce-scatters: forward's [ep S, h], backward's
    rows_t, rows_s = (L.ep - 1) * tokens * h * e, (L.ep - 1) * tokens * k * h * e
    assert f["dispatch"] == rows_t + (L.ep - 1) * tokens * k * ID_BYTES
    return {"ep.all_gather": passes * (f["dispatch"] + rows_s), "ep.reduce_scatter": passes * (f["combine"] + rows_t)}


def comm_agreement(recorded: dict[str, int], formula: dict[str, float | None]) -> float | None:
    """The largest |formula / ledger - 1| over the collectives with a formula (None: none has one)."""
    errs = [abs(f / recorded.get(k, 0) - 1) if recorded.get(k) else float("inf")
            for k, f in formula.items() if f is not None]
    return max(errs) if errs else None
