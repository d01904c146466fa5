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
    """``comm``: the expert-parallel group (None: ep = 1); ``dispatcher``: parallel.ep_dispatcher;
    ``etp``: expert tensor parallelism, 1 (whole experts on every tp rank, each routing its own
    tokens) or tp (each expert's ffn split over the tp ranks like the dense MLP's). ``token_peers``: the
    context-parallel ranks outside the ep group that hold the same experts (core/topology.py "expert_cp":
    the other parts of this rank's sequences reach the same experts there; None when ep spans cp)."""

    comm: Comm | None = None
    dispatcher: str = "alltoall"
    etp: int = 1
    token_peers: Comm | None = None

    @property
    def size(self) -> int:
        return self.comm.size if self.comm is not None else 1

    @property
    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0

    def local_experts(self, num_experts: int) -> range:
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)
