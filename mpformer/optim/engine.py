"""The gradient engine: one bucketed engine over flat buffers for every ZeRO stage and precision.

Where parameters live and how gradients are reduced are settings of it, not classes:

    stage  parameters                  gradients                                  optimizer state, masters
    0      replicated                  fp32, all-reduced after the last micro-batch  whole
    1      replicated                  fp32, reduce-scattered after the last one  this rank's shard
    2      replicated                  fp32, reduce-scattered every micro-batch   this rank's shard
    3      sharded, gathered per unit  per unit in the parameter dtype, reduce-   this rank's shard
                                       scattered every micro-batch

Each parameter reduces over the mesh view its GradSpec names (``reduce_over``: "data", dp x cp, for
every dense weight; a layer kind may name another, core/topology.py MESH_VIEWS), and ZeRO shards it
over that view's group: a bucket holds one view's parameters, and its reduction, its shard and its
gathers use that view's group; the norm sums each view's part over its own group before tp and pp.

Buckets (core/buffers.py): stages 0-2 pack the parameters, last first (roughly the order backward
produces gradients), into buckets of ``bucket_mb``; stage 3 makes one per unit (the embedding, each
transformer layer's submodules merged up to ``zero3.unit_numel`` elements, the head: final norm and
LM head; units.py, gather.py; under fp8 a unit's float8-gathered weights are a bucket apart,
fp8_gather.py). A bucket is padded to a multiple of
dp and rank r owns 1/dp of it (stage 0: all of it). Parameters become views into its ``param_buf``;
a model built on the meta device is filled there from the blocked initialiser (materialise.py), a
ZeRO-3 rank allocating and drawing its shard alone.

Gradients reach the bucket's fp32 ``grad_buf`` either as views (fp32 parameters at stages 0-1:
``p.grad`` is the bucket's slice and autograd accumulates in place, DDP's gradient-as-bucket-view)
or through a post-accumulate-grad hook that adds ``p.grad`` into its slot and drops it (Megatron's
main_grad: 16-bit parameters accumulate in fp32, and stages 2-3 can free a bucket). When backward
has produced every gradient of a bucket its reduction starts asynchronously, divided by dp first
(gloo has no AVG), in ``reduce_dtype`` (bf16 halves the traffic; accumulation stays fp32). Stage 3
collects a unit's gradients in the parameter dtype and reduce-scatters them in it (16-bit parameters:
bf16/fp16, as FSDP and DeepSpeed do; fp32: ``reduce_dtype``), then adds the shard into the rank's
fp32 gradient shard; its projections' weight gradients are formed in that buffer (the engine is their
gradient sink, layers/linear.py), not beside it. Stage 2 keeps at most MAX_IN_FLIGHT reductions in
flight; stage 3 bounds them in elements: a unit's buffer is taken (when its first gradient arrives)
only once the reductions in flight and it hold at most ``zero3.reduce_numel``, older ones waited
first, so a unit larger than that never has another's buffer alive beside its own. Both wait for
every reduction once every bucket of the micro-batch has launched (its backward is over), so that no
gradient buffer outlives its backward; their buffers come from a pool (stage 3: at most
``zero3.reduce_numel`` idle) that is emptied at the end of the step.

``finish()`` makes the gradients final in the order the step needs them: a tied embedding's two
pipeline copies summed, every reduction launched and waited for, partial tensor-parallel gradients
summed over tp, and for fp16 the loss scale divided out (an inf or nan anywhere skips the step).
``clip()`` (stepping.py's ShardStep: the engine builds it from what the step reads and delegates to it)
takes one global norm over the shards, each element counted once over dp, tp and pp;
``step()`` runs the wrapped elementwise optimizer on this rank's shard, casts the masters back into
16-bit parameters and posts the parameters' all-gather (stages 1-2), which each block waits for
when its next forward begins (param_gather.py). Every rank must produce gradients
for the same parameters each step, so that buckets launch in the same order everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
from torch import nn

from mpformer.checkpoint.rows import canonical_rows
from mpformer.core.buffers import BucketLayout, Slot, plan_buckets
from mpformer.core.shards import Shard
from mpformer.layers.grad_store import set_grad_sink
from mpformer.models.init import ModelInit
from mpformer.optim.bucket import Bucket, GradPool, ShardParam, shard_grads
from mpformer.optim.fp8_gather import float8_units
from mpformer.optim.gather import Region, UnitGather
from mpformer.optim.materialise import bucket_weights
from mpformer.optim.memory import model_state_bytes
from mpformer.optim.param_gather import ParamGather
from mpformer.optim.reduction import Reduction
from mpformer.optim.speculate import Speculation
from mpformer.optim.state import EngineState
from mpformer.optim.stepping import ShardStep
from mpformer.optim.units import ZERO3_DEFAULTS, Zero3Settings, build_units
from mpformer.parallel.comm import Comm
from mpformer.parallel.device import DeviceLike
from mpformer.parallel.tensor_parallel import GradSpec

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # parallel.grad_reduce_dtype
MAX_IN_FLIGHT = 2  # stage 2: full gradient buffers reducing at once (and idle in the pool)


class GradEngine:
    def __init__(self, model: nn.Module, red: Reduction, *, stage: int, groups: Sequence[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 param_dtype: torch.dtype = torch.float32, bucket_mb: float = 25.0,
                 init: ModelInit | None = None, device: DeviceLike = None,
                 overlap_param_gather: bool = False, zero3: Zero3Settings = ZERO3_DEFAULTS) -> None:
        """``init``: the model was built on the meta device (models/parallelize.py, deferred) and the
        buckets are filled from it on ``device``, each rank drawing only what it keeps; otherwise the
        parameters' values are copied in (their device). ``overlap_param_gather`` (stages 1-2): step()
        returns with the parameters' all-gather in flight and each block waits for its own at its next
        forward; whoever else reads parameters first calls ``wait_params()``. ``zero3``: stage 3's unit
        size, prefetch and reduction bounds (units.py)."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {stage}; valid: 0, 1, 2, 3")
        self.model, self.red, self.comm, self.stage, self.param_dtype = model, red, red.dp, stage, param_dtype
        # Stage 3 reduce-scatters 16-bit parameters' gradients in their dtype (FSDP's and DeepSpeed's default).
        self.reduce_dtype = param_dtype if stage == 3 and param_dtype != torch.float32 else red.reduce_dtype
        self.persistent = stage < 2  # full gradients live for the whole step; the shard is their view
        self.views = self.persistent and param_dtype == torch.float32
        self.sync = True
        names = {id(p): n for n, p in model.named_parameters()}
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Each parameter's view (its spec's reduce_over; "data" for dense weights) and each view's group.
        named = {id(s.param): s.reduce_over for s in red.specs}
        self.param_views = [named.get(id(p), "data") for p in self.params]
        self.groups = {v: red.view(v) for v in dict.fromkeys(["data", *self.param_views])}
        self.names = [names[id(p)] for p in self.params]
        self.canonical = canonical_rows(model, self.params)  # before any storage moves or is freed
        self.init = init
        self.device = torch.device(device) if device is not None else self.params[0].device
        assert init is not None or not self.params[0].is_meta, "a meta-built model needs init to be filled from"
        self.zero3 = zero3
        self._regions: list[Region] = []  # stage 3: set with the units (_plan)
        self._sunk: list[nn.Parameter] = []
        self._fp8: dict[int, nn.Module] = {}  # stage 3, fp8: weights gathered in float8 and their layers
        plan = self._plan(bucket_mb)
        grad_bytes = torch.finfo(param_dtype).bits // 8
        self.pool = None if self.persistent else GradPool(MAX_IN_FLIGHT) if stage == 2 else \
            GradPool(None, zero3.reduce_numel * grad_bytes)
        self.buckets = [self._materialise(k, layout, module, view) for k, (module, layout, view) in enumerate(plan)]
        # (a rehearsal's engine keeps them there)
        left = [n for n, p in model.named_parameters() if p.is_meta and self.device.type != "meta"]
        assert not left, f"parameters left on the meta device (no gradient, so in no bucket): {left}"
        self._where = {id(p): (k, s) for k, b in enumerate(self.buckets) for p, s in zip(b.params, b.layout.slots)}
        self.shards = self._shard_params()
        self._in_flight: list[Bucket] = []
        self._launched = 0  # stages 2-3: buckets launched in this micro-batch
        group_of = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
        self.optimizer = make_optimizer([{**{k: v for k, v in g.items() if k != "params"},
                                          "params": [s.master for s in self.shards if group_of[id(s.param)] == i]}
                                         for i, g in enumerate(groups)])
        tied = red.tied
        self.not_mine = {id(tied.param)} if tied is not None and not tied.owner else set()
        comms = [self.groups[b.view].comm for b in self.buckets]
        self.gather = UnitGather(self.buckets, comms, self._regions, model, param_dtype, zero3.prefetch_numel,
                                 float8_units(self.buckets, self._fp8, comms)) if stage == 3 else None
        # Stages 1-2: the step's parameter all-gather overlaps the next forward (param_gather.py).
        self.param_gather = ParamGather(self.buckets, comms, model if overlap_param_gather else None) \
            if stage in (1, 2) else None
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        for p in self._sunk:  # stage 3's projections: weight gradients formed in their unit's buffer
            set_grad_sink(p, self)
        self.state = EngineState(model, self.shards, self.optimizer, self.canonical, stage=stage,
                                 not_mine=self.not_mine, masters_are_weights=param_dtype != torch.float32 or stage == 3)
        # The norm: each view's sum over its own group (the shards differ there past stage 0), then tp, pp.
        views = {v: Comm(g.comm.group, g.comm.ledger, tag=g.comm.tag + "norm.") for v, g in self.groups.items()}
        across = {v: Comm(g.across.group, g.across.ledger, tag=g.across.tag + "norm.")
                  for v, g in self.groups.items() if g.across is not None and g.across.size > 1}
        self.stepping = ShardStep(buckets=self.buckets, shards=self.shards, optimizer=self.optimizer, stage=stage,
                                  view_comms=views, view_across=across,
                                  norm_comms=[c for c in (red.tp, red.pp) if c is not None],
                                  param_gather=self.param_gather,
                                  norm_specs=[s for s in red.specs if id(s.param) not in self.not_mine])

    # ---- construction ------------------------------------------------------------------------
    def shard_of(self, view: str) -> tuple[int, int]:
        """(this rank's shard, shards) of a view's buckets: stage 0 keeps them whole."""
        comm = self.groups[view].comm
        return (0, 1) if self.stage == 0 else (comm.rank, comm.size)

    def _plan(self, bucket_mb: float) -> list[tuple[nn.Module | None, BucketLayout, str]]:
        """Buckets as (unit module, layout, view) with slots naming parameters by their index in ``params``;
        a bucket holds the parameters of one view (a stage-3 unit of two views is a bucket of each, and
        its region gathers both)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        if self.stage == 3:
            found = build_units(self.model, self.params, self.zero3.unit_numel)
            self._sunk, self._fp8 = found.sunk, found.fp8
            units, cap = list(zip(found.modules, found.params)), 2**62
        else:
            units, cap = [(None, self.params)], max(1, int(bucket_mb * 2**20 / 4))  # fp32 gradient elements
        out, of_unit = [], []
        # A unit is a bucket per (view, gather dtype): float8-gathered weights apart (fp8_gather.py)
        def kind(p: nn.Parameter) -> tuple[str, bool]:
            return self.param_views[index[id(p)]], id(p) in self._fp8

        for module, ps in units:
            of_unit.append([])
            for view, fp8 in dict.fromkeys(kind(p) for p in ps):
                mine = [p for p in ps if kind(p) == (view, fp8)]
                for lay in plan_buckets([p.numel() for p in mine], self.shard_of(view)[1], cap):
                    slots = tuple(Slot(index[id(mine[s.index])], s.start, s.numel) for s in lay.slots)
                    of_unit[-1].append(len(out))
                    out.append((module, BucketLayout(slots, lay.size, lay.dp), view))
        if self.stage == 3:  # regions name units; a unit is now its views' buckets
            self._regions = [replace(r, units=tuple(k for u in r.units for k in of_unit[u])) for r in found.regions]
        return out

    def _materialise(self, index: int, layout: BucketLayout, module: nn.Module | None, view: str) -> Bucket:
        params = [self.params[s.index] for s in layout.slots]
        dev, rank = self.device, self.shard_of(view)[0]
        # The parameters now live in the bucket (materialise.py; a meta-built model: filled from init).
        buf, shard, masters = bucket_weights(params, layout, rank=rank, stage=self.stage,
                                             dtype=self.param_dtype, device=dev, canonical=self.canonical,
                                             init=self.init)
        lo, hi = layout.shard_range(rank)
        if not self.persistent:
            return Bucket(layout, params, buf, shard, torch.zeros(hi - lo, device=dev), None, masters, module, index,
                          pool=self.pool, grad_dtype=self.param_dtype if self.stage == 3 else torch.float32, view=view)
        grads = torch.zeros(layout.size, device=dev)
        if self.views:
            for p, s in zip(params, layout.slots):
                p.grad = grads[s.start:s.end].view_as(p)
        return Bucket(layout, params, buf, shard, grads[lo:hi], grads, masters, module, index, view=view)

    def _shard_params(self) -> list[ShardParam]:
        out = []
        for k, b in enumerate(self.buckets):
            for piece in b.layout.pieces(self.shard_of(b.view)[0]):
                p = self.params[piece.index]
                at = slice(piece.shard_offset, piece.shard_offset + piece.numel)
                if self.stage == 0 and self.views:  # the optimizer steps the parameters themselves
                    master = p  # (whole tensors: what a non-elementwise optimizer such as Adafactor needs)
                else:
                    master = b.masters[at] if b.masters is not None else b.param_shard[at]
                    master.grad = b.grad_shard[at]
                out.append(ShardParam(self.names[piece.index], p, piece, k, master))
        return out

    # ---- gradients ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Earlier micro-batches of a step accumulate locally; stages 2-3 reduce every micro-batch."""
        prev, self.sync = self.sync, not self.persistent
        try:
            yield
        finally:
            self.sync = prev

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:  # a split backward's BI: the weight gradient comes later, from BW
            return
        if not self.views:
            self.grad_buffer(p).add_(p.grad)
            p.grad = None
        self.grad_arrived(p)

    grad_ready = _on_grad  # a split backward's BW hands its weight gradients on as autograd's hooks would

    def grad_buffer(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s slot of its bucket's full gradients (stages 2-3: the buffer is taken on first use; stage
        3 first waits for reductions in flight until they and it hold at most zero3.reduce_numel).
        Also what stage 3's sunk projections add their weight gradients into (layers/linear.py)."""
        k, slot = self._where[id(p)]
        b = self.buckets[k]
        if b.grad_buf is None and self.stage == 3:
            need = b.layout.used
            while self._in_flight and sum(x.layout.used for x in self._in_flight) + need > self.zero3.reduce_numel:
                self._in_flight.pop(0).complete(self.stage, self.persistent)
        return b.full_grads()[slot.start:slot.end].view_as(p)

    def grad_arrived(self, p: nn.Parameter) -> None:
        """``p``'s gradient of this micro-batch is in its bucket: launch the bucket's reduction once all are."""
        b = self.buckets[self._where[id(p)][0]]
        if self.sync and self._reduces(b) and b.ready_after(p):
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        if b.pending is not None:  # stages 2-3: this bucket's previous micro-batch is still reducing
            self._in_flight.remove(b)
            b.complete(self.stage, self.persistent)
        group = self.groups[b.view]
        b.launch(group.comm, self.stage, self.reduce_dtype, self.persistent, group.replicas)
        if self.gather is not None:
            self.gather.release(b.index)
        self._in_flight.append(b)
        if self.persistent:
            return
        while self.stage == 2 and len(self._in_flight) > MAX_IN_FLIGHT:  # bound the full buffers alive
            self._in_flight.pop(0).complete(self.stage, self.persistent)
        self._launched += 1
        if self._launched == len(self.buckets):  # the micro-batch's backward is over: its buffers go now
            self._drain()

    def _drain(self) -> None:
        """Every reduction in flight waited for (and its buffer back in the pool)."""
        while self._in_flight:
            self._in_flight.pop(0).complete(self.stage, self.persistent)
        self._launched = 0

    def _reduces(self, b: Bucket) -> bool:
        """Whether ``b``'s gradients are reduced at all (stages 0-1 over one replica: nothing to do; a group
        of one rank whose gradient still divides, as experts' when ep = dp x cp: only the division)."""
        group = self.groups[b.view]
        return not (self.persistent and group.comm.size == 1 and group.replicas == 1)

    def _launch_owed(self) -> None:
        for b in self.buckets:
            owed = not b.launched if self.persistent else b.grad_buf is not None
            if owed and b.pending is None and self._reduces(b):
                self._launch(b)

    def start(self) -> None:
        """Launch every reduction still owed (a pipeline stage after its last backward: its gradients
        are final, the reductions overlap the schedule's remaining sends). With a tied copy the two
        stages' gradients are summed first, in finish()."""
        if self.red.tied is None:
            self._launch_owed()

    def main_grad(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s full fp32 gradient (stages 0-1), e.g. to sum a tied copy's before the reduction."""
        k, slot = self._where[id(p)]
        buf = self.buckets[k].grad_buf
        assert buf is not None, "full gradients exist at stages 0-1 only"
        return buf[slot.start:slot.end].view_as(p)

    def finish(self) -> None:
        """Tied copies summed, every reduction done, tp partial sums summed, fp16 unscaled; after it
        each rank holds its shard of the mean gradient and ``skipped`` says whether to step."""
        tied = self.red.tied
        if tied is not None:
            tied.comm.all_reduce(self.main_grad(tied.param))
        self._launch_owed()
        self._drain()
        if self.pool is not None:
            self.pool.clear()  # between steps a rank holds its model state alone
        if self.gather is not None:
            self.gather.reset()
        for g, spec in shard_grads(self.shards, [s for s in self.red.specs if s.sync is not None]):
            spec.sync.all_reduce(g)  # tp ranks share dp rank and layout: the same shards
        self.stepping.begin(self.red.scaler)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.reset(self.persistent)

    # ---- the step (stepping.py's ShardStep owns it; these are the engine's interface to it) ------------
    @property
    def skipped(self) -> bool:
        """This step's fp16 overflow: no optimizer step (set by finish())."""
        return self.stepping.skipped

    @property
    def steps_taken(self) -> int:
        return self.stepping.steps_taken

    def shard_grads(self, specs: Sequence[GradSpec]) -> list[tuple[torch.Tensor, GradSpec]]:
        return shard_grads(self.shards, specs)

    def norm_square(self, *, world: bool = False) -> torch.Tensor:
        return self.stepping.norm_square(world=world)

    def clip(self, max_norm: float, *, speculation: Speculation | None = None) -> float:
        return self.stepping.clip(max_norm, speculation=speculation)

    def take_norm(self, norm: torch.Tensor, max_norm: float, value: float, *,
                  speculation: Speculation | None = None) -> float:
        return self.stepping.take_norm(norm, max_norm, value, speculation=speculation)

    def speculate(self, *, publish: bool = False) -> Speculation | None:
        return self.stepping.speculate(publish=publish)

    def settle(self, speculation: Speculation, *, skip: bool) -> bool:
        return self.stepping.settle(speculation, skip=skip)

    def undo(self, speculation: Speculation | None) -> None:
        self.stepping.undo(speculation)

    def step(self, speculation: Speculation | None = None) -> None:
        self.stepping.step(speculation)

    def write_back(self) -> None:
        self.stepping.write_back()

    def wait_params(self) -> None:
        self.stepping.wait_params()

    def memory(self) -> dict[str, int]:
        """Model-state bytes this rank holds, counted from the tensors (memory.py)."""
        weights = [b.param_shard if self.stage == 3 else b.param_buf for b in self.buckets]  # stage 3 16-bit: none
        grads = [b.grad_shard for b in self.buckets] + [b.grad_buf for b in self.buckets if b.grad_buf is not None]
        return model_state_bytes(weights, grads, [b.masters for b in self.buckets if b.masters is not None],
                                 self.optimizer)

    # ---- checkpoint (state.py) ------------------------------------------------------------------
    def tensors(self) -> dict[str, Shard]:
        """What this rank writes: the weights and the optimizer state."""
        self.wait_params()
        return {**self.state.weight_shards(), **self.state.state_shards(self.steps_taken)}

    def load(self, ckpt_dir: str, *, optimizer: bool) -> None:
        """The weights, and the optimizer state with its step count when ``optimizer``."""
        self.wait_params()  # no gather may still be writing into the buffers being loaded
        self.state.load_weights(ckpt_dir)
        self.write_back()  # the loaded masters into the 16-bit parameters
        if optimizer:
            self.stepping.steps_taken = self.state.load_state(ckpt_dir)
