"""What the profile measures with the host's ranks together (profile_ranks.py), as typed results.

Each dataclass's fields are, in order, the keys of its section of the profile JSON: profile.py writes
them with ``dataclasses.asdict``, and cost.py, cp_cost.py, sharing.py and calibration.py read that JSON
(the cluster's ``measured``), so a field renamed here is a key renamed there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReferenceAlone:
    """The reference model's forward + backward on one rank, the others waiting."""

    seconds: float  # the median over rounds
    seconds_alone_runs: list[float]  # each round's


@dataclass(frozen=True)
class Loaded:
    """The reference run by ``ranks`` processes at once."""

    ranks: int
    seconds: float  # median over rounds, mean over the computing ranks
    slowdown: float  # median over rounds of the time over the same round's alone


@dataclass(frozen=True)
class LayoutStep:
    """One step of the reference model in a reference layout (``reference_layouts``)."""

    layout: dict[str, Any]  # its ParallelLayout fields
    world: int
    microbatches: int
    seconds: float  # median over rounds
    relative: float  # over the same round's alone
    relative_to_busy: float  # over the steps of the same micro-batches with every rank busy around it
    tp_waits_relative_to_busy: float  # the tensor-parallel collectives' waits within it, mean over the ranks


@dataclass(frozen=True)
class CollectiveTime:
    """One collective over concurrent groups of ``ranks``, every rank computing between calls."""

    op: str  # all_reduce, all_gather, reduce_scatter
    ranks: int
    world: int
    bytes: int  # the buffer's
    bus_bytes: float  # what each rank moves, ring-adjusted (links.py RING_FACTOR)
    seconds: float  # per call, the loop without the collective subtracted


@dataclass(frozen=True)
class CPAttentionRow:
    seq: int
    scores_per_rank: float
    seconds: float  # the cp attention's forward + backward on the rank's s/n positions, mean over ranks
    fused_s: float  # the fused causal kernel's over the whole sequence, divided by n
    extra_s: float  # seconds - fused_s: what the cost model adds to the kernel it times


@dataclass(frozen=True)
class CPAttention:
    """One cp kind at one degree, at the reference's attention shape (``CP_SEQS``)."""

    heads: int
    kv_heads: int
    head_dim: int
    rows: list[CPAttentionRow]


@dataclass(frozen=True)
class PhaseSeconds:
    """Wall time of the shared run's phases (on rank 0)."""

    build: float
    rounds: float
    collectives: float
    cp_attention: float


@dataclass(frozen=True)
class SharedProfile:
    """What ``profile_shared`` measured with the host's ranks together."""

    reference: ReferenceAlone
    loaded: dict[str, Loaded]  # by str(k), k > 1 ranks computing
    layouts: dict[str, LayoutStep]  # by the names of ``reference_layouts``
    collectives: list[CollectiveTime]
    cp_attention: dict[str, CPAttention]  # by "kind/degree"
    seconds: PhaseSeconds


@dataclass(frozen=True)
class AloneRatios:
    """``profile_alone_ratios``: the reference alone, other ways of running it over one pass."""

    split_backward_ratio: float
    short_micro_batches_ratio: float
    short_pieces: int
