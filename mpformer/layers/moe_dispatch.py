"""Token dispatchers for mixture-of-experts: each token's k expert slots to the ranks that hold those
experts, and the experts' outputs back (Megatron's token_dispatcher.py, as three small classes).

Shape legend:

    T   tokens on this rank             k   expert slots per token (top-k)     S = T*k slots, token-major
    h   hidden size                     E   experts in all                     El = E / ep experts per rank
    ep  ranks of the expert-parallel group (``comm.size``; rank r holds experts [r*El, (r+1)*El))
    M   rows this rank's experts process (the slots routed to them from every ep rank)

Every dispatcher has ``dispatch(x_th, expert_tk) -> (x_mh, counts)`` and ``combine(y_mh) -> y_sh``
(``TokenDispatcher``); combine undoes the latest dispatch. An id of ``E`` is a slot dropped by the
capacity factor (layers/moe.py): it goes nowhere and comes back as a zero row. The rows of ``x_mh`` are grouped by local
expert (``counts[e]`` rows for expert e after those of experts < e), and within an expert ordered by
source rank, then in the source's token-major slot order: the same rows in the same order from both
distributed dispatchers, which differ only in what they send::

    LocalDispatcher      ep = 1: a stable sort of the slots by expert; combine is the inverse permutation
    AllToAllDispatcher   sort by global expert; all-to-all the counts [ep, El] (then a host copy); all-to-all
                         the rows with those splits; regroup by local expert. Sends ~ (ep-1)/ep S h each way
    AllGatherDispatcher  all-gather tokens and choices, keep the slots of this rank's experts; combine
                         scatters them into zeros [ep*S, h] and reduce-scatters. Sends (ep-1)(T + S) h
                         whatever the routing: Megatron's choice at small ep

Autograd: each dispatch and combine is one function whose backward calls its dual (parallel/comm.py's
pairs): the all-to-all dispatch's backward is combine's exchange (splits reversed, then the k slots of
a token summed) and combine's backward is dispatch's exchange; the all-gather dispatch's backward is
a scatter-add and reduce-scatter, the reduce-scatter combine's an all-gather and select.

What each rank sends per step is ``dispatch_bytes`` (uniform routing) or ``alltoall_bytes`` (actual
counts): the formulas the communication ledger must equal.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mpformer.parallel.comm import Comm
from mpformer.parallel.device import host_ints, host_tensor

ID_BYTES = 8  # expert ids and counts travel as int64


class TokenDispatcher(Protocol):
    def dispatch(self, x_th: torch.Tensor, expert_tk: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """x_th [T, h] this rank's tokens; expert_tk [T, k] int64 global expert ids. Returns x_mh [M, h], the
        rows of this rank's local experts grouped by local expert, and counts (len El) rows per local expert."""
        ...

    def combine(self, y_mh: torch.Tensor) -> torch.Tensor:
        """y_mh [M, h] the experts' outputs in dispatch's order -> [S, h], row t*k + j token t's j-th slot."""
        ...


def _check(x_th: torch.Tensor, expert_tk: torch.Tensor) -> tuple[int, int]:
    """(T, k); ValueError on bad shapes (the ids' range is checked from the dispatch's one host read)."""
    if x_th.dim() != 2 or expert_tk.dim() != 2 or expert_tk.shape[0] != x_th.shape[0]:
        raise ValueError(f"dispatch needs x_th [T, h] and expert_tk [T, k], got {list(x_th.shape)} and "
                         f"{list(expert_tk.shape)}")
    return expert_tk.shape[0], expert_tk.shape[1]


def histogram(ids: torch.Tensor, bins: int) -> torch.Tensor:
    """[bins] int64: how many of ``ids`` (in [0, bins)) equal each value, on their device. A scatter-add, not
    ``torch.bincount``: that reads its input's max on the host on CUDA and has no meta kernel (a rehearsal)."""
    return torch.zeros(bins, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def _ids_and_bad(expert_s: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids clamped into [0, E], the count [1] of ids outside it): the count travels with the dispatch's one
    host read, which raises on it (``_raise_bad``)."""
    bad = ((expert_s < 0) | (expert_s > num_experts)).sum().view(1)
    return expert_s.clamp(0, num_experts), bad


def _raise_bad(bad: int, num_experts: int) -> None:
    if bad:
        raise ValueError(f"expert ids must lie in [0, {num_experts}] ({num_experts}: dropped); {bad} do not")


def uniform_counts(slots: int, num_experts: int) -> list[int]:
    """Uniform routing, the stand-in of a rehearsal's host reads (parallel/device.py ``host_ints``): ``slots``
    spread over the experts as evenly as integers go (the first ``slots % E`` take one more), none dropped."""
    base, extra = divmod(slots, num_experts)
    return [base + (e < extra) for e in range(num_experts)]


def _sort_by_expert(expert_s: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [S]: the slots sorted by expert, stable, so token-major within one; counts [E+1] per expert,
    the last the dropped slots (id E), which sort last; bad [1]: ids outside [0, E]). Cut ``order`` to its
    routed R = S - dropped rows once the host has the counts."""
    ids, bad = _ids_and_bad(expert_s, num_experts)
    order = torch.sort(ids, stable=True).indices
    return order, histogram(ids, num_experts + 1), bad


def _unsort(y_rh: torch.Tensor, order: torch.Tensor, unsort: torch.Tensor | None, slots: int) -> torch.Tensor:
    """Rows in ``order``'s slot order back to all ``slots`` slots (dropped ones zero)."""
    if unsort is not None:
        return y_rh[unsort]
    return y_rh.new_zeros((slots, y_rh.shape[1])).index_copy(0, order, y_rh)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _local_experts(num_experts: int, ep: int) -> int:
    if num_experts < 1 or num_experts % ep:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of the ep group's {ep} ranks")
    return num_experts // ep


class LocalDispatcher:
    """ep = 1: every expert is local; dispatch is a stable sort of the slots by expert (exactly a permutation)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = self.num_local_experts = _local_experts(num_experts, 1)
        self.first_expert = 0
        self._order: torch.Tensor | None = None
        self._unsort: torch.Tensor | None = None

    def dispatch(self, x_th: torch.Tensor, expert_tk: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        _, k = _check(x_th, expert_tk)
        E, S = self.num_experts, expert_tk.numel()
        order, counts, bad = _sort_by_expert(expert_tk.reshape(-1), E)
        # the one host read: the counts (the GEMMs' group sizes), the dropped slots, the bad ids
        host = host_ints(torch.cat([counts, bad]), lambda: [*uniform_counts(S, E), 0, 0])
        _raise_bad(host[E + 1], E)
        order = order[:S - host[E]]
        self._order, self._slots = order, S
        self._unsort = _inverse(order) if order.numel() == S else None
        return x_th[order // k], host[:E]

    def combine(self, y_mh: torch.Tensor) -> torch.Tensor:
        assert self._order is not None, "combine before dispatch"
        return _unsort(y_mh, self._order, self._unsort, self._slots)


# ---- all-to-all ------------------------------------------------------------------------------------
class _AllToAllRoute:
    """One dispatch's plan: sorted slots -> all-to-all with splits ``send`` -> ``recv`` -> regrouped rows."""

    def __init__(self, comm: Comm, order: torch.Tensor, k: int, tokens: int, send: list[int],
                 recv_se: list[list[int]]) -> None:
        """``send`` and ``recv_se`` are host lists (all_to_all_single takes its splits there)."""
        self.comm, self.order, self.tokens, self.slots = comm, order, tokens, tokens * k
        self.token = order // k  # [R] the token of each sorted slot
        self.unsort = _inverse(order) if order.numel() == self.slots else None  # None: some slots dropped
        self.send, self.recv = send, [sum(row) for row in recv_se]
        self.regroup = _regroup(host_tensor(recv_se, torch.int64, order.device), sum(self.recv))
        self.ungroup = _inverse(self.regroup)

    def to_experts(self, rows_sh: torch.Tensor) -> torch.Tensor:
        """[S, h] sorted by global expert -> [M, h] grouped by local expert."""
        return self.comm.all_to_all_single(rows_sh, self.send, self.recv)[self.regroup]

    def from_experts(self, y_mh: torch.Tensor) -> torch.Tensor:
        """[M, h] grouped by local expert -> [S, h] back on their source ranks, sorted by global expert."""
        return self.comm.all_to_all_single(y_mh[self.ungroup], self.recv, self.send)


def _regroup(cnt_se: torch.Tensor, total: int) -> torch.Tensor:
    """Received rows arrive by source rank s, then local expert e (cnt_se [ep, El] rows each, ``total`` M in
    all, known to the host); the index [M] that orders them by e, then s (each block keeping its order)."""
    flat = cnt_se.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(cnt_se).t().reshape(-1)  # block starts, expert-major
    sizes = cnt_se.t().reshape(-1)
    first = torch.cumsum(sizes, 0) - sizes  # where each block lands in the output
    return torch.repeat_interleave(starts - first, sizes, output_size=total) + torch.arange(total, device=flat.device)


class _AllToAllDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_th, route):
        ctx.route = route
        return route.to_experts(x_th[route.token])

    @staticmethod
    def backward(ctx, g_mh):
        r = ctx.route
        rows = r.from_experts(g_mh.contiguous())  # combine's exchange
        return rows.new_zeros((r.tokens, rows.shape[1])).index_add_(0, r.token, rows), None


class _AllToAllCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_mh, route):
        ctx.route = route
        return _unsort(route.from_experts(y_mh.contiguous()), route.order, route.unsort, route.slots)

    @staticmethod
    def backward(ctx, g_sh):
        return ctx.route.to_experts(g_sh[ctx.route.order]), None  # dispatch's exchange (dropped slots: none)


class AllToAllDispatcher:
    """Experts over the ``comm`` group (ep ranks, El consecutive experts each); rows move by all-to-all."""

    def __init__(self, comm: Comm, num_experts: int) -> None:
        self.comm, self.num_experts = comm, num_experts
        self.num_local_experts = _local_experts(num_experts, comm.size)
        self.first_expert = comm.rank * self.num_local_experts
        self._route: _AllToAllRoute | None = None

    def dispatch(self, x_th: torch.Tensor, expert_tk: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        T, k = _check(x_th, expert_tk)
        E, S, ep, el = self.num_experts, expert_tk.numel(), self.comm.size, self.num_local_experts
        order, counts, bad = _sort_by_expert(expert_tk.reshape(-1), E)
        # The counts first: row j of [ep, El] is what this rank sends rank j, per expert of rank j; after the
        # exchange row s is what rank s sends here. all_to_all_single takes its splits on the host, so they
        # are copied there with the send splits, the dropped slots and the bad ids: the dispatch's one host
        # read (a sync per layer, as in Megatron; the grouped GEMM's group sizes come with it).
        counts_se = counts[:E].view(ep, el)
        recv_se = self.comm.all_to_all(counts_se, 0, 0)
        packed = torch.cat([recv_se.reshape(-1), counts_se.sum(1), counts[E:], bad])

        def uniform() -> list[int]:  # every rank routes alike: rank s sends here what this rank sends rank r
            u = uniform_counts(S, E)
            mine = u[self.first_expert:self.first_expert + el]
            return [*mine * ep, *(sum(u[j * el:(j + 1) * el]) for j in range(ep)), 0, 0]

        host = host_ints(packed, uniform)
        _raise_bad(host[-1], E)
        recv = [host[s * el:(s + 1) * el] for s in range(ep)]
        send, dropped = host[ep * el:ep * el + ep], host[-2]
        self._route = route = _AllToAllRoute(self.comm, order[:S - dropped], k, T, send, recv)
        return _AllToAllDispatch.apply(x_th, route), [sum(row[e] for row in recv) for e in range(el)]

    def combine(self, y_mh: torch.Tensor) -> torch.Tensor:
        assert self._route is not None, "combine before dispatch"
        return _AllToAllCombine.apply(y_mh, self._route)


# ---- all-gather ------------------------------------------------------------------------------------
class _AllGatherRoute:
    """One dispatch's plan: ``keep`` [M], the slots of the gathered [ep*S] that go to this rank's experts."""

    def __init__(self, comm: Comm, keep: torch.Tensor, k: int, tokens: int) -> None:
        self.comm, self.keep, self.token, self.tokens, self.slots = comm, keep, keep // k, tokens, tokens * k


class _AllGatherDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_th, route):
        ctx.route = route
        return route.comm.all_gather(x_th.contiguous(), 0)[route.token]

    @staticmethod
    def backward(ctx, g_mh):
        r = ctx.route
        buf = g_mh.new_zeros((r.comm.size * r.tokens, g_mh.shape[1])).index_add_(0, r.token, g_mh)
        return r.comm.reduce_scatter(buf, 0), None


class _AllGatherCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_mh, route):
        ctx.route = route
        buf = y_mh.new_zeros((route.comm.size * route.slots, y_mh.shape[1])).index_copy_(0, route.keep, y_mh)
        return route.comm.reduce_scatter(buf, 0)  # one rank's row and zeros: exact

    @staticmethod
    def backward(ctx, g_sh):
        return ctx.route.comm.all_gather(g_sh.contiguous(), 0)[ctx.route.keep], None


class AllGatherDispatcher:
    """Experts over the ``comm`` group; every rank sees every token (T equal on all ep ranks)."""

    def __init__(self, comm: Comm, num_experts: int) -> None:
        self.comm, self.num_experts = comm, num_experts
        self.num_local_experts = _local_experts(num_experts, comm.size)
        self.first_expert = comm.rank * self.num_local_experts
        self._route: _AllGatherRoute | None = None

    def dispatch(self, x_th: torch.Tensor, expert_tk: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        T, k = _check(x_th, expert_tk)
        E, el, ep = self.num_experts, self.num_local_experts, self.comm.size
        ids, bad = _ids_and_bad(expert_tk.reshape(-1), E)
        expert_n = self.comm.all_gather(ids.contiguous(), 0)  # [ep*S], source rank major
        # each slot's local expert, or el for another rank's (and dropped) slots: sorted stably, this rank's
        # come first, by local expert, then source rank, then slot (no nonzero: its size is a host read)
        local = expert_n - self.first_expert
        local = torch.where((local >= 0) & (local < el), local, torch.full_like(local, el))
        order = torch.sort(local, stable=True).indices
        # the one host read: the rows per local expert, and the bad ids
        host = host_ints(torch.cat([histogram(local, el + 1)[:el], bad]),
                         lambda: [ep * c for c in uniform_counts(T * k, E)[self.first_expert:self.first_expert + el]]
                         + [0])
        _raise_bad(host[el], E)
        counts = host[:el]
        self._route = route = _AllGatherRoute(self.comm, order[:sum(counts)], k, T)
        return _AllGatherDispatch.apply(x_th, route), counts

    def combine(self, y_mh: torch.Tensor) -> torch.Tensor:
        assert self._route is not None, "combine before dispatch"
        return _AllGatherCombine.apply(y_mh, self._route)


DISPATCHERS = ("alltoall", "allgather")  # core/layout.py EP_DISPATCHERS


def build_dispatcher(kind: str, comm: Comm, num_experts: int) -> TokenDispatcher:
    """The dispatcher parallel.ep_dispatcher names over the ep group ``comm`` (ep = 1: LocalDispatcher)."""
    if kind not in DISPATCHERS:
        raise ValueError(f"parallel.ep_dispatcher={kind!r} is unknown; valid: {', '.join(DISPATCHERS)}")
    if comm.size == 1:
        return LocalDispatcher(num_experts)
    return AllToAllDispatcher(comm, num_experts) if kind == "alltoall" else AllGatherDispatcher(comm, num_experts)


# ---- bytes ---------------------------------------------------------------------------------------
def dispatch_bytes(kind: str, tokens: int, k: int, hidden: int, ep: int, itemsize: int, *,
                   num_experts: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per layer, as the ledger counts them (parallel/comm.py), for T = ``tokens``
    per rank and S = T*k slots of ``itemsize``-byte rows of ``hidden``:

        alltoall (uniform routing: (ep-1)/ep of the slots leave the rank; exact: alltoall_bytes)
            dispatch   (ep-1)/ep S h b  +  (ep-1) El 8     (the rows, and the [ep, El] int64 counts)
            combine    (ep-1)/ep S h b
            backward   2 (ep-1)/ep S h b                   (each exchange once more, reversed)
        allgather (exact, whatever the routing)
            dispatch   (ep-1) T h b  +  (ep-1) S 8         (all-gather of tokens and of int64 expert ids)
            combine    (ep-1) S h b                        (reduce-scatter of [ep S, h])
            backward   (ep-1) T h b  +  (ep-1) S h b       (reduce-scatter of [ep T, h], all-gather of [S, h])

    The counts term needs ``num_experts`` (left out, 0, when None). Returns dispatch, combine, forward
    (their sum) and backward."""
    row, slots = hidden * itemsize, tokens * k
    if kind == "alltoall":
        moved = slots * (ep - 1) / ep * row
        counts = (ep - 1) * (num_experts // ep) * ID_BYTES if num_experts else 0
        dispatch, combine, backward = moved + counts, moved, 2 * moved
    elif kind == "allgather":
        dispatch = (ep - 1) * (tokens * row + slots * ID_BYTES)
        combine = (ep - 1) * slots * row
        backward = (ep - 1) * (tokens + slots) * row
    else:
        raise ValueError(f"dispatch_bytes: kind={kind!r} is unknown; valid: {', '.join(DISPATCHERS)}")
    return {"dispatch": dispatch, "combine": combine, "forward": dispatch + combine, "backward": backward}


def alltoall_bytes(send_counts_rows: list[int], hidden: int, itemsize: int, *, rank: int) -> int:
    """Bytes one row exchange sends from ``rank``, which sends ``send_counts_rows[j]`` rows to rank j: the rows
    to other ranks, ``(sum - send_counts_rows[rank]) * hidden * itemsize``. The ledger's all_to_all bytes of
    an AllToAllDispatcher step are, with ``send`` the rows per destination rank and ``recv`` per source:

        forward    alltoall_bytes(send) + alltoall_bytes(recv) + (ep-1) El 8   (dispatch, combine, counts)
        backward   alltoall_bytes(recv) + alltoall_bytes(send)                 (dispatch's, combine's duals)
    """
    return (sum(send_counts_rows) - send_counts_rows[rank]) * hidden * itemsize
