"""Measure what a training run's tensors hold on CPU: live tensor bytes from torch.profiler's memory events.

    sums = train_measured(args)   # in a rank: train through the real entry point, profiled
    sums["setup_peak"], sums["held_at_start"], sums["training_peak"]

The profiler (``profile_memory=True``) records every allocation and free of c10's CPU allocator;
summed in order they give the live tensor bytes at every moment. The window opens when the
run's parts are built (training/build.py) and closes when training ends; a mark separates set-up (model built, engine
filled, optimizer state created) from the steps. What it counts: every tensor byte allocated inside
the window on the threads the profiler follows. Not counted: the interpreter, gloo's own buffers,
allocations on gloo's worker threads, tensors from before the window. Used by
benchmarks/bench_memory.py and tests/distributed/test_memory_model.py against autoconfig/memory.py.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

# The native kernel paths, as on a GPU: no W^T copies for 16-bit input gradients, no fp32 attention
# cores (parallel/kernels.py). Pinned, the bytes do not depend on which CPU measured them.
NATIVE_KERNELS = {"MPFORMER_CPU_DGRAD": "nn", "MPFORMER_CPU_ATTENTION": "native"}


def live_tensor_bytes(prof, marks: Sequence[str] = ()) -> dict[str, int]:
    """The live CPU tensor bytes over a profiled window: ``peak`` (the largest sum) and, for each of
    ``marks`` (a ``record_function("mark:NAME")`` inside the window), ``at:NAME`` (the sum when it was
    passed), ``before:NAME`` and ``after:NAME`` (the largest sum before and after it)."""
    from torch.autograd import DeviceType

    events = prof.profiler.kineto_results.events()
    mem = sorted(((e.start_ns(), e.nbytes()) for e in events
                  if e.name() == "[memory]" and e.device_type() == DeviceType.CPU), key=lambda e: e[0])
    when = {e.name()[5:]: e.start_ns() for e in events if e.name().startswith("mark:")}
    times, sums, live = [], [], 0
    for t, n in mem:  # a stable sort: one call's allocation stays before its free (a free is negative)
        live += n
        times.append(t)
        sums.append(live)
    out = {"peak": max(sums, default=0)}
    for name in marks:
        i = bisect.bisect_left(times, when[name])
        out[f"at:{name}"] = sums[i - 1] if i else 0
        out[f"before:{name}"] = max(sums[:i], default=0)
        out[f"after:{name}"] = max(sums[i:], default=0)
    return out


def train_measured(args: list[str]) -> dict[str, int]:
    """Train with these Hydra overrides (testing/train.py ``train``) inside a rank, profiled from the
    build of the run's parts (build_run) to the end: ``setup_peak``, ``held_at_start`` (when training starts) and
    ``training_peak``, in bytes. Set NATIVE_KERNELS in the environment and data.prefetch=0 (the
    loader thread's batches would be missed) for numbers the memory model describes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import mpformer.training.build as build_module
    import mpformer.training.trainer as trainer_module
    from mpformer.testing.train import train

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    build, report = build_module.build_run, trainer_module.memory_report

    def build_profiled(*a, **kw):  # set-up starts with the run's parts ...
        prof.start()
        return build(*a, **kw)

    def report_then_mark(*a, **kw) -> None:  # ... and ends once the optimizer state exists
        report(*a, **kw)
        with torch.profiler.record_function("mark:train"):
            pass

    build_module.build_run, trainer_module.memory_report = build_profiled, report_then_mark
    try:
        train(args)
    finally:
        build_module.build_run, trainer_module.memory_report = build, report
        prof.stop()
    sums = live_tensor_bytes(prof, ["train"])
    return {"setup_peak": sums["before:train"], "held_at_start": sums["at:train"], "training_peak": sums["after:train"]}


def predicted(args: list[str], world_size: int, device: str = "cpu"):
    """The memory model's stages (autoconfig/memory.py plan_memory) for the run these overrides
    describe on ``world_size`` ranks, as the trainer composes it."""
    from dataclasses import replace

    from mpformer.autoconfig.memory import Workload, plan_memory
    from mpformer.autoconfig.runtimes import mpformer_runtime
    from mpformer.cli.compose import compose_config

    cfg = compose_config(args).cfg
    t, layout = cfg.train, cfg.parallel.layout()
    layout = replace(layout, dp=world_size // (layout.tp * layout.pp * layout.cp))
    w = Workload(t.global_batch_size, t.micro_batch_size, t.seq_length, t.precision,
                 fused_cross_entropy=t.fused_cross_entropy, cross_entropy_chunk=t.cross_entropy_chunk,
                 runtime=mpformer_runtime(t))
    return layout, plan_memory(cfg.model, layout, w, device=device, bucket_mb=t.grad_bucket_mb)


def data_file(root: Path, vocab: int = 1024, documents: int = 200) -> str:
    """A random-token indexed dataset (documents of 200-600 tokens, EOS 0) for measured runs: its prefix."""
    import numpy as np

    from mpformer.data.indexed import IndexedDatasetBuilder

    prefix = root / "random_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(documents):
        builder.add_document(np.append(rng.integers(1, vocab, size=int(rng.integers(200, 600))), 0))
    builder.finalize()
    return str(prefix)


def saved_layer_bytes(model, seq, x, autocast=None) -> int:
    """Bytes of every storage autograd saves while ``model`` runs its first layer on ``x`` (``seq``: its
    sequence info; parameters and rotary tables aside): what the memory model calls a layer's saved bytes,
    seen by torch's saved-tensor hooks, each storage once. ``autocast``: the dtype to run under, if any."""
    import contextlib

    import torch

    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in (seq.rope or ())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    amp = torch.autocast(x.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with amp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.run_layers(x, range(1), seq)
    return sum(seen.values())
