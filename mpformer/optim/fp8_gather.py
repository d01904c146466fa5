"""ZeRO-3 weights gathered in float8 (train.precision=fp8, tensorwise and delayed recipes; issue 35).

A float8 linear casts its weight W [N, K] with one scale before its forward GEMM. Under ZeRO-3 that cast
moves before the all-gather: each rank casts its shard and the unit arrives already in float8, one byte
an element instead of bf16's two (torchao's float8 all-gather for FSDP2 does the same). For every element
to be cast exactly as one process casting the whole weight would, the scale must come from the whole
weight's amax, so per unit, per gather:

    1. each rank takes the amax of every float8 weight over its shard's part of it (0 where it holds none),
       from the masters rounded to the parameter dtype (bf16: the tensor one process casts)
    2. one all-reduce (max) of that vector of amaxes over the unit's group (and over the tensor-parallel
       groups that split the weights, as layers/fp8_linear.py reduces a weight's amax): 4 bytes a weight
    3. the scale of each weight from its amax (tensorwise: ``scale_from_amax``; delayed: the layer's
       ``DelayedScalingState.scale_for("weight", amax)``, the amax recorded as the layer's forward would)
    4. the shard cast (``cast_to_fp8``, elementwise: a slice of the whole cast), all-gathered as bytes
       (collectives take no float8 dtype) into the unit's float8 buffer; ``set_fp8_weight`` hands each
       weight's view and scale to its layer, whose forward then uses them as they are

When: a gather outside autograd's backward (a forward, or its prefetch) takes fresh amaxes and scales;
a delayed layer records its weight's amax there only in a training forward (grad enabled), once per
micro-batch as one process does. A gather inside backward (the backward's re-gather, a recomputed
forward) reuses the scales of the unit's last forward: the masters have not changed since, so the bytes
are those the forward's saved float8 weight (a view of this buffer, freed in between) had, and no
all-reduce is needed. "Last" is this micro-batch's own forward because ZeRO-3 runs without pipelines
(core/layout.py refuses zero>=2 with pp): each micro-batch's backward ends before the next one's forward
(with delayed scaling, a later forward's weight scale may differ: a schedule running F1 F2 B1 would need
the scales kept per micro-batch). A unit still gathered from a backward when a forward needs it is cast again.

The parameters of such a unit stay views into its bf16 ``param_buf``, which is never gathered (no bf16
copy of these weights exists at any time): only the float8 path may read them (layers/fp8_linear.py
reads the weight's shape and dtype, the data of its float8 copy). Rowwise scaling is not gathered in
float8: its backward re-casts W along N, which a K-scaled float8 W cannot give (units.py keeps its
weights in bf16 units).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mpformer.layers.fp8 import cast_to_fp8, scale_from_amax
from mpformer.layers.fp8_layer import Float8Layer
from mpformer.layers.fp8_linear import E4M3, set_fp8_weight
from mpformer.optim.bucket import Bucket
from mpformer.parallel.comm import Comm


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a tensor hook, a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


class Fp8Unit:
    """The float8 side of one stage-3 bucket whose parameters are all float8 layers' weights: its buffer
    (``layout.size`` bytes while gathered, none between), the views per weight, the scales of its last
    forward gather (see the module docstring)."""

    def __init__(self, bucket: Bucket, layers: Sequence[Float8Layer], comm: Comm) -> None:
        assert bucket.masters is not None, "float8 gathers cast 16-bit parameters' fp32 masters"
        self.bucket, self.layers = bucket, list(layers)
        self.dtype = bucket.param_buf.dtype  # what one process casts: the masters rounded to it
        self.buf = torch.empty(bucket.layout.size, dtype=torch.uint8, device=bucket.param_buf.device)
        # ``.data``: a version counter of its own. A forward saves its view for backward, and the gathers
        # write the buffer in between (bumping the buffer's counter) with the same bytes (module docstring).
        self.views = [self.buf[s.start:s.end].view(E4M3).view(p.shape).data
                      for p, s in zip(bucket.params, bucket.layout.slots, strict=True)]
        self.buf.untyped_storage().resize_(0)
        self.amax_comm = Comm(comm.group, comm.ledger, tag=comm.tag + "fp8.")  # ledger: dp.fp8.all_reduce
        across: dict[int, Comm] = {}  # the tensor-parallel groups splitting the weights (layers/fp8_linear.py)
        for m in self.layers:
            for c in m.fp8_shards.over("k", "n"):
                across.setdefault(id(c.group), c)
        self.across = list(across.values())
        at = {s.index: i for i, s in enumerate(bucket.layout.slots)}
        self.pieces = [(at[pc.index], pc) for pc in bucket.layout.pieces(comm.rank)]
        self.shard_size = bucket.layout.shard_size
        self.scales: list[torch.Tensor] | None = None
        self.from_backward = False  # the bytes gathered now were cast inside a backward

    def stale(self) -> bool:
        """Gathered in a backward, now needed by a forward: its scales may not be this forward's."""
        return self.from_backward and not in_backward()

    def _segments(self) -> list[torch.Tensor]:
        masters = self.bucket.masters
        return [masters[pc.shard_offset:pc.shard_offset + pc.numel].to(self.dtype) for _, pc in self.pieces]

    def _fresh_scales(self, segments: list[torch.Tensor]) -> list[torch.Tensor]:
        amax = torch.zeros(len(self.layers), dtype=torch.float32, device=self.buf.device)
        for (i, _), seg in zip(self.pieces, segments, strict=True):
            if seg.numel():
                amax[i] = torch.maximum(amax[i], seg.abs().amax().float())
        self.amax_comm.all_reduce(amax, op=dist.ReduceOp.MAX)  # the whole weight's amax, on every rank
        for c in self.across:
            c.all_reduce(amax, op=dist.ReduceOp.MAX)
        record = torch.is_grad_enabled()  # a training forward (validation's does not train the scales)
        scales = []
        for i, m in enumerate(self.layers):
            a, state = amax[i].clone(), m.fp8_state()
            if state is None:
                scales.append(scale_from_amax(a, E4M3, m.fp8.margin))
                continue
            scales.append(state.scale_for("weight", a))
            if record:
                state.record("weight", a)
        return scales

    def cast_shard(self) -> torch.Tensor:
        """This rank's shard in float8 bytes [shard_size] (padding 0), the storage grown for the gather."""
        segments = self._segments()
        backward = in_backward()
        if not backward or self.scales is None:
            assert not backward, "a float8 unit gathered in backward before any forward gathered it"
            self.scales = self._fresh_scales(segments)  # fresh tensors: earlier forwards saved the old ones
        self.from_backward = backward
        out = torch.zeros(self.shard_size, dtype=torch.uint8, device=self.buf.device)
        for (i, pc), seg in zip(self.pieces, segments, strict=True):
            out[pc.shard_offset:pc.shard_offset + pc.numel] = cast_to_fp8(seg, self.scales[i], E4M3).view(torch.uint8)
        self.buf.untyped_storage().resize_(self.buf.numel())
        for p, view, scale in zip(self.bucket.params, self.views, self.scales, strict=True):
            set_fp8_weight(p, (view, scale))
        return out

    def free(self) -> None:
        for p in self.bucket.params:
            set_fp8_weight(p, None)
        self.from_backward = False
        self.buf.untyped_storage().resize_(0)

    def gathered_bytes(self) -> int:
        return self.buf.untyped_storage().nbytes()


def float8_units(buckets: Sequence[Bucket], layers: dict[int, Float8Layer],
                 comms: Sequence[Comm]) -> list[Fp8Unit | None]:
    """Per bucket: its ``Fp8Unit`` where every parameter is the weight of a layer in ``layers`` (by the
    parameter's id; units.py never mixes them with other parameters in a bucket), else None."""
    out: list[Fp8Unit | None] = []
    for b, comm in zip(buckets, comms, strict=True):
        mine = [layers.get(id(p)) for p in b.params]
        assert all(m is None for m in mine) or all(m is not None for m in mine), "a bucket mixes gather dtypes"
        out.append(Fp8Unit(b, mine, comm) if mine and mine[0] is not None else None)
    return out
