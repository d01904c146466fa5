"""Expert parallelism's context: which experts this rank holds and whom it exchanges tokens with.

The expert-parallel group is carved from the dp x cp ranks (core/topology.py ``expert_groups``): its
``size`` ranks hold E / size experts each (rank r: experts [r E/size, (r+1) E/size)) and route their
tokens to each other (layers/moe_dispatch.py: all-to-all, or all-gather at small ep). The expert
weights' gradients then reduce over the expert-data-parallel view (dp x cp / ep ranks), where ZeRO
also shards them.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpformer.parallel.comm import Comm

DISPATCHERS = ("alltoall", "allgather")


@dataclass(frozen=True)
class EPContext:
    comm: Comm
    dispatcher: str = "alltoall"

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def local_experts(self, num_experts: int) -> range:
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)
