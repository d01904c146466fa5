"""The pipeline engine: runs this rank's action list (schedules.py) through a dispatch table.

    for each action of my list, in order:
        a maximal run of SEND/RECV actions  -> one batch_isend_irecv group, posted, not waited for
        F   (mb, chunk)  -> wait for its received activation (or take the tokens on stage 0); run the
                            chunk; on the last stage the output is the loss, scaled by 1/microbatches
        B   (mb, chunk)  -> wait for its received output gradient (none on the last stage); backward,
                            input and weight gradients together; keep the input's gradient for SEND_B
        BI  (mb, chunk)  -> the same backward with the linear layers' weight-gradient GEMMs queued
                            in a WeightGradStore under (mb, chunk) (layers/linear.py) ...
        BW  (mb, chunk)  -> ... and run here, accumulating into .grad as autograd would
    after my last B/BW: ``on_grads_done`` (the trainer starts this stage's data-parallel reduction)
    at the end: wait for every send (their tensors stay alive until then)

Activation offload (``offload``, pipeline/offload.py): a moved unit's forward runs under saved-tensor
hooks that copy what it saves to host memory; the compute before its backward starts the copy back of
its last layer, and its backward brings each layer back while the layer after it runs.

Token slices (``schedule.slices`` = k > 1, TeraPipe): action microbatch ``u`` is slice ``u % k`` of
batch ``u // k``; each (batch, chunk) keeps a KVSlices (context_parallel/token_slices.py) from its
first slice's forward to its first slice's backward, and a slice's backward also starts from the key
and value gradients its later slices left. A slice's loss is its share of its batch's mean.

Waiting for a receive only where it is consumed, and for sends only at the end (a send found done
at a later post lets go of its tensor then, without waiting), is what
simulate()'s default timing assumes; it waits for a subset of what the verifier's blocking
group semantics wait for, in the same posting order, so the verifier's deadlock proof covers it.

Accumulation semantics equal non-pipelined training: every microbatch's loss is divided by the
number of microbatches before backward, so gradients are the mean over the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mpformer.context_parallel.token_slices import KVSlices
from mpformer.core.pipeline_plan import StagePlan
from mpformer.layers.linear import WeightGradStore
from mpformer.parallel.device import Device, Stopwatch
from mpformer.pipeline.actions import Action, Op, Schedule
from mpformer.pipeline.offload import ActivationOffload, prefetch_points
from mpformer.pipeline.p2p import P2P, Pending
from mpformer.pipeline.stage import chunk_forward

Key = tuple[int, int]  # (microbatch, chunk)
TraceEvent = tuple[Action, float, float]  # (action, start, end) in perf_counter seconds
Received = tuple[torch.Tensor, Pending, Action]  # a posted receive: its buffer, its work, its action


class PipelineEngine:
    def __init__(self, model: nn.Module, plan: StagePlan, schedule: Schedule, p2p: P2P | None,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 on_grads_done: Callable[[], None] | None = None,
                 on_weight_grad: Callable[[torch.Tensor], None] | None = None,
                 store: WeightGradStore | None = None, offload: ActivationOffload | None = None) -> None:
        """``store``: the WeightGradStore the model's linear layers were built with, so that a schedule's
        BI/BW really split (models.parallelize.build_rank makes it for the zero-bubble schedules; an
        evaluation engine runs forwards only and needs none). ``on_weight_grad(p)`` runs after BW
        accumulated into ``p.grad`` (what autograd's post-accumulate-grad hooks would have run).
        ``offload``: this rank's activation offload (pipeline/offload.py), its units from this schedule."""
        assert schedule.pp == plan.pp and schedule.vpp == plan.vpp and schedule.v == plan.v
        self.model, self.plan, self.schedule, self.p2p, self.autocast = model, plan, schedule, p2p, autocast
        self.on_grads_done, self.on_weight_grad = on_grads_done, on_weight_grad
        self.dispatch: dict[Op, Callable[[Action, torch.Tensor | None], None]] = {
            Op.F: self._forward, Op.B: self._backward, Op.BI: self._backward, Op.BW: self._backward_weight}
        self.trace: list[tuple[Action, object, object]] | None = None  # this rank's actions (start_trace)
        self._watch: Stopwatch | None = None
        self.store, self.offload = store, offload
        self.loss_scale = 1.0  # fp16's dynamic loss scale, for the step run() runs
        dev = p2p.device if p2p is not None else torch.device("cpu")
        self._device = Device(dev.type, dev.index or 0)
        self._loss_device = dev
    def start_trace(self) -> None:
        """Record every action's start and end from now on (Chrome traces, trace.py)."""
        if self.trace is None:
            self.trace, self._watch = [], Stopwatch(self._device)

    def take_trace(self) -> list[TraceEvent]:
        """What was recorded since start_trace(), in seconds; recording stops."""
        marks, self.trace = self.trace or [], None
        watch = self._watch
        return [(a, watch.seconds(t0), watch.seconds(t1)) for a, t0, t1 in marks]

    def run(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, forward_only: bool = False,
            loss_scale: float = 1.0) -> torch.Tensor:
        """One step over ``batches`` (one (tokens, labels) per microbatch); returns the microbatch
        losses ``[m]`` (fp32, on the device: no host sync) on the rank that holds the last stage, an empty
        tensor elsewhere. ``loss_scale``: fp16's."""
        k = self.schedule.slices
        assert len(batches) * k == self.schedule.microbatches, (len(batches), k, self.schedule.microbatches)
        self.batches, self.forward_only, self.loss_scale = batches, forward_only, loss_scale
        self.inputs: dict[Key, torch.Tensor] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.recv_f: dict[Key, Received] = {}
        self.recv_b: dict[Key, Received] = {}
        self.sends: list[Pending] = []
        self.input_grads: dict[Key, torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.kv: dict[Key, KVSlices] = {}  # token slices: (batch, chunk) -> its earlier slices' keys and values
        actions = self.schedule.actions[self.plan.rank]
        if forward_only:
            actions = tuple(a for a in actions if a.op in (Op.F, Op.SEND_F, Op.RECV_F))
        elif self.store is None and any(a.op is Op.BW for a in actions):
            raise ValueError(f"schedule {self.schedule.name} splits the backward (BW actions) but the model has "
                             "no WeightGradStore; build it with models.parallelize.build_rank (or pass store=)")
        last_grad = max((k for k, a in enumerate(actions) if a.op in (Op.B, Op.BW)), default=-1)
        offload = self.offload if not forward_only else None
        prefetch = prefetch_points(actions, offload.units) if offload is not None else {}
        if offload is not None:
            offload.start()
        try:
            i = 0
            while i < len(actions):
                j = i
                while j < len(actions) and actions[j].op.is_comm:
                    j += 1
                if j > i:
                    self._communicate(actions[i:j])
                    i = j
                    continue
                a = actions[i]
                received = self._input_of(a)  # waited for outside the compute's timing
                if i in prefetch:  # an offloaded unit comes back while this compute runs
                    offload.prefetch(prefetch[i], during=a)
                self._timed(a, received)
                if i == last_grad and self.on_grads_done is not None:
                    self.on_grads_done()
                i += 1
            for pending in self.sends:
                pending.wait()
        finally:
            self.sends = []
            if self.store is not None:
                self.store.clear()
            if self.offload is not None:
                self.offload.clear()
        assert not self.outputs or forward_only, f"activations left without backward: {sorted(self.outputs)}"
        assert not self.kv, f"token slices left without backward: {sorted(self.kv)}"
        self.outputs.clear()  # forward-only: the last outputs were sent, nothing needs them
        if not self.losses:
            return torch.zeros(0, device=self._loss_device)
        # In unit order; a batch's slices' shares sum to its mean (tensors summed in order: exact).
        return torch.stack(self.losses).float().view(-1, k).sum(1)

    def _timed(self, a: Action, received: torch.Tensor | None) -> None:
        # A named range per action: torch.profiler (and its CUDA timeline) shows the schedule as run.
        with torch.profiler.record_function(f"pp.{a.op.name} mb{a.microbatch} c{a.chunk}"):
            if self.trace is None:
                self.dispatch[a.op](a, received)
                return
            t0 = self._watch.mark()
            self.dispatch[a.op](a, received)
            self.trace.append((a, t0, self._watch.mark()))

    def _input_of(self, a: Action) -> torch.Tensor | None:
        """The received tensor ``a`` consumes: the activation of an F, the output gradient of a B/BI."""
        key, plan = (a.microbatch, a.chunk), self.plan
        if a.op is Op.F and not plan.is_first(a.chunk):
            before = plan.local_stage(plan.stage(a.chunk) - 1)  # the V's turn: the output stays on the rank
            return self._received(self.recv_f, key) if before is None else self.outputs[a.microbatch, before].detach()
        if a.op in (Op.B, Op.BI) and not plan.is_last(a.chunk):
            after = plan.local_stage(plan.stage(a.chunk) + 1)
            return self._received(self.recv_b, key) if after is None else self.input_grads.pop((a.microbatch, after))
        return None

    # ---- compute -----------------------------------------------------------------------------
    def _slice(self, a: Action) -> KVSlices | None:
        """Token slices: the KVSlices of ``a``'s batch and chunk, set to ``a``'s slice (None without)."""
        k = self.schedule.slices
        if k == 1:
            return None
        past = self.kv.setdefault((a.microbatch // k, a.chunk), KVSlices(k))
        past.current = a.microbatch % k
        return past

    def _forward(self, a: Action, x: torch.Tensor | None) -> None:
        key, k = (a.microbatch, a.chunk), self.schedule.slices
        tokens, labels, *docs = self.batches[a.microbatch // k]
        if x is not None:
            if not self.forward_only:
                x.requires_grad_()
                self.inputs[key] = x
        past = self._slice(a)
        saving = self.offload.saving(key) if self.offload is not None and not self.forward_only else \
            contextlib.nullcontext()
        with self.autocast(), saving:
            out = chunk_forward(self.model, self.plan, a.chunk, x, tokens, labels, past, *docs)
        if past is not None and self.forward_only and past.current == k - 1:
            del self.kv[a.microbatch // k, a.chunk]  # no backward comes: the batch's keys are done with
        if self.plan.is_last(a.chunk):
            self.losses.append(out.detach())  # read once at the end: no device sync per micro-batch
            if self.forward_only:
                return
            m = self.schedule.microbatches // k
            out = out / m if self.loss_scale == 1.0 else out * (self.loss_scale / m)  # fp16: loss scaling
        self.outputs[key] = out

    def _backward(self, a: Action, grad: torch.Tensor | None) -> None:
        key = (a.microbatch, a.chunk)
        out = self.outputs.pop(key)
        split = a.op is Op.BI and self.store is not None
        past = self._slice(a)
        roots, grads = past.roots() if past is not None else ([], [])  # key/value gradients of later slices
        with self.store.capture(key) if split else contextlib.nullcontext():
            torch.autograd.backward([out, *roots], grad_tensors=[grad, *grads])
        if self.offload is not None:
            self.offload.done(key)
        if past is not None:
            past.release()
            if past.current == 0:
                del self.kv[a.microbatch // self.schedule.slices, a.chunk]
        x = self.inputs.pop(key, None)
        if x is not None:
            self.input_grads[key] = x.grad

    def _backward_weight(self, a: Action, _: torch.Tensor | None) -> None:
        assert self.store is not None
        self.store.run((a.microbatch, a.chunk), self.on_weight_grad)

    # ---- communication -------------------------------------------------------------------------
    def _received(self, table: dict[Key, Received], key: Key) -> torch.Tensor:
        buf, pending, action = table.pop(key)
        if self.trace is None:
            pending.wait()
        else:
            t0 = self._watch.mark()
            pending.wait()
            self.trace.append((action, t0, self._watch.mark()))
        return buf

    def _communicate(self, acts: Sequence[Action]) -> None:
        assert self.p2p is not None, "a pipeline of one stage has no communication actions"
        pp = self.schedule.pp
        sends: list[tuple[int, torch.Tensor]] = []
        recvs: list[tuple[int, torch.Tensor]] = []
        recv_slots: list[tuple[dict, Key, Action]] = []
        for a in acts:
            key, (peer, _) = (a.microbatch, a.chunk), a.peer(pp, self.schedule.v)
            if a.op is Op.SEND_F:
                sends.append((peer, self.outputs[key].detach()))
            elif a.op is Op.SEND_B:
                sends.append((peer, self.input_grads.pop(key)))
            else:
                recvs.append((peer, self.p2p.buffer()))
                recv_slots.append((self.recv_f if a.op is Op.RECV_F else self.recv_b, key, a))
        send_pending, recv_pending = self.p2p.post(sends, recvs)
        # Sends already done let go of their tensors now: kept to the step's end, a deep pipeline's every
        # sent activation and gradient would stay (the rehearsal found 512 of them on a 1T model's stage).
        self.sends = [p for p in self.sends if not p.poll()] + [send_pending]
        for (table, key, a), (_, buf), pending in zip(recv_slots, recvs, recv_pending):
            table[key] = (buf, pending, a)
