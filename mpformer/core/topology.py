"""Pure rank <-> coordinate math for the mesh, whose dimensions are data. No torch.distributed here.

A mesh dimension is a name, what it shards, and how a layout sizes it (``MeshDim``); ``MESH_DIMS``
lists them fastest-varying first. Ranks are laid out in the order tp-cp-dp-pp with tp fastest
(Megatron's order): the ranks of one tensor-parallel group are consecutive, so they share a node
(NVLink) whenever tp <= GPUs per node, and pipeline stages are the slowest dimension, crossing nodes
first.

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

A new dimension is one ``register_dim`` (with where it goes in the order); a group folded over
several dimensions is a named view (``MESH_VIEWS``, ``register_view``): today "data", the dp x cp
ranks over which replicated weights' gradients are reduced and ZeRO shards them (the cp ranks of a
replica each hold part of its sequence). A group that is no product of dimensions is a ``FactorView``:
the folded ranks split by a layout factor. Expert parallelism (Megatron's) is two of them, carved from
the dp x cp ranks of each (tp, pp) slice, flattened as ``d = cp_rank + cp * dp_rank``::

    ep group           ("ep", size ep)                      ranks with equal d // ep   (ep_rank  = d % ep)
    expert-data group  ("expert_data", size dp*cp / ep)     ranks with equal d % ep    (edp_rank = d // ep)

parallel/groups.py builds one process group per dimension and per view from these lists.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MeshDim:
    """``name`` (a parallel.* key for the built-in ones), what it ``shards`` (for docs and errors),
    and ``size(layout)``: its degree in a layout (a ParallelLayout, typed loosely to stay below it)."""

    name: str
    shards: str
    size: Callable[[Any], int]


@dataclass(frozen=True)
class MeshView:
    """A group folded over ``dims`` (every rank that differs only along them); ``tag`` names its bytes
    in the communication ledger; ``partial``: the dims whose ranks hold partial sums of one replica's
    gradient rather than replicas of it (cp: each rank its part of the sequence), left out of the
    divisor that makes a reduced gradient a mean (``replicas``)."""

    name: str
    dims: tuple[str, ...]
    tag: str
    partial: tuple[str, ...] = ()
    across: str | None = None  # a view whose ranks hold this view's other parameters (FactorView)

    def replicas(self, topology: Topology) -> int:
        return math.prod(topology.size(d) for d in self.dims if d not in self.partial)

    def rank_lists(self, topology: Topology, layout: Any = None) -> list[list[int]]:
        """Every group of the view (ascending rank lists); the layout is not needed (FactorView's is)."""
        return topology.groups(*self.dims)


@dataclass(frozen=True)
class FactorView:
    """The ranks folded over ``dims`` (fastest first; flat index ``d``) split by a factor ``n`` that the
    layout gives (``factor(layout)``, the parallel.``key`` value): ``part="inner"`` groups the ``n`` ranks
    with equal ``d // n``, ``part="outer"`` the ``size / n`` ranks with equal ``d % n``. ``tag`` and
    ``partial`` as for MeshView; ``replicas`` is the whole fold's (an expert's copies over the outer part
    together see every replica's tokens, so their summed gradient divides like the dense weights')."""

    name: str
    dims: tuple[str, ...]
    key: str
    factor: Callable[[Any], int]
    part: str
    tag: str
    partial: tuple[str, ...] = ()
    across: str | None = None  # the view whose ranks hold this view's other parameters (the norm sums over it)

    def replicas(self, topology: Topology) -> int:
        return math.prod(topology.size(d) for d in self.dims if d not in self.partial)

    def rank_lists(self, topology: Topology, layout: Any) -> list[list[int]]:
        return self.groups(topology, self.factor(layout))

    def groups(self, topology: Topology, n: int) -> list[list[int]]:
        """Every group, each an ascending rank list; the other dimensions are fixed within a group."""
        sizes = [topology.size(d) for d in self.dims]
        total = math.prod(sizes)
        if not isinstance(n, int) or n < 1 or total % n:
            ok = ", ".join(str(v) for v in range(1, total + 1) if total % v == 0)
            folded = "*".join(self.dims[::-1])
            raise ValueError(f"parallel.{self.key}={n} must divide {folded} = {total} (the ranks it is carved from); "
                             f"valid: {ok}")
        out = []
        for fold in topology.groups(*self.dims):  # one per slice of the other dims, ascending global rank
            by_d: dict[int, int] = {}
            for r in fold:
                c = topology.coords(r)
                d, stride = 0, 1
                for dim, size in zip(self.dims, sizes):
                    d, stride = d + c[dim] * stride, stride * size
                by_d[d] = r
            key = (lambda d: d // n) if self.part == "inner" else (lambda d: d % n)
            parts: dict[int, list[int]] = {}
            for d in sorted(by_d):
                parts.setdefault(key(d), []).append(by_d[d])
            out += [sorted(p) for p in parts.values()]
        return sorted(out)


# Fastest-varying first.
MESH_DIMS: list[MeshDim] = [
    MeshDim("tp", "weights and, under sequence parallelism, activations by position", lambda L: L.tp),
    MeshDim("cp", "every sequence by position (attention exchanges keys and values)", lambda L: L.cp),
    MeshDim("dp", "the batch (weights replicated or, under ZeRO, their state sharded)", lambda L: L.dp),
    MeshDim("pp", "the layers, in stages", lambda L: L.pp),
]
EP_VIEW = FactorView("ep", ("cp", "dp"), "ep", lambda L: L.ep, "inner", "ep.")
EXPERT_DATA_VIEW = FactorView("expert_data", ("cp", "dp"), "ep", lambda L: L.ep, "outer", "edp.", partial=("cp",),
                              across="ep")
# The cp ranks of one cp group that hold the same experts (the float8 experts' amaxes span them): where
# ep divides cp, the cp/ep ranks with equal ep rank (= cp_rank % ep); otherwise none (single ranks): where
# cp divides ep an ep group holds whole cp groups, so an expert's owner receives every part of a sequence;
# an ep group straddling cp groups (cp=3, ep=2) casts the rows each owner receives.
EXPERT_CP_VIEW = FactorView("expert_cp", ("cp",), "ep", lambda L: L.ep if L.cp % L.ep == 0 else L.cp, "outer",
                            "ecp.")
MESH_VIEWS: dict[str, MeshView | FactorView] = {
    "data": MeshView("data", ("dp", "cp"), "dp.", partial=("cp",)),
    "ep": EP_VIEW,  # at ep=1 a group of one per rank (no process group is made)
    "expert_data": EXPERT_DATA_VIEW,  # at ep=1 the "data" view's ranks (its group is reused)
    "expert_cp": EXPERT_CP_VIEW,  # the cp group at ep=1 (reused), single ranks where ep spans cp (none made)
}


def expert_groups(topology: Topology, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups), each an ascending rank list, carved from
    the dp x cp ranks of every (tp, pp, ...) slice as Megatron does: ``d = cp_rank + cp * dp_rank``,
    ``ep_rank = d % ep``, ``edp_rank = d // ep``. ValueError if ep does not divide dp*cp."""
    return EP_VIEW.groups(topology, ep), EXPERT_DATA_VIEW.groups(topology, ep)


def dim_names() -> tuple[str, ...]:
    return tuple(d.name for d in MESH_DIMS)


def register_dim(dim: MeshDim, after: str) -> None:
    """Add a mesh dimension right after ``after`` in the fastest-first order (it varies more slowly)."""
    names = dim_names()
    if dim.name in names:
        raise ValueError(f"mesh dimension {dim.name!r} exists already; dims: {', '.join(names)}")
    if after not in names:
        raise ValueError(f"after={after!r} is not a mesh dimension; valid: {', '.join(names)}")
    MESH_DIMS.insert(names.index(after) + 1, dim)


def register_view(view: MeshView | FactorView) -> None:
    unknown = [d for d in view.dims if d not in dim_names()]
    if unknown or view.name in MESH_VIEWS:
        raise ValueError(f"mesh view {view.name!r}: unknown dims {unknown} or the name is taken; "
                         f"dims: {', '.join(dim_names())}, views: {', '.join(MESH_VIEWS)}")
    MESH_VIEWS[view.name] = view


@contextlib.contextmanager
def registered(dim: MeshDim, after: str, views: tuple[MeshView | FactorView, ...] = ()) -> Iterator[None]:
    """A dimension (and views over it) registered for the body only (tests, experiments)."""
    register_dim(dim, after)
    try:
        for v in views:
            register_view(v)
        yield
    finally:
        MESH_DIMS.remove(dim)
        for v in views:
            MESH_VIEWS.pop(v.name, None)


class Topology:
    """The sizes of every mesh dimension (missing ones are 1) and the rank math over them."""

    def __init__(self, **sizes: int) -> None:
        names = dim_names()
        unknown = set(sizes) - set(names)
        if unknown:
            raise ValueError(f"unknown dims {sorted(unknown)}; valid: {', '.join(names)}")
        self._sizes = {d: int(sizes.get(d, 1)) for d in names}
        for d, n in self._sizes.items():
            if n < 1:
                raise ValueError(f"{d}={n} must be >= 1")

    @classmethod
    def of(cls, layout: Any) -> Topology:
        """The topology of a resolved layout: each registered dimension sized by its own rule."""
        return cls(**{d.name: d.size(layout) for d in MESH_DIMS})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self._sizes == other._sizes

    def __hash__(self) -> int:
        return hash(tuple(self._sizes.items()))

    def __repr__(self) -> str:
        return "Topology(" + ", ".join(f"{d}={n}" for d, n in self._sizes.items()) + ")"

    def size(self, dim: str) -> int:
        return self._sizes[self._known(dim)]

    @property
    def tp(self) -> int:
        return self._sizes["tp"]

    @property
    def cp(self) -> int:
        return self._sizes["cp"]

    @property
    def dp(self) -> int:
        return self._sizes["dp"]

    @property
    def pp(self) -> int:
        return self._sizes["pp"]

    @property
    def world_size(self) -> int:
        n = 1
        for size in self._sizes.values():
            n *= size
        return n

    def sizes(self) -> dict[str, int]:
        """{dim: size}, fastest first."""
        return dict(self._sizes)

    def _known(self, dim: str) -> str:
        if dim not in self._sizes:
            raise ValueError(f"unknown dim {dim!r}; valid: {', '.join(self._sizes)}")
        return dim

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': i, 'cp': j, 'dp': k, 'pp': l, ...} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        out, rest = {}, rank
        for d, n in self._sizes.items():
            out[d] = rest % n
            rest //= n
        return out

    def rank(self, **coords: int) -> int:
        """Global rank of the given coordinates (missing dims are 0)."""
        unknown = set(coords) - set(self._sizes)
        if unknown:
            raise ValueError(f"unknown dims {sorted(unknown)}; valid: {', '.join(self._sizes)}")
        r, stride = 0, 1
        for d, n in self._sizes.items():
            c = coords.get(d, 0)
            if not 0 <= c < n:
                raise ValueError(f"{d} coordinate {c} outside [0, {n})")
            r += c * stride
            stride *= n
        return r

    def groups(self, *dims: str) -> list[list[int]]:
        """All groups that vary along ``dims`` (others fixed), each a rank list in ascending order.

        ``groups("tp")`` are the tensor-parallel groups; ``groups("dp", "cp")`` the groups over
        which gradients are reduced once context parallelism exists.
        """
        for d in dims:
            self._known(d)
        fixed = [d for d in self._sizes if d not in dims]
        out = []
        for fixed_vals in itertools.product(*(range(self._sizes[d]) for d in fixed)):
            base = dict(zip(fixed, fixed_vals))
            ranks = [self.rank(**base, **dict(zip(dims, vals)))
                     for vals in itertools.product(*(range(self._sizes[d]) for d in dims))]
            out.append(sorted(ranks))
        return sorted(out)

    def group_of(self, rank: int, *dims: str) -> list[int]:
        """The group along ``dims`` that contains ``rank``."""
        for g in self.groups(*dims):
            if rank in g:
                return g
        raise AssertionError("unreachable: every rank belongs to one group per dim set")
