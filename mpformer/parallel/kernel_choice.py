"""A run's CPU kernel choice: made once, agreed by every rank, printed, kept in the checkpoint.

Two choices change a 16-bit run's speed on CPU (parallel/kernels.py): the attention core in fp32 or
in the run's dtype, and the linear layers' input gradient through a contiguous W^T or not. Each rank
probing for itself can disagree near the threshold (two ranks of one job, or a run and its resume,
taking different paths, and so different rounding); a run therefore decides once:

    train.cpu_attention / train.cpu_dgrad    native | fp32, nn | transposed: as set
    auto, the environment sets one           MPFORMER_CPU_ATTENTION / MPFORMER_CPU_DGRAD
    auto, resuming a checkpoint that has one the checkpoint's (the resumed run takes the same path)
    auto, otherwise                          rank 0's probe, broadcast to every rank

On a GPU, in fp32, or without a 16-bit dtype there is nothing to choose: the native path (what a GPU
runs) is taken and recorded. The choice is installed in parallel/kernels.py for the layers to read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from mpformer.core.config import CPU_ATTENTION as ATTENTION
from mpformer.core.config import CPU_DGRAD as DGRAD
from mpformer.parallel import kernels
from mpformer.parallel.kernels import CpuAttention, CpuKernels

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class KernelChoice:
    """What a run computes 16-bit attention cores and input gradients with on CPU, and why."""

    attention: str  # native | fp32
    dgrad: str  # nn | transposed
    source: str  # probe (rank 0's), checkpoint, environment, config, native (nothing to choose)
    probe: Mapping[str, float] | None = None  # rank 0's measurements when it probed

    def to_dict(self) -> dict:
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping) -> KernelChoice:
        return cls(str(d["attention"]), str(d["dgrad"]), str(d["source"]), d.get("probe"))

    def describe(self) -> str:
        how = {"fp32": "attention in fp32", "native": "attention in the run's dtype"}[self.attention]
        dgrad = {"transposed": "dY @ contiguous(W^T)", "nn": "dY @ W"}[self.dgrad]
        probe = "" if not self.probe else " (" + ", ".join(f"{k} {v:.1f}" for k, v in self.probe.items()) + ")"
        return f"cpu kernels: {how}, input gradients {dgrad} [{self.source}{probe}]"


NATIVE = KernelChoice("native", "nn", "native")


def _probe(dtype: torch.dtype) -> KernelChoice:
    d, a = kernels.probe(dtype), kernels.probe_attention(dtype)
    return KernelChoice("fp32" if a.upcast else "native", "transposed" if d.dgrad_transposed else "nn", "probe",
                        {"nn_gflops": d.nn_gflops, "transposed_gflops": d.transposed_gflops,
                         "attention_native_ms": a.native_ms, "attention_fp32_ms": a.fp32_ms})


def _set(value: str, key: str, env: str, saved: str | None, valid: tuple[str, ...]) -> tuple[str | None, str]:
    """(the value if decided without a probe, where it came from)."""
    if value not in valid:
        raise ValueError(f"train.{key}={value!r}; valid: {', '.join(valid)}")
    if value != "auto":
        return value, f"train.{key}"
    forced = os.environ.get(env)
    if forced:
        if forced not in valid[1:]:
            raise ValueError(f"{env}={forced!r}; valid: {', '.join(valid[1:])}")
        return forced, env
    if saved is not None:
        return saved, "checkpoint"
    return None, "probe"


def decide(device_kind: str, precision: str, attention: str = "auto", dgrad: str = "auto",
           saved: Mapping | None = None) -> KernelChoice:
    """This process's proposal (rank 0's is the run's: ``agree``); ``saved``: a checkpoint's choice."""
    a, a_src = _set(attention, "cpu_attention", "MPFORMER_CPU_ATTENTION", saved and saved.get("attention"),
                    ATTENTION)
    g, g_src = _set(dgrad, "cpu_dgrad", "MPFORMER_CPU_DGRAD", saved and saved.get("dgrad"), DGRAD)
    if device_kind != "cpu" or precision not in _DTYPES:
        return KernelChoice(a or "native", g or "nn", "native" if a is None and g is None else a_src)
    probed = _probe(_DTYPES[precision]) if a is None or g is None else None
    source = a_src if a_src == g_src else f"{a_src}, {g_src}"
    return KernelChoice(a or probed.attention, g or probed.dgrad, source, probed.probe if probed else None)


def choose(device_kind: str, precision: str, attention: str = "auto", dgrad: str = "auto",
           saved: Mapping | None = None) -> KernelChoice:
    """The run's choice: rank 0 decides (probing if it must), every rank takes it (one broadcast over
    the world; nothing to agree on one process, nor off a CPU, where every rank takes the native path)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or device_kind != "cpu":
        return decide(device_kind, precision, attention, dgrad, saved)
    mine = decide(device_kind, precision, attention, dgrad, saved) if dist.get_rank() == 0 else None
    box = [mine.to_dict() if mine is not None else None]
    dist.broadcast_object_list(box, src=0)
    return KernelChoice.from_dict(box[0])


def install(choice: KernelChoice, precision: str) -> None:
    """Make ``choice`` the one the layers read (parallel/kernels.py) for this run's dtype."""
    kernels._installed.clear()
    dtype = _DTYPES.get(precision)
    kernels._installed["dgrad"] = CpuKernels(choice.dgrad == "transposed", float("nan"), float("nan"), choice.source)
    if dtype is not None:
        kernels._installed[f"attention:{dtype}"] = CpuAttention(choice.attention == "fp32", float("nan"),
                                                                float("nan"), choice.source)


def uninstall() -> None:
    kernels._installed.clear()
