"""The routers' step: their losses' gradient factor, the global expert load, the selection bias, metrics.

Each MoE layer accumulates on the device what its router saw over the step's micro-batches
(layers/moe.py ``RouterStats``). After the step's forward and backward, ``RouterReport.gather`` sums
every layer's statistics over the whole world in one all-reduce of an ``[L, E + 4]`` tensor (each rank
writes the rows of its pipeline stage's layers; tp ranks that saw the same tokens count once), so the
load is the global batch's, whatever the layout. With ``model.router_bias_update_rate`` the selection
biases then move by that load (DeepSeek-V3's auxiliary-loss-free balancing) on every rank alike, before
the next step routes. ``read`` copies the step's sums to the host inside the step's reporting boundary
(parallel/host_syncs.py ``REPORT_BOUNDARY``), right after the step check's own read has waited for the
device (its all-reduce was issued after this one): a read that waits for nothing more. ``metrics`` turns
them into metrics.jsonl entries:

    moe/aux_loss, moe/z_loss      mean over sparse layers of the per-micro-batch losses (unweighted)
    moe/load_max_mean             the most loaded expert's tokens over the mean, worst layer
    moe/layer{i}/load_max_mean    the same per sparse layer
    moe/dropped                   share of routed slots dropped by the capacity factor
"""

from __future__ import annotations

import collections

import torch
from torch import nn

from mpformer.layers.moe import moe_layers, set_loss_scale
from mpformer.parallel.comm import Comm
from mpformer.parallel.host_syncs import REPORT_BOUNDARY


class RouterReport:
    """The MoE layers of this rank's model; ``world``: a communicator over every rank; ``counts``:
    whether this rank's tokens count (False on tp ranks > 0 without sequence parallelism: their
    tokens are rank 0's)."""

    def __init__(self, model: nn.Module, num_layers: int, num_experts: int, rate: float, world: Comm,
                 counts: bool) -> None:
        self.layers = moe_layers(model)
        self.shape = (num_layers, num_experts + 4)
        self.rate, self.world, self.counts = rate, world, counts
        self.pending: collections.deque[tuple[int, torch.Tensor]] = collections.deque()  # (step, sums)
        self.host: collections.deque[tuple[int, torch.Tensor]] = collections.deque()  # read, for metrics
        self.before: dict[int, list[torch.Tensor | None]] = {}  # step -> the biases before its gather

    def set_loss_scale(self, model: nn.Module, scale: float) -> None:
        set_loss_scale(model, scale)

    def begin(self, step: int) -> None:
        """Before step ``step``'s forward. The same step run again (train.overlap_validation reruns a
        step's micro-batches on settled parameters) must route as its first run did: the biases that
        run's gather moved are put back and its statistics dropped."""
        if step in self.before:
            self._restore(step)
            self.pending = collections.deque(p for p in self.pending if p[0] != step)
            self.host = collections.deque(p for p in self.host if p[0] != step)

    def undo(self, step: int) -> None:
        """Step ``step`` skipped (train.on_nan=skip): the biases as before it, as if it never routed; a
        later step already run on its biases (overlapped) forgets it ran. Its statistics stay reported."""
        if step in self.before:
            self._restore(step)
            self.pending = collections.deque(p for p in self.pending if p[0] <= step)
            self.host = collections.deque(p for p in self.host if p[0] <= step)

    def forget(self) -> None:
        """After a rollback: the checkpoint's biases are loaded and its steps run again from there."""
        self.pending.clear()
        self.host.clear()
        self.before.clear()

    def _restore(self, step: int) -> None:
        for m, b in zip(self.layers, self.before[step]):
            if b is not None:
                m.router.bias.copy_(b)
        self.before = {k: v for k, v in self.before.items() if k < step}

    def gather(self, step: int) -> None:
        """After step ``step``'s backward: its statistics summed over the world (one all-reduce), the
        selection biases moved by the global load, kept for ``metrics``."""
        dev = self.layers[0].router.weight.device if self.layers else torch.device("cpu")
        rows = torch.zeros(self.shape, device=dev)
        e = self.shape[1] - 4
        for m in self.layers:
            st = m.take_stats()
            if st is None or not self.counts:
                continue
            r = rows[m.layer]
            r[:e] = st.load
            r[e], r[e + 1], r[e + 2], r[e + 3] = st.aux, st.z, st.dropped, float(st.micro_batches)
        self.world.all_reduce(rows)
        # Kept two steps: under overlap_validation a step is settled (maybe skipped) after the next ran.
        self.before = {k: v for k, v in self.before.items() if k >= step - 1}
        self.before[step] = [m.router.bias.clone() if m.router.bias is not None else None for m in self.layers]
        for m in self.layers:
            m.update_bias(rows[m.layer, :e], self.rate)
        self.pending.append((step, rows))

    def read(self) -> None:
        """The gathered steps' sums to the host (the stepper calls it after the step check's read)."""
        while self.pending:
            step, rows = self.pending.popleft()
            with torch.profiler.record_function(REPORT_BOUNDARY):
                # tolist, not cpu(): a rehearsal's meta rows have no values (its probe gives zeros for them)
                self.host.append((step, torch.tensor(rows.tolist(), dtype=rows.dtype)))

    def metrics(self) -> dict[str, float]:
        """The oldest gathered step's entries (read now if the stepper has not)."""
        self.read()
        if not self.host:
            return {}
        rows = self.host.popleft()[1]
        e = self.shape[1] - 4
        sparse = [i for i in range(rows.shape[0]) if rows[i, e + 3] > 0]
        if not sparse:
            return {}
        out: dict[str, float] = {}
        ratios = []
        for i in sparse:
            load = rows[i, :e]
            ratio = float(load.max() / load.mean()) if load.sum() > 0 else 0.0
            ratios.append(ratio)
            out[f"moe/layer{i}/load_max_mean"] = ratio
        n = rows[sparse, e + 3]
        out["moe/aux_loss"] = float((rows[sparse, e] / n).mean())
        out["moe/z_loss"] = float((rows[sparse, e + 1] / n).mean())
        routed = rows[sparse, :e].sum() + rows[sparse, e + 2].sum()
        out["moe/dropped"] = float(rows[sparse, e + 2].sum() / routed) if routed > 0 else 0.0
        out["moe/load_max_mean"] = max(ratios)
        return out
