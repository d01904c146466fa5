"""Pipeline plans as arithmetic: which layers each pipeline rank holds.
Pure, so that the memory and cost models and the runtime share it.

With ``pp`` ranks and ``vpp`` chunks per rank there are ``pp * vpp`` global stages; rank r's chunk
c is stage ``c * pp + r``, or in a V schedule (``V_SCHEDULES``: vpp = 2) chunk 0 is stage r and chunk 1
stage ``2 pp - 1 - r`` (pipeline/actions.py). Stage s gets ``counts[s]`` consecutive transformer
layers from ``parallel.pp_split`` (layers per stage, embedding and head not counted), an even split,
or the split balanced by compute (``parallel.pp_partition=balanced``, partition.py). Stage 0 also
holds the embedding, the last stage the final norm, the LM head and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpformer.core.layout import V_SCHEDULES, ParallelLayout
from mpformer.core.model_config import ModelConfig
from mpformer.core.partition import balanced_for


def stage_of(pp: int, rank: int, chunk: int, v: bool = False) -> int:
    """Global stage of ``rank``'s ``chunk``: ``chunk * pp + rank``, or in a V (``v``) chunk 1 is
    stage ``2 pp - 1 - rank`` (module docstring; pipeline/actions.py)."""
    return 2 * pp - 1 - rank if v and chunk == 1 else chunk * pp + rank


def rank_chunk(pp: int, stage: int, v: bool = False) -> tuple[int, int]:
    """The (rank, chunk) that holds global ``stage``: the inverse of ``stage_of``."""
    if v and stage >= pp:
        return 2 * pp - 1 - stage, 1
    return stage % pp, stage // pp


@dataclass(frozen=True)
class StagePlan:
    pp: int
    vpp: int
    rank: int
    chunk_layers: tuple[tuple[int, ...], ...]  # global layer ids of each local chunk
    v: bool = False  # the V placement: chunk 1 is stage 2 pp - 1 - rank

    @property
    def layer_ids(self) -> list[int]:
        return [i for chunk in self.chunk_layers for i in chunk]

    def stage(self, chunk: int) -> int:
        return stage_of(self.pp, self.rank, chunk, self.v)

    @property
    def has_embedding(self) -> bool:
        return self.rank == 0

    @property
    def has_head(self) -> bool:
        return any(self.is_last(c) for c in range(self.vpp))

    def is_first(self, chunk: int) -> bool:
        return self.stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.stage(chunk) == self.pp * self.vpp - 1

    def local_stage(self, stage: int) -> int | None:
        """The local chunk that holds global ``stage``, or None: at a V's turn the neighbouring stage is
        on this rank and the activation (or its gradient) hands over in memory."""
        return next((c for c in range(self.vpp) if self.stage(c) == stage), None)

    def local_indices(self, chunk: int) -> range:
        """Positions of the chunk's layers in the rank's module list."""
        start = sum(len(c) for c in self.chunk_layers[:chunk])
        return range(start, start + len(self.chunk_layers[chunk]))


def stage_index(layout: ParallelLayout, rank: int, chunk: int) -> int:
    """Global stage of pipeline ``rank``'s ``chunk`` under the layout's schedule (module docstring)."""
    return stage_of(layout.pp, rank, chunk, layout.schedule in V_SCHEDULES)


def rank_ends(layout: ParallelLayout, rank: int) -> tuple[bool, bool]:
    """Whether pipeline ``rank`` holds the embedding (stage 0) and the head (the last stage)."""
    last = layout.pp * layout.vpp - 1
    return rank == 0, any(stage_index(layout, rank, c) == last for c in range(layout.vpp))


def stage_counts(cfg: ModelConfig, layout: ParallelLayout, seq_length: int) -> list[int]:
    """Transformer layers per global stage (validate() has checked the split or the divisibility)."""
    stages = layout.pp * layout.vpp
    if layout.pp_split is not None:
        return list(layout.pp_split)
    if layout.pp_partition == "balanced":
        return balanced_for(cfg, stages, seq_length)
    return [cfg.num_layers // stages] * stages


def stage_plan(cfg: ModelConfig, layout: ParallelLayout, pp_rank: int, seq_length: int) -> StagePlan:
    """Rank ``pp_rank``'s chunks; ``seq_length`` prices attention when the partition is balanced."""
    counts = stage_counts(cfg, layout, seq_length)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    chunks = []
    for c in range(layout.vpp):
        s = stage_index(layout, pp_rank, c)
        chunks.append(tuple(range(starts[s], starts[s] + counts[s])))
    return StagePlan(layout.pp, layout.vpp, pp_rank, tuple(chunks), layout.schedule in V_SCHEDULES)
