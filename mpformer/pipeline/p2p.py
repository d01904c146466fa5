"""Point-to-point transfers between pipeline stages, one batched group at a time.

Every message at a stage boundary is an activation or its gradient of the same known shape
``[s(/t), b, h]`` (fp32: the residual stream keeps fp32 even under autocast), so receive buffers
are allocated from the config, never negotiated. A group of adjacent communication actions is
posted with one ``batch_isend_irecv``; ``post`` returns its pending work, which the engine waits
for where a receive is consumed and, for sends, at the end of the step. Bytes sent are written to
the CommLedger under ``pp.send``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mpformer.parallel.comm import CommLedger


class Pending:
    """Outstanding work of a posted group: the tensors it reads or writes stay referenced until
    ``wait`` returns; the time ``wait`` blocks is the ledger's ``pp.wait``."""

    def __init__(self, works: list, tensors: list[torch.Tensor], ledger: CommLedger | None = None,
                 instant: bool = False) -> None:
        self.works, self.tensors, self.ledger = works, tensors, ledger
        self.done = not works
        self.instant = instant  # a rehearsal's fake transfers: done once posted (their work never says so)

    def wait(self) -> None:
        if not self.done:
            if self.ledger is None:
                self._wait_all()
            else:
                self.ledger.blocked("pp.wait", self._wait_all)
            self.done, self.tensors = True, []

    def poll(self) -> bool:
        """Whether the work is done, without waiting (NCCL: an event query, no host sync); once it is, its
        tensors are let go (a send's activation or gradient need not live to the end of the step)."""
        if not self.done and (self.instant or all(w.is_completed() for w in self.works)):
            self.done, self.tensors = True, []
        return self.done

    def _wait_all(self) -> None:
        for work in self.works:
            work.wait()


class P2P:
    def __init__(self, group: dist.ProcessGroup, ledger: CommLedger, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.group, self.ledger = group, ledger
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self._ranks = dist.get_process_group_ranks(group)

    def _global(self, peer: int) -> int:
        """P2POp's ``peer`` is a global rank in every torch the project supports (``group_peer``, a
        rank of the group, only exists from torch 2.6)."""
        return self._ranks[peer]

    def buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def post(self, sends: list[tuple[int, torch.Tensor]],
             recvs: list[tuple[int, torch.Tensor]]) -> tuple[Pending, list[Pending]]:
        """Post every send and receive of one group (peers are pp-group ranks) without waiting;
        returns the sends' pending work and one pending per receive."""
        ops = []
        sent = []
        for peer, t in sends:
            if tuple(t.shape) != self.shape or t.dtype != self.dtype:
                raise RuntimeError(f"pipeline send of {list(t.shape)} {t.dtype}, the boundary is {list(self.shape)} "
                                   f"{self.dtype}")
            t = t.contiguous()
            sent.append(t)
            ops.append(dist.P2POp(dist.isend, t, self._global(peer), self.group))
            self.ledger.record("pp.send", t.numel() * t.element_size())
        ops += [dist.P2POp(dist.irecv, t, self._global(peer), self.group) for peer, t in recvs]
        works = list(dist.batch_isend_irecv(ops)) if ops else []
        led, instant = self.ledger, self.device.type == "meta"
        if len(works) != len(ops):  # a coalesced backend (NCCL) returns one work for the whole group
            return Pending(works, sent, led, instant), [Pending(works, [t], led, instant) for _, t in recvs]
        n = len(sends)
        return (Pending(works[:n], sent, led, instant),
                [Pending([w], [t], led, instant) for w, (_, t) in zip(works[n:], recvs)])
