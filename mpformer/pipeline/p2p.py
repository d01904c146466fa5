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
    ``wait`` returns."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self.works, self.tensors = works, tensors
        self.done = not works

    def wait(self) -> None:
        if not self.done:
            for work in self.works:
                work.wait()
            self.done, self.tensors = True, []


class P2P:
    def __init__(self, group: dist.ProcessGroup, ledger: CommLedger, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.group, self.ledger = group, ledger
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

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
            ops.append(dist.P2POp(dist.isend, t, group=self.group, group_peer=peer))
            self.ledger.record("pp.send", t.numel() * t.element_size())
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=peer) for peer, t in recvs]
        works = list(dist.batch_isend_irecv(ops)) if ops else []
        if len(works) != len(ops):  # a coalesced backend (NCCL) returns one work for the whole group
            return Pending(works, sent), [Pending(works, [t]) for _, t in recvs]
        n = len(sends)
        return Pending(works[:n], sent), [Pending([w], [t]) for w, (_, t) in zip(works[n:], recvs)]
