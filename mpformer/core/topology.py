"""Pure rank <-> coordinate math for the 4-D layout. No torch.distributed here.

Ranks are laid out in the order tp-cp-dp-pp with tp fastest (Megatron's order): the ranks of one
tensor-parallel group are consecutive, so they share a node (NVLink) whenever tp <= GPUs per node,
and pipeline stages are the slowest dimension, crossing nodes first.

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

# Fastest-varying first.
DIMS: tuple[str, ...] = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for d in DIMS:
            if getattr(self, d) < 1:
                raise ValueError(f"{d}={getattr(self, d)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': i, 'cp': j, 'dp': k, 'pp': l} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        out, rest = {}, rank
        for d in DIMS:
            out[d] = rest % getattr(self, d)
            rest //= getattr(self, d)
        return out

    def rank(self, **coords: int) -> int:
        """Global rank of the given coordinates (missing dims are 0)."""
        unknown = set(coords) - set(DIMS)
        if unknown:
            raise ValueError(f"unknown dims {sorted(unknown)}; valid: {', '.join(DIMS)}")
        r, stride = 0, 1
        for d in DIMS:
            c = coords.get(d, 0)
            if not 0 <= c < getattr(self, d):
                raise ValueError(f"{d} coordinate {c} outside [0, {getattr(self, d)})")
            r += c * stride
            stride *= getattr(self, d)
        return r

    def groups(self, *dims: str) -> list[list[int]]:
        """All groups that vary along ``dims`` (others fixed), each a rank list in ascending order.

        ``groups("tp")`` are the tensor-parallel groups; ``groups("dp", "cp")`` the groups over
        which gradients are reduced once context parallelism exists.
        """
        for d in dims:
            if d not in DIMS:
                raise ValueError(f"unknown dim {d!r}; valid: {', '.join(DIMS)}")
        fixed = [d for d in DIMS if d not in dims]
        out = []
        for fixed_vals in itertools.product(*(range(getattr(self, d)) for d in fixed)):
            base = dict(zip(fixed, fixed_vals))
            ranks = [self.rank(**base, **dict(zip(dims, vals)))
                     for vals in itertools.product(*(range(getattr(self, d)) for d in dims))]
            out.append(sorted(ranks))
        return sorted(out)

    def group_of(self, rank: int, *dims: str) -> list[int]:
        """The group along ``dims`` that contains ``rank``."""
        for g in self.groups(*dims):
            if rank in g:
                return g
        raise AssertionError("unreachable: every rank belongs to one group per dim set")
