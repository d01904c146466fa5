"""Tensor-parallel bookkeeping: the TP context, how fused projections are cut, and gradient specs.

Shard rules (t = tp size, rank r):

* a split part of R rows (q heads, gate, up, ffn, vocabulary) gives rank r rows
  ``[r*R/t, (r+1)*R/t)``;
* a part of H heads with t > H (kv heads under GQA) cannot be split; each head is replicated on
  t/H consecutive ranks: rank r holds head ``r // (t/H)``, the one its query heads attend with.

Fused projections hold their parts' local rows back to back (``[q_r | k_r | v_r]``,
``[gate_r | up_r]``), so each rank's slice of every part is contiguous and the fused matmul needs no
gather. Which parameters need a gradient all-reduce over tp, and how many tp ranks hold an
identical copy (for the global gradient norm), is described by one :class:`GradSpec` per row block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mpformer.parallel.comm import Comm
from mpformer.parallel.random import TPRandom


def kv_replicas(tp_size: int, kv_heads: int) -> int:
    """How many tp ranks share each kv head (1 when tp divides the kv heads)."""
    return tp_size // kv_heads if tp_size > kv_heads else 1


def vocab_block(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(start, rows, valid rows) of this rank's vocabulary block: the vocabulary is padded to a
    multiple of tp; the padding rows (rows - valid of them, on the last ranks) hold no token."""
    rows = -(-vocab_size // tp_size)
    start = tp_rank * rows
    return start, rows, max(0, min(rows, vocab_size - start))


@dataclass
class TPContext:
    """What tensor-parallel layers need, passed explicitly: the tp communicator, whether sequence
    parallelism is on, and the communicators of kv-head replica groups (by replica count)."""

    comm: Comm
    sequence_parallel: bool = False
    replica_comms: dict[int, Comm] = field(default_factory=dict)  # replicas -> this rank's replica group
    rng: TPRandom | None = None  # dropout stream for tensors that differ per tp rank

    def fork_rng(self, active: bool = True) -> contextlib.AbstractContextManager:
        """The tp-rank dropout stream around a region whose tensors differ per rank (if ``active``)."""
        return self.rng.fork() if active and self.rng is not None else contextlib.nullcontext()

    def checkpoint_context_fn(self) -> Callable | None:
        """For torch.utils.checkpoint: replay the tp-rank stream on recompute."""
        return self.rng.checkpoint_contexts if self.rng is not None else None

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def replica_comm(self, replicas: int) -> Comm:
        """The communicator of the ``replicas`` consecutive tp ranks that hold the same kv head as us."""
        return self.replica_comms[replicas]


@dataclass(frozen=True)
class Part:
    """One logical block of a (possibly fused) projection's output rows."""

    name: str  # canonical suffix: "q", "k", "v", "gate", "up", ...
    rows: int  # global rows
    head_dim: int = 0  # >0: the part is heads of this size, replicated when tp exceeds the head count

    def heads(self) -> int:
        return self.rows // self.head_dim if self.head_dim else 0

    def replicas(self, t: int) -> int:
        """How many tp ranks hold the same block of this part (1 when it splits)."""
        return kv_replicas(t, self.heads()) if self.head_dim else 1

    def block(self, r: int, t: int) -> tuple[int, int]:
        """(start row, rows) of this part on tp rank r of t."""
        reps = self.replicas(t)
        if reps > 1:
            head = r // reps
            return head * self.head_dim, self.head_dim
        if self.rows % t:
            raise ValueError(f"part {self.name} of {self.rows} rows does not split over tp={t}")
        n = self.rows // t
        return r * n, n


@dataclass
class GradSpec:
    """Rows ``rows`` of ``param`` (all rows if None): ``replicas`` tp ranks hold identical values, and
    after backward their gradients must be summed over ``sync`` (None: already complete); then they are
    reduced over the mesh view ``reduce_over`` (core/topology.py MESH_VIEWS; "data": dp x cp, where
    every dense weight goes) and ZeRO shards the parameter over it."""

    param: nn.Parameter
    rows: tuple[int, int] | None = None
    replicas: int = 1
    sync: Comm | None = None
    reduce_over: str = "data"

    def grad(self) -> torch.Tensor | None:
        g = self.param.grad
        if g is None or self.rows is None:
            return g
        return g[self.rows[0]: self.rows[1]]


def sync_tp_grads(specs: list[GradSpec]) -> None:
    """Sum partial gradients over their groups (SP-region norms and biases, replicated kv heads)."""
    for s in specs:
        g = s.grad()
        if s.sync is not None and g is not None:
            s.sync.all_reduce(g)
