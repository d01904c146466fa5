"""What the trainer reports besides metrics: the start-up banner, the model-state memory per rank,
Chrome traces of a window of pipeline steps, and a check on the tokens it reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mpformer.core.config import Config
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout
from mpformer.optim.engine import GradEngine
from mpformer.optim.memory import format_report, write_report
from mpformer.pipeline.engine import PipelineEngine
from mpformer.pipeline.trace import gather_events, write_trace
from mpformer.training.metrics import MetricsLogger


def banner(cfg: Config, L: ParallelLayout, micro_steps: int, device_kind: str, step: int, end: int,
           run_dir: Path, kernels: str = "") -> str:
    """The start-up line; ``kernels``: the run's CPU kernel choice (kernel_choice.py), shown where it
    decides the speed (16-bit on CPU)."""
    t = cfg.train
    n = cfg.model.num_params()  # the whole model, not this rank's shard
    start = f"resuming at step {step}" if step else "starting at step 0"
    kernels = f" | {kernels}" if kernels and device_kind == "cpu" and t.precision != "fp32" else ""
    return (f"mpformer: {cfg.model.arch} {n / 1e6:.2f}M params | dp={L.dp} tp={L.tp} pp={L.pp} cp={L.cp} | "
            f"global batch {t.global_batch_size} x {t.seq_length} tokens, {micro_steps} micro-batches of "
            f"{t.micro_batch_size} per rank | {t.precision} on {device_kind} | {start}, training to {end} | "
            f"run dir {run_dir}{kernels}")


def memory_report(engine: GradEngine, layout: ParallelLayout, model: nn.Module, metrics: MetricsLogger,
                  run_dir: Path, is_logger: bool) -> None:
    """Model-state bytes per rank (counted from the tensors held), printed and in memory.json."""
    import torch.distributed as dist

    mine = engine.memory()
    per_rank = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        per_rank = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(per_rank, mine)
    if is_logger:
        worst = max(range(len(per_rank)), key=lambda r: per_rank[r]["total"])
        metrics.message(format_report(worst, per_rank[worst]) + " (the largest rank)")
        write_report(run_dir / "memory.json", per_rank, {"zero": layout.zero, "layout": layout.to_dict(),
                                                         "param_dtype": str(next(model.parameters()).dtype)})


def check_vocab(batch: torch.Tensor, vocab_size: int, origin: Callable[[int], str] | None = None) -> None:
    """Every token id of ``batch`` inside the vocabulary; else a ConfigError naming the id and, through
    ``origin(row)``, the file and token range the offending sample came from."""
    top = int(batch.max())
    if top >= vocab_size:
        row = int((batch >= vocab_size).any(dim=1).nonzero()[0])
        where = f" ({origin(row)})" if origin is not None else ""
        raise ConfigError(f"the data holds token id {top}{where} but model.vocab_size={vocab_size}; valid: "
                          "a vocabulary that covers the tokenizer's, or data written with it")


class TraceWindow:
    """Steps whose pipeline actions are timed (train.pipeline_trace_steps): that many after the first
    step of this run, which warms up allocators, or fewer if the run is shorter."""

    def __init__(self, pipeline: PipelineEngine | None, n: int, start: int, end: int, group) -> None:
        first = min(start + 1, end - 1)
        self.steps = range(first, min(first + n, end)) if pipeline is not None and n > 0 else range(0)
        self.pipeline, self.group = pipeline, group

    def before(self, step: int) -> None:
        if step in self.steps:
            self.pipeline.start_trace()

    def after(self, done: int, run_dir: Path, vpp: int, metrics: MetricsLogger | None) -> None:
        """``done`` steps taken; after the window's last, every stage's events to rank 0's trace file."""
        if self.steps and done == self.steps[-1] + 1:
            events = gather_events(self.pipeline.take_trace(), self.group)
            if metrics is not None:
                path = write_trace(run_dir / "pipeline_trace.json", events, vpp)
                metrics.message(f"pipeline trace of {len(self.steps)} step(s): {path}")
