"""The profile's measurements that need the host's ranks together (profile.py runs them): one run of
every rank, the reference model alone, by k ranks at once and in a few layouts, and the collectives.

On a host whose ranks share cores the machine's speed drifts by tens of percent within minutes, not
within a round of these measurements: each figure is a ratio within a round, the median over rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from mpformer.autoconfig.links import RING_FACTOR  # bus bytes per buffer byte, as the cost model counts them

SIZES = [4 * 2**10, 64 * 2**10, 1 * 2**20, 16 * 2**20]  # collective message bytes


def _collectives_worker(sizes: Sequence[int], group_sizes: Sequence[int], compute_n: int) -> list[dict]:
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
                out.append({"op": name, "ranks": n, "world": world, "bytes": elems * 4,
                            "bus_bytes": RING_FACTOR[name] * elems * 4 * (n - 1) / n, "seconds": sec})
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


def profile_reference(threads: int = 1, duration: float = 1.0, split: bool = False) -> dict:
    """Seconds per forward + backward of the reference model alone: steps back to back for
    ``duration`` (after one untimed). ``split``: the backward as the zero-bubble schedules run it,
    input gradients first and the deferred weight-gradient GEMMs after (layers/linear.py's store)."""
    import torch

    from mpformer.layers.linear import WeightGradStore

    torch.set_num_threads(threads)
    store = WeightGradStore() if split else None
    model, (x, y) = _reference(store=store), _reference_tokens()

    def step() -> None:
        if store is None:
            model(x, y).backward()
            return
        with store.capture(0):
            model(x, y).backward()
        store.run(0)

    step()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < duration:
        step()
        steps += 1
    return {"model": REFERENCE, "seq_length": REFERENCE_SEQ, "micro_batch_size": 1, "precision": "fp32",
            "seconds": (time.perf_counter() - t0) / steps}


def reference_layouts(world: int) -> dict[str, dict]:
    """The layouts of ``world`` ranks the profile runs the reference model in: the deepest pipeline
    (1F1B, and zero-bubble H1 with its split backward), two pipelines of half the depth, and
    tensor-parallel pairs (sequence parallel)."""
    out = {f"pp{world}": {"dp": 1, "pp": world}, f"pp{world} zb-h1": {"dp": 1, "pp": world, "schedule": "zb-h1"}}
    if world % 2 == 0 and world > 2:
        out[f"dp2 pp{world // 2}"] = {"dp": 2, "pp": world // 2}
    if world % 2 == 0:
        out[f"dp{world // 2} tp2"] = {"dp": world // 2, "tp": 2, "sequence_parallel": True}
    return out


def _shared_worker(ks: Sequence[int], rounds: int, sizes: Sequence[int], group_sizes: Sequence[int],
                   compute_n: int) -> dict:
    """On every rank of the host: rounds of (the reference on the first k ranks at once, for each k,
    the others waiting; then each of ``reference_layouts`` for one step of 2 x world micro-batches,
    pipeline and tensor parallelism as the trainer runs them, without the gradient reduction). The
    machine drifts by tens of percent within minutes; within a round it does not, so every figure is
    taken as a ratio to a measurement of the same round (profile_shared). Then the collectives."""
    import torch
    import torch.distributed as dist

    from mpformer.core.layout import ParallelLayout
    from mpformer.core.model_config import ModelConfig
    from mpformer.models.parallelize import build_rank
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups
    from mpformer.pipeline.engine import PipelineEngine
    from mpformer.pipeline.p2p import P2P
    from mpformer.pipeline.schedules import build_schedule

    world, rank, device, t_build = dist.get_world_size(), dist.get_rank(), Device("cpu"), time.perf_counter()
    cfg, (x, y) = ModelConfig(**REFERENCE), _reference_tokens()
    alone_model = _reference()
    runs = {}
    for name, fields in reference_layouts(world).items():
        layout = ParallelLayout(**fields)
        groups = ProcessGroups.build(layout, device)
        part = build_rank(cfg, layout, groups, seq_length=REFERENCE_SEQ, seed=1)
        model, plan = part.model, part.plan
        boundary = (layout.local_positions(REFERENCE_SEQ), 1, cfg.hidden_size)
        p2p = P2P(groups.pp, groups.ledger, boundary, torch.float32, device.torch_device) if layout.pp > 1 else None
        micro = 2 * world // layout.dp
        schedule = build_schedule(layout.schedule, layout.pp, micro, 1)
        runs[name] = (model, PipelineEngine(model, plan, schedule, p2p, store=part.store), [(x, y)] * micro)
    shared: dict[int, list[float]] = {k: [] for k in ks}
    layouts: dict[str, list[float]] = {name: [] for name in runs}
    t_rounds = time.perf_counter()
    for _ in range(rounds + 1):  # the first round warms up
        for k in ks:
            dist.barrier()
            t0 = time.perf_counter()
            reps = 2 if k == world else 1  # all busy: the layouts' 2 x world micro-batches, for their ratio
            for _ in range(reps if rank < k else 0):
                alone_model(x, y).backward()
            shared[k].append((time.perf_counter() - t0) / reps)
        for name, (model, engine, batches) in runs.items():
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            engine.run(batches)
            dist.barrier()
            layouts[name].append(time.perf_counter() - t0)
    t_collectives = time.perf_counter()
    collectives = _collectives_worker(sizes, group_sizes, compute_n)
    seconds = {"build": t_rounds - t_build, "rounds": t_collectives - t_rounds,
               "collectives": time.perf_counter() - t_collectives}
    return {"shared": {k: v[1:] for k, v in shared.items()}, "layouts": {k: v[1:] for k, v in layouts.items()},
            "collectives": collectives, "seconds": seconds}


def profile_shared(ranks: Sequence[int] = (2, 3, 4), rounds: int = 2, compute_n: int = 384,
                   sizes: Sequence[int] = SIZES) -> tuple[dict, dict[str, dict], dict[str, dict], list[dict], dict]:
    """One run of max(ranks) processes (``_shared_worker``): the reference alone (``seconds``, the
    median over rounds), the slowdown with k computing (median over rounds of the time over the same
    round's alone), each reference layout's step time relative to alone and to the same round's
    step with every rank busy (``relative_to_busy``: both about a second, back to back, what
    calibration.py uses), and the collectives of every group size that divides the world."""
    from mpformer.parallel.spawn import run_distributed

    world = max(ranks)
    ks = sorted({1, *ranks})
    groups = [n for n in ranks if world % n == 0 and n > 1]
    per_rank = run_distributed(_shared_worker, world, args=(ks, rounds, sizes, groups, compute_n), timeout=300)

    def at(k: int, r: int) -> float:  # mean over the k computing ranks of round r
        return sum(per_rank[i]["shared"][k][r] for i in range(k)) / k

    alone = [at(1, r) for r in range(rounds)]
    loaded = {str(k): {"ranks": k, "seconds": statistics.median(at(k, r) for r in range(rounds)),
                       "slowdown": statistics.median(at(k, r) / alone[r] for r in range(rounds))}
              for k in ks if k > 1}
    fields = reference_layouts(world)
    layouts = {name: {"layout": fields[name], "world": world, "microbatches": 2 * world,
                      "seconds": statistics.median(times),
                      "relative": statistics.median(t / a for t, a in zip(times, alone)),
                      "relative_to_busy": statistics.median(t / (2 * at(world, r)) for r, t in enumerate(times))}
               for name, times in per_rank[0]["layouts"].items()}
    reference = {"seconds": statistics.median(alone), "seconds_alone_runs": alone}
    return reference, loaded, layouts, per_rank[0]["collectives"], per_rank[0]["seconds"]
