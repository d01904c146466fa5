"""Activation offload's device memory, measured (issue 17): rank 0 of a 1F1B pipeline at p=4 holds p
micro-batches' activations without offload; with offload=all the engine leaves at most 1.5 micro-batches
of them on the device, and the gradients are the same bits. One rank alone through the real
PipelineEngine (testing/loopback.py for its neighbours), its peak counted by parallel/memory_meter.py;
each copy is waited for as it is made, so the figure is the engine's order of copies and frees, not a thread's timing
(benchmarks/bench_offload.py measures it with the copies beside the compute, and on CUDA)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions
from mpformer.core.pipeline_plan import stage_plan
from mpformer.models.parallelize import build_model
from mpformer.parallel.device import Device, HostCopies
from mpformer.parallel.memory_meter import StorageMeter
from mpformer.pipeline.engine import PipelineEngine
from mpformer.pipeline.offload import ActivationOffload, offload_units
from mpformer.pipeline.schedules import build_schedule
from mpformer.testing.loopback import LoopbackP2P


class _Waited:
    """HostCopies' thread, each copy waited for as it is made: the copy out lands on that thread (host
    memory, which the meter does not count) and is done before the compute goes on."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1)

    def submit(self, fn, *args):
        done = self.pool.submit(fn, *args)
        done.result()
        return done


class _Counted(HostCopies):
    """CPU HostCopies on a _Waited thread, counting copies out, copies back, and reads of a tensor whose
    copy back was not asked for before the autograd read that needs it (``late``: the read-ahead missed
    it, the backward would wait for the whole copy). ``read`` numbers the offload's reads (``watch``)."""

    def __init__(self) -> None:
        super().__init__(Device("cpu"))
        self.pool = _Waited()
        self.out = self.back = self.late = self.read = 0

    def watch(self, offload: ActivationOffload) -> None:
        unpack = offload._unpack

        def counted(packed: object) -> torch.Tensor:
            self.read += 1
            return unpack(packed)

        offload._unpack = counted

    def to_host(self, t: torch.Tensor) -> dict:
        self.out += 1
        return super().to_host(t)

    def to_device(self, *copies: dict) -> None:
        for copy in copies:
            if "back" not in copy:
                self.back += 1
                copy["asked in read"] = self.read
        super().to_device(*copies)

    def result(self, copy: dict, keep: bool = False) -> torch.Tensor:
        self.late += "back" not in copy or copy["asked in read"] == self.read
        return super().result(copy, keep)


def _peak_and_grads(cfg: ModelConfig, mode: str, recompute: str, p: int = 4, m: int = 8, seq: int = 128,
                    batch: int = 2) -> tuple[int, list[torch.Tensor], int, _Counted | None]:
    plan = stage_plan(cfg, ParallelLayout(dp=1, pp=p), 0, seq)
    schedule = build_schedule("1f1b", p, m)
    model = build_model(cfg, ModelOptions(recompute=recompute), tp=None, device="cpu", seed=1, stage=plan)
    offload = copies = None
    if mode != "none":
        copies = _Counted()
        offload = ActivationOffload(copies, model, offload_units(schedule.actions[0], mode))
        copies.watch(offload)
    engine = PipelineEngine(model, plan, schedule, LoopbackP2P((seq, batch, cfg.hidden_size), torch.float32),
                            offload=offload)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(m):
        tok = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        batches.append((tok[:, :-1], tok[:, 1:]))
    torch.manual_seed(2)  # the loopback's received gradients: the same in every run
    with StorageMeter() as meter:
        engine.run(batches)
    moved = offload.moved_bytes if offload is not None else 0
    return meter.peak, [p_.grad.clone() for p_ in model.parameters()], moved, copies


def _config(arch: str) -> ModelConfig:
    extra = {"num_kv_heads": 2, "ffn_hidden_size": 176} if arch == "llama" else \
        {"activation": "gelu_tanh", "attention_bias": True, "mlp_bias": True, "max_position_embeddings": 128}
    return ModelConfig(arch=arch, num_layers=16, hidden_size=64, num_attention_heads=4, vocab_size=97, **extra)


@pytest.mark.parametrize("arch,recompute", [("llama", "none"), ("gpt2", "selective")])
def test_offload_all_leaves_at_most_one_and_a_half_microbatches(arch, recompute):
    cfg = _config(arch)
    none, ref, _, _ = _peak_and_grads(cfg, "none", recompute)
    every, grads, moved, _ = _peak_and_grads(cfg, "all", recompute)
    per_micro = none / 4  # none's peak: rank 0 of 1F1B at p=4 holds 4 micro-batches
    assert moved > 1.5 * none  # 8 micro-batches went out and came back (none holds 4 and working memory)
    assert every <= 1.5 * per_micro, f"offload=all holds {every / per_micro:.2f} micro-batches"
    for a, b in zip(grads, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch,recompute", [("llama", "none"), ("llama", "selective"), ("llama", "full"),
                                            ("gpt2", "full")])
def test_every_copy_comes_back_once_and_ahead_of_its_read(arch, recompute):
    """The read-ahead brings each moved tensor back once (a tensor saved in several places too: llama's
    norm inputs and rotary tables) and before the backward reads it (full recompute's kept inputs too,
    saved before their Block starts); the gradients are the same bits."""
    cfg = _config(arch)
    _, ref, _, _ = _peak_and_grads(cfg, "none", recompute, m=6, seq=32)
    _, grads, _, copies = _peak_and_grads(cfg, "all", recompute, m=6, seq=32)
    assert copies.out > 6 and (copies.back, copies.late) == (copies.out, 0)
    for a, b in zip(grads, ref):
        assert torch.equal(a, b)
