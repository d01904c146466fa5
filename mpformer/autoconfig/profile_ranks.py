"""The profile's measurements that need the host's ranks together (profile.py runs them): one run of
every rank, the reference model alone, by k ranks at once and in a few layouts, and the collectives.

On a host whose ranks share cores the machine's speed drifts by tens of percent within minutes, not
within a round of these measurements: each figure is a ratio within a round, the median over rounds.
The results are profile_results.py's dataclasses.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from mpformer.autoconfig.links import RING_FACTOR  # bus bytes per buffer byte, as the cost model counts them
from mpformer.autoconfig.profile_results import (
    AloneRatios,
    CollectiveTime,
    CPAttention,
    CPAttentionRow,
    LayoutStep,
    Loaded,
    PhaseSeconds,
    ReferenceAlone,
    SharedProfile,
)

SIZES = [4 * 2**10, 64 * 2**10, 1 * 2**20, 16 * 2**20]  # collective message bytes


def _collectives_worker(sizes: Sequence[int], group_sizes: Sequence[int], compute_n: int) -> list[CollectiveTime]:
    """Every rank of the world runs ``compute_n``-sized GEMMs between collectives, in concurrent groups
    of n, as training does: on a host whose ranks share cores, a collective's latency is mostly the
    wait for the other ranks to be scheduled, which an idle benchmark does not see. The time of the
    same loop without the collective is subtracted."""
    import torch
    import torch.distributed as dist

    from mpformer.parallel.comm import Comm, CommLedger

    world, rank, out = dist.get_world_size(), dist.get_rank(), []
    a = torch.randn(compute_n, compute_n)

    def timed(fn, reps: int) -> float:
        fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ a
            fn()
        return (time.perf_counter() - t0) / reps

    for n in group_sizes:
        groups = [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)]  # every rank creates each
        g = groups[rank // n]
        cm = Comm(g, CommLedger())  # what training calls (on gloo: the pairwise reduce-scatter / all-gather)
        base = timed(lambda: None, 40)
        for size in sizes:
            elems = size // 4
            elems -= elems % n
            x, part, full = torch.ones(elems), torch.empty(elems // n), torch.empty(elems)
            ops = {"all_reduce": lambda x=x, cm=cm: cm.all_reduce(x),
                   "all_gather": lambda full=full, part=part, cm=cm: cm.all_gather_into(full, part),
                   "reduce_scatter": lambda part=part, x=x, cm=cm: cm.reduce_scatter_into(part, x)}
            reps = 12 if size <= 64 * 2**10 else 6 if size <= 2**20 else 3  # the same on every rank
            for name, fn in ops.items():
                sec = max(timed(fn, reps) - base, 1e-6)
                out.append(CollectiveTime(name, n, world, elems * 4, RING_FACTOR[name] * elems * 4 * (n - 1) / n, sec))
    return out


# The reference model (not one the benchmarks train): timed alone, its forward + backward against the
# cost model's prediction calibrates what the per-kernel terms miss (framework and autograd overhead,
# the ops they do not list); timed by k processes at once, the slowdown of sharing the cores; and run
# end to end in a few layouts, the pipeline's and tensor parallelism's deviations from the model.
REFERENCE = {"arch": "llama", "num_layers": 4, "hidden_size": 384, "num_attention_heads": 6, "num_kv_heads": 2,
             "ffn_hidden_size": 1024, "vocab_size": 4096, "max_position_embeddings": 512}
REFERENCE_SEQ = 256


def _reference(seed: int = 0, store=None):
    import torch

    from mpformer.core.model_config import ModelConfig
    from mpformer.models.parallelize import build_model

    return build_model(ModelConfig(**REFERENCE), tp=None, device=torch.device("cpu"), seed=seed, store=store)


def _reference_tokens():
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, REFERENCE["vocab_size"], (1, REFERENCE_SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


SHORT = 4  # the short micro-batches: the reference's sequence in this many pieces, one after the other


def profile_alone_ratios(threads: int = 1, rounds: int = 8) -> AloneRatios:
    """The reference alone, three ways, one step each in turn for ``rounds`` rounds (this machine's
    speed drifts within seconds under other load; adjacent steps see the same); medians of the
    rounds' ratios to the one-pass step:

    * ``split_backward_ratio``: the backward split as the zero-bubble schedules run it (input
      gradients, then the deferred weight-gradient GEMMs);
    * ``short_micro_batches_ratio``: the same tokens as ``SHORT`` micro-batches of 1/SHORT of the
      sequence each: the same kernels on smaller operands ``SHORT`` times, so that the host's cost per
      kernel launched (eager dispatch, autograd) separates from the kernels' work (cost.py's
      ``_alone``)."""
    import torch

    from mpformer.layers.linear import WeightGradStore

    torch.set_num_threads(threads)
    store = WeightGradStore()
    one_pass, split, (x, y) = _reference(), _reference(store=store), _reference_tokens()
    n = REFERENCE_SEQ // SHORT

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def split_step() -> None:
        with store.capture(0):
            split(x, y).backward()
        store.run(0)

    def short_steps() -> None:
        for i in range(SHORT):
            one_pass(x[:, i * n:(i + 1) * n], y[:, i * n:(i + 1) * n]).backward()

    def one() -> None:
        one_pass(x, y).backward()

    for fn in (one, split_step, short_steps):  # warm-up
        fn()
    rows = [(timed(one), timed(split_step), timed(short_steps)) for _ in range(rounds)]
    return AloneRatios(statistics.median(b / a for a, b, _ in rows), statistics.median(c / a for a, _, c in rows),
                       SHORT)


def reference_layouts(world: int) -> dict[str, dict]:
    """The layouts of ``world`` ranks the profile runs the reference model in (calibration.py): the
    deepest pipeline and two pipelines of half the depth (1F1B), and tensor-parallel pairs (sequence
    parallel). Few on purpose: every other family (ZeRO-3, interleaving, the zero-bubble schedules,
    context parallelism, other tp degrees) is predicted from these by a stated mechanism, and
    benchmarks/bench_autoconfig.py scores only layouts none of these equals (``layout_identity``)."""
    out = {f"pp{world}": {"dp": 1, "pp": world}}
    if world % 2 == 0 and world > 2:
        out[f"dp2 pp{world // 2}"] = {"dp": 2, "pp": world // 2}
    if world % 2 == 0:
        out[f"dp{world // 2} tp2"] = {"dp": world // 2, "tp": 2, "sequence_parallel": True}
    return out


# Context parallelism's attention exchange, measured per kind and cp degree at the reference model's
# attention shape at two sequence lengths (a line in the score elements per rank: the fixed part, ring
# steps' and all-to-alls' waits and the blockwise kernels' many small ops, and the part that grows
# with the scores), with every rank of the host busy; hybrid is not measured (cp_cost.py's traffic
# model prices it).
CP_KINDS_MEASURED = ("ring", "allgather", "ulysses")
CP_SEQS = (128, REFERENCE_SEQ)


def _cp_attention_worker(group_sizes: Sequence[int], compute_n: int, reps: int = 7) -> dict[str, dict]:
    """Per cp kind and degree n (concurrent groups of n ranks), per sequence length: seconds per call
    of the cp attention's forward + backward on this rank's s/n positions, and of the fused causal
    kernel's forward + backward over the whole sequence divided by n (the cost model's attention for a
    cp rank). A ``compute_n`` GEMM runs before each call, as between the
    collectives (``_collectives_worker``): it cancels in the differences."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mpformer.context_parallel.context import CPContext, SeqShard, attention
    from mpformer.core.sequence import rank_segments
    from mpformer.parallel.comm import Comm, CommLedger

    world, rank = dist.get_world_size(), dist.get_rank()
    heads, kv, d = REFERENCE["num_attention_heads"], REFERENCE["num_kv_heads"], \
        REFERENCE["hidden_size"] // REFERENCE["num_attention_heads"]
    a = torch.randn(compute_n, compute_n)

    def call(fn) -> float:
        t0 = time.perf_counter()
        a @ a
        fn()
        return time.perf_counter() - t0

    out: dict[str, dict] = {}
    for n in group_sizes:
        groups = [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)]  # every rank creates each
        comm = Comm(groups[rank // n], CommLedger())
        for kind in CP_KINDS_MEASURED:
            if kind == "ulysses" and (heads % n or (kv % n and n % kv)):
                continue  # the reference's heads do not split over n
            ctx = CPContext(kind, comm, ulysses=comm if kind == "ulysses" else None,
                            ring=comm if kind == "ring" else None)
            calls = {}
            for seq in CP_SEQS:
                shard = SeqShard(seq, rank_segments(seq, n, comm.rank))
                q, k, v = (torch.randn(1, h, seq // n, d, requires_grad=True) for h in (heads, kv, kv))
                grad = torch.randn(1, heads, seq // n, d)
                qf, kf, vf = (torch.randn(1, h, seq, d, requires_grad=True) for h in (heads, kv, kv))
                gf = torch.randn(1, heads, seq, d)

                def op(q=q, k=k, v=v, grad=grad, shard=shard, ctx=ctx) -> None:
                    attention(q, k, v, ctx, shard, None, d ** -0.5).backward(grad)

                def fused(qf=qf, kf=kf, vf=vf, gf=gf) -> None:
                    F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True).backward(gf)

                calls[seq] = (op, fused)
                op(), fused()  # warm-up
            # Every call in turn, ``reps`` times (the machine's speed moves within seconds under other
            # load: what is compared is measured side by side); the median of each.
            dist.barrier()
            times = [[call(fn) for seq in CP_SEQS for fn in calls[seq]] for _ in range(reps)]
            med = [statistics.median(col) for col in zip(*times)]
            rows = [{"seq": seq, "scores_per_rank": heads * seq * seq / n, "seconds": med[2 * i],
                     "fused_s": med[2 * i + 1] / n} for i, seq in enumerate(CP_SEQS)]
            out[f"{kind}/{n}"] = {"heads": heads, "kv_heads": kv, "head_dim": d, "rows": rows}
    return out


# What makes two layouts the same for the out-of-sample rule (benchmarks/bench_autoconfig.py scores only
# layouts whose identity no calibration layout has): the degrees, the schedule and the ZeRO stage.
IDENTITY = ("dp", "tp", "pp", "cp", "vpp", "schedule", "zero")


def layout_identity(fields: dict, world: int) -> tuple:
    """(dp, tp, pp, cp, vpp, schedule, zero) of a layout given as ParallelLayout fields on ``world``
    ranks (dp resolved from the world when not given)."""
    from mpformer.core.layout import ParallelLayout

    L = ParallelLayout(**fields)
    if L.dp == -1:
        L = ParallelLayout(**{**fields, "dp": world // (L.tp * L.pp * L.cp)})
    return tuple(getattr(L, k) for k in IDENTITY)


def calibration_identities(world: int) -> dict[tuple, str]:
    """The identities of ``reference_layouts(world)``, each to its name."""
    return {layout_identity(fields, world): name for name, fields in reference_layouts(world).items()}


def _shared_worker(ks: Sequence[int], rounds: int, sizes: Sequence[int], group_sizes: Sequence[int],
                   compute_n: int) -> dict:
    """On every rank of the host: rounds of (the reference on the first k ranks at once, for each k,
    the others waiting; then each of ``reference_layouts`` for one step of 2 x world micro-batches,
    pipeline and tensor parallelism as the trainer runs them, without the gradient reduction, between
    steps of the reference on every rank). The machine drifts by tens of percent within minutes, and
    other load comes and goes within seconds, so every figure is taken as a ratio to measurements
    next to it in time (profile_shared). Then the collectives and context parallelism's attention."""
    import torch
    import torch.distributed as dist

    from mpformer.core.layout import ParallelLayout
    from mpformer.core.model_config import ModelConfig
    from mpformer.models.parallelize import build_rank
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups
    from mpformer.pipeline.build import build_pipeline

    world, rank, device, t_build = dist.get_world_size(), dist.get_rank(), Device("cpu"), time.perf_counter()
    cfg, (x, y) = ModelConfig(**REFERENCE), _reference_tokens()
    alone_model = _reference()
    runs, ledgers = {}, {}
    for name, fields in reference_layouts(world).items():
        layout = ParallelLayout(**fields)
        groups = ProcessGroups.build(layout, device)
        part = build_rank(cfg, layout, groups, seq_length=REFERENCE_SEQ, seed=1)
        model, plan = part.model, part.plan
        micro = 2 * world // layout.dp
        engine = build_pipeline(model, plan, layout, groups, micro_batches=micro, seq_length=REFERENCE_SEQ,
                                micro_batch_size=1, dtype=torch.float32, store=part.store)
        runs[name] = (model, engine, [(x, y)] * micro)
        ledgers[name] = groups.ledger
    shared: dict[int, list[float]] = {k: [] for k in ks}
    layouts: dict[str, list[float]] = {name: [] for name in runs}
    tp_waits: dict[str, list[float]] = {name: [] for name in runs}  # seconds blocked in tp collectives
    busy: list[list[float]] = []  # per round: the all-busy step before each layout and after the last

    def reference_on(k: int, reps: int = 1) -> float:
        """The reference's forward + backward on the first k ranks at once, the others waiting."""
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps if rank < k else 0):
            alone_model(x, y).backward()
        return (time.perf_counter() - t0) / reps

    for name, (model, engine, batches) in runs.items():  # warm-up: each layout's first step is not timed
        model.zero_grad(set_to_none=True)
        engine.run(batches)
        ledgers[name].take_seconds()
    reference_on(world)
    t_rounds = time.perf_counter()
    for _ in range(rounds):
        for k in ks[:-1]:
            # Alone, the median of three runs: load from outside once made a single run 3.7x as long
            # (a CI run), and every ratio over it came out that much too small.
            shared[k].append(statistics.median(reference_on(k) for _ in range(3)) if k == 1 else reference_on(k))
        # Every rank busy, 2 x world micro-batches as the layouts run: right before each layout and
        # after the last, so that each layout is taken against the two nearest in time.
        busy.append([reference_on(world, 2)])
        for name, (model, engine, batches) in runs.items():
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            ledgers[name].take_seconds()
            engine.run(batches)
            dist.barrier()
            layouts[name].append(time.perf_counter() - t0)
            tp_waits[name].append(sum(v for k, v in ledgers[name].take_seconds().items() if k.startswith("tp.")))
            busy[-1].append(reference_on(world, 2))
        shared[world].append(statistics.fmean(busy[-1]))
    t_collectives = time.perf_counter()
    collectives = _collectives_worker(sizes, group_sizes, compute_n)
    t_cp = time.perf_counter()
    cp = _cp_attention_worker(group_sizes, compute_n)
    seconds = PhaseSeconds(t_rounds - t_build, t_collectives - t_rounds, t_cp - t_collectives,
                           time.perf_counter() - t_cp)
    return {"shared": shared, "layouts": layouts, "tp_waits": tp_waits, "busy": busy, "collectives": collectives,
            "cp_attention": cp, "seconds": seconds}


def profile_shared(ranks: Sequence[int] = (2, 3, 4), rounds: int = 2, compute_n: int = 384,
                   sizes: Sequence[int] = SIZES) -> SharedProfile:
    """One run of max(ranks) processes (``_shared_worker``): the reference alone (``seconds``, the
    median over rounds), the slowdown with k computing (median over rounds of the time over the same
    round's alone), each reference layout's step time relative to alone and to the steps with every
    rank busy right before and after it (``relative_to_busy``: about a second each, back to back,
    what calibration.py uses), the collectives of every group size that divides the world, and context
    parallelism's attention at those degrees (``cp_extras``)."""
    from mpformer.parallel.spawn import run_distributed

    world = max(ranks)
    ks = sorted({1, *ranks})
    groups = [n for n in ranks if world % n == 0 and n > 1]
    per_rank = run_distributed(_shared_worker, world, args=(ks, rounds, sizes, groups, compute_n), timeout=300)

    def at(k: int, r: int) -> float:  # mean over the k computing ranks of round r
        return sum(per_rank[i]["shared"][k][r] for i in range(k)) / k

    alone = [at(1, r) for r in range(rounds)]
    loaded = {str(k): Loaded(k, statistics.median(at(k, r) for r in range(rounds)),
                             statistics.median(at(k, r) / alone[r] for r in range(rounds)))
              for k in ks if k > 1}

    def busy(r: int, i: int) -> float:  # the all-busy step of 2 micro-batches a rank around layout i
        return sum(p["busy"][r][i] + p["busy"][r][i + 1] for p in per_rank) / world

    fields = reference_layouts(world)
    layouts = {name: LayoutStep(fields[name], world, 2 * world, statistics.median(times),
                                statistics.median(t / a for t, a in zip(times, alone)),
                                statistics.median(t / busy(r, i) for r, t in enumerate(times)),
                                statistics.median(statistics.fmean(p["tp_waits"][name][r] for p in per_rank)
                                                  / busy(r, i) for r in range(rounds)))
               for i, (name, times) in enumerate(per_rank[0]["layouts"].items())}
    return SharedProfile(ReferenceAlone(statistics.median(alone), alone), loaded, layouts,
                         per_rank[0]["collectives"], cp_extras(per_rank), per_rank[0]["seconds"])


def cp_extras(per_rank: Sequence[dict]) -> dict[str, CPAttention]:
    """What each measured cp kind and degree costs beyond the fused kernel the cost model times for a
    cp rank (forward + backward), per sequence length, mean over the ranks (``per_rank``: each rank's
    ``_shared_worker`` result)."""
    out = {}
    for key, first in per_rank[0]["cp_attention"].items():
        rows = []
        for i, row in enumerate(first["rows"]):
            seconds, fused = (statistics.fmean(r["cp_attention"][key]["rows"][i][f] for r in per_rank)
                              for f in ("seconds", "fused_s"))
            rows.append(CPAttentionRow(row["seq"], row["scores_per_rank"], seconds, fused, seconds - fused))
        out[key] = CPAttention(first["heads"], first["kv_heads"], first["head_dim"], rows)
    return out
