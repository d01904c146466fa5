"""ProcessGroups: the communicators of one layout, built once and passed explicitly (no globals).

Built on torch's DeviceMesh over every registered mesh dimension, slowest first (core/topology.py
MESH_DIMS reversed: ("pp", "dp", "cp", "tp") today) so that tp varies fastest, the same order as the
topology's rank math (checked at construction); then one group per named view (MESH_VIEWS: "data",
dp x cp; "ep" and "expert_data", carved from dp x cp by parallel.ep; "expert_cp"). A new dimension or view is an
entry there, not a change here. Views with the same rank lists share one process group; a view whose
groups are all single ranks and match no dimension's has none (its Comm is a group of one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mpformer.core.layout import ParallelLayout
from mpformer.core.topology import MESH_VIEWS, Topology, dim_names
from mpformer.parallel.comm import Comm, CommLedger
from mpformer.parallel.device import Device
from mpformer.parallel.random import TPRandom
from mpformer.parallel.tensor_parallel import TPContext


@dataclass
class ProcessGroups:
    """One process group per mesh dimension and per view, plus this rank's coordinates."""

    layout: ParallelLayout
    device: Device
    mesh: DeviceMesh
    rank: int
    coords: dict[str, int]
    ledger: CommLedger = field(default_factory=CommLedger)
    # view name -> this rank's group (None: a group of one rank)
    views: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)

    @property
    def data_group(self) -> dist.ProcessGroup:
        """dp x cp (the dp group when cp == 1): the "data" view."""
        g = self.views["data"]
        return self.group("dp") if g is None else g

    @classmethod
    def build(cls, layout: ParallelLayout, device: Device) -> ProcessGroups:
        """Create the groups; torch.distributed must be initialised with world size = layout's."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        topo = layout.topology
        world = dist.get_world_size()
        if world != topo.world_size:
            raise RuntimeError(f"layout needs {topo.world_size} ranks but the world has {world}")
        names = dim_names()[::-1]  # slowest first
        mesh = init_device_mesh(device.kind, tuple(topo.size(d) for d in names), mesh_dim_names=names)
        rank = dist.get_rank()
        groups = cls(layout=layout, device=device, mesh=mesh, rank=rank, coords=topo.coords(rank))
        made: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup | None] = {}  # rank lists -> this rank's group
        for view in MESH_VIEWS.values():  # every rank creates every group, in the same order
            lists = view.rank_lists(topo, layout)
            key = tuple(map(tuple, lists))
            if key not in made:
                # A mesh dimension's own groups (a fold whose other dims are of size 1; single ranks where
                # some dim has size 1) reuse its group; single ranks otherwise get none.
                same = next((d for d in (*view.dims, *names[::-1]) if d in names and topo.groups(d) == lists), None)
                if same is not None:
                    made[key] = mesh.get_group(same)
                else:
                    made[key] = None if all(len(g) == 1 for g in lists) else _new_groups(lists, rank)
            groups.views[view.name] = made[key]
        groups._check_against_topology(topo)
        return groups

    def _check_against_topology(self, topo: Topology) -> None:
        for d in dim_names():
            expected = topo.group_of(self.rank, d)
            got = sorted(dist.get_process_group_ranks(self.group(d)))
            assert got == expected, f"{d} group {got} != topology {expected}"
        for name, view in MESH_VIEWS.items():
            expected = next(g for g in view.rank_lists(topo, self.layout) if self.rank in g)
            g = self.views[name]
            got = [self.rank] if g is None else sorted(dist.get_process_group_ranks(g))
            assert got == expected, f"view {name} group {got} != topology {expected}"

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh.get_group(dim)

    def comm(self, dim: str) -> Comm:
        """A byte-counting communicator over ``dim``; all of them write to ``self.ledger``."""
        return Comm(self.group(dim), self.ledger, tag=f"{dim}.")

    def view(self, name: str) -> Comm:
        """A byte-counting communicator over the named view (core/topology.py MESH_VIEWS)."""
        if name not in self.views:
            raise KeyError(f"mesh view {name!r} is unknown; valid: {', '.join(self.views)}")
        return Comm(self.views[name], self.ledger, tag=MESH_VIEWS[name].tag)

    def view_replicas(self, name: str) -> int:
        """How many data replicas the named view's group holds: the divisor that makes its sum a mean."""
        return MESH_VIEWS[name].replicas(self.layout.topology)

    def data_comm(self) -> Comm:
        """Over what gradients of replicated weights are reduced and ZeRO shards: dp x cp (the cp ranks
        of a replica each hold part of its sequence), and metrics summed over both."""
        return self.view("data")

    def dropout_offset(self) -> int:
        """Added to the seed of this rank's dropout streams: distinct for every (cp, dp, pp) coordinate
        (tp ranks share the default stream; the tp-rank stream adds its tp rank). Megatron's offsets,
        10 per data replica, with the stages after every replica, so no two ranks collide."""
        L, c = self.layout, self.coords
        return 10 * (c["cp"] + L.cp * (c["dp"] + L.dp * c["pp"]))

    def cp_subgroups(self, ulysses: int) -> tuple[Comm, Comm]:
        """(all-to-all group, ring group) for hybrid context parallelism: ``ulysses`` consecutive cp
        ranks exchange heads, and the ranks at the same place in each such block form a ring.
        Collective: every rank creates every group, in the same order."""
        blocks, rings = [], []
        for cp_ranks in self.layout.topology.groups("cp"):  # ascending global rank = ascending cp rank
            blocks += [cp_ranks[i:i + ulysses] for i in range(0, len(cp_ranks), ulysses)]
            rings += [cp_ranks[u::ulysses] for u in range(ulysses)]
        return (Comm(_new_groups(blocks, self.rank), self.ledger, tag="cp.ulysses."),
                Comm(_new_groups(rings, self.rank), self.ledger, tag="cp.ring."))

    def embedding_comm(self) -> Comm | None:
        """The first and last pipeline stage of this rank's pp group (they hold the two copies of a
        tied embedding), or None when this rank holds neither or pp == 1. Collective."""
        topo, mine = self.layout.topology, None
        if topo.pp == 1:
            return None
        for pp_ranks in topo.groups("pp"):
            pair = [pp_ranks[0], pp_ranks[-1]]
            g = dist.new_group(pair)
            if self.rank in pair:
                mine = Comm(g, self.ledger, tag="pp.embedding.")
        return mine

    def tp_context(self, kv_replicas: int = 1, seed: int = 0) -> TPContext:
        """The tensor-parallel context; with ``kv_replicas`` > 1 (tp exceeds the kv heads), also the
        groups of consecutive tp ranks that share a kv head. Collective: every rank calls it."""
        ctx = TPContext(self.comm("tp"), sequence_parallel=self.layout.sequence_parallel,
                        rng=TPRandom(seed + self.dropout_offset(), self.coords["tp"], self.device))
        if kv_replicas > 1:
            topo, mine = self.layout.topology, []
            for tp_ranks in topo.groups("tp"):  # every rank creates every group, in the same order
                for i in range(0, len(tp_ranks), kv_replicas):
                    block = tp_ranks[i:i + kv_replicas]
                    g = dist.new_group(block)
                    if self.rank in block:
                        mine.append(Comm(g, self.ledger, tag="tp."))
            ctx.replica_comms[kv_replicas] = mine[0]
        return ctx

    def size(self, dim: str) -> int:
        return self.mesh.size(self.mesh.mesh_dim_names.index(dim))

    @property
    def dp(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def tp(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def pp(self) -> dist.ProcessGroup:
        return self.group("pp")

    @property
    def cp(self) -> dist.ProcessGroup:
        return self.group("cp")

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 logs, shows the progress bar and talks to wandb."""
        return self.rank == 0


def _new_groups(rank_lists: list[list[int]], rank: int) -> dist.ProcessGroup:
    """Create a group for each rank list (every rank creates every one, in order); return ``rank``'s."""
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    assert mine is not None, f"rank {rank} is in none of {rank_lists}"
    return mine
