"""One rank of a layout, rehearsed: built and stepped through pretraining's own code on meta tensors,
with a fake process group of the full world, on this CPU process.

    process group   torch's "fake" backend (FakeStore): this process is rank r of the whole world; every
                    collective and P2P returns at once, moving nothing, and the ledger counts its bytes
    device          Device("cuda", rehearsal=True): every decision made by device takes its CUDA branch,
                    the tensors are meta (parallel/device.py), autocast is CUDA's policy on them
    build           training/build.py build_run, as pretraining: model, gradient engine, pipeline, the
                    loader (reading synthetic ids, data/synthetic.py)
    steps           the Stepper's steps, as pretraining runs them, under the Probe (probe.py)

The fake group is the process's default one while a rank runs: nothing else in the process may use
torch.distributed meanwhile (cli/rehearse.py runs ranks in processes of their own).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch

from mpformer.core.composed import Composed
from mpformer.rehearsal.probe import KINDS, REPORT, Finding, FunctionProbe, ModuleNames, Probe


@dataclass
class RankReport:
    """What one rank did in its rehearsed steps (the JSON's per-rank object, report.py)."""

    rank: int
    coords: dict[str, int]
    peak_bytes: int
    peak_by_kind: dict[str, int]
    peak_where: str
    largest: list[dict]
    attention_kernels: dict[str, int]
    square_tensors: list[Finding]
    host_syncs: list[Finding]
    comm_bytes: dict[str, int]
    flops: int
    elapsed_s: float
    steps: int
    host_peak_bytes: int  # this process's peak resident memory (the rehearsal's own cost on the host)
    grouped_mm: dict[str, int] = field(default_factory=dict)  # the experts' grouped GEMMs: calls, FLOPs
    scaled_mm: dict[str, int] = field(default_factory=dict)  # float8 GEMM calls by kernel
    predicted: dict = field(default_factory=dict)  # report.py fills it from the memory model

    def to_dict(self) -> dict:
        return {"rank": self.rank, "coords": self.coords, "peak_bytes": self.peak_bytes,
                "peak_by_kind": self.peak_by_kind, "peak_where": self.peak_where, "largest": self.largest,
                "attention_kernels": self.attention_kernels,
                "square_tensors": [f.to_dict() for f in self.square_tensors],
                "host_syncs": [f.to_dict() for f in self.host_syncs], "comm_bytes": self.comm_bytes,
                "flops": self.flops, "elapsed_s": self.elapsed_s, "steps": self.steps,
                "host_peak_bytes": self.host_peak_bytes, "grouped_mm": self.grouped_mm,
                "scaled_mm": self.scaled_mm, **self.predicted}


def _lengths_and_widths(spec) -> tuple[set[int], set[int]]:
    """The attention's query/key lengths this rank can see, and the model's feature widths (probe.py)."""
    m, L, s = spec.cfg.model, spec.layout, spec.cfg.train.seq_length
    lengths = {s, s // max(L.cp, 1), s // (2 * L.cp) if L.cp > 1 else s, s // L.pp_token_slices}
    t = L.tp
    d = m.head_size
    widths = {m.hidden_size, m.ffn_size, m.hidden_size // t, m.ffn_size // t, d,
              m.num_attention_heads * d // t, max(m.kv_heads // t, 1) * d, m.vocab_size, -(-m.vocab_size // t)}
    return lengths, widths


def _classify(probe: Probe, engine, stage: int) -> None:
    """The gradient engine's buffers by kind; the optimizer's state created first (as the first step would)."""
    from mpformer.checkpoint.io import init_optimizer_state

    init_optimizer_state(engine.optimizer)
    buckets = engine.buckets
    if stage == 3:
        float8 = [f.buf for f in engine.gather.fp8 if f is not None]  # fp8: units gathered in float8
        probe.resizes([b.param_buf for b in buckets] + float8, "weights")
        probe.classify([b.param_shard for b in buckets], "weights")
    else:
        probe.classify([b.param_buf for b in buckets], "weights")
    probe.classify([b.grad_shard for b in buckets] + [b.grad_buf for b in buckets], "grads")
    probe.classify([b.masters for b in buckets], "master")
    probe.classify([t for st in engine.optimizer.state.values() for t in st.values() if torch.is_tensor(t)],
                   "optimizer")


def rehearse_rank(composed: Composed, world_size: int, rank: int, steps: int) -> RankReport:
    """Rank ``rank`` of the run ``composed`` describes on ``world_size`` GPUs, ``steps`` steps."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups
    from mpformer.parallel.kernel_choice import uninstall
    from mpformer.training.build import build_run
    from mpformer.training.preflight import preflight_rehearsal

    spec = preflight_rehearsal(composed, world_size)
    t0 = time.perf_counter()
    dist.init_process_group("cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    probe = Probe(*_lengths_and_widths(spec))
    try:
        with probe, FunctionProbe(probe), torch.autograd.graph.saved_tensors_hooks(probe.saved, lambda t: t):
            groups = ProcessGroups.build(spec.layout, Device("cuda", rehearsal=True))
            parts = build_run(spec, groups)
            _classify(probe, parts.engine, spec.layout.zero)
            names = ModuleNames(probe, parts.model)
            groups.ledger.take()  # the build's collectives are not the steps'
            try:
                probe.count_flops = True
                for i in range(steps):
                    probe.phase = f"step {i + 1}"
                    parts.stepper.step()
            finally:
                names.remove()
                parts.loader.close()
        comm = groups.ledger.take()
    finally:  # the process may rehearse another rank after this one
        uninstall()
        dist.destroy_process_group()
    return RankReport(rank, dict(groups.coords), probe.peak, dict(probe.peak_by_kind), probe.peak_where, probe.largest,
                      dict(probe.kernels), probe.squares, probe.syncs, comm, probe.flops,
                      time.perf_counter() - t0, steps, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      dict(probe.grouped_mm), dict(probe.scaled_mm))


__all__ = ["KINDS", "REPORT", "RankReport", "rehearse_rank"]
