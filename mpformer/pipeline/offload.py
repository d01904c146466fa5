"""Activation offload (as PipeOffload, Wan et al. 2025; Megatron-LM's activation offloading): the saved
activations of a (micro-batch, chunk) that waits for its backward go to host memory after its forward
and come back as that backward runs, the copies beside the compute (parallel/device.py's
HostCopies: side streams on CUDA, a thread on CPU).

Which units move is decided from the rank's action list before the step (``offload_units``):

    all   every unit whose backward is not the rank's next compute after its forward (one that is,
          such as the last stage's under 1F1B, would only come straight back)
    auto  only those the schedule keeps in flight beyond a budget of ``keep`` units on the device:
          a unit moves when, at its forward, ``keep`` units are already held

A moved unit comes back a layer at a time, one layer ahead of its backward, as Megatron-LM's layer-wise
reload does: its last layer's activations while the compute before its backward runs
(``prefetch_points``; when that compute is another moved unit's backward, while that backward's first
layer runs), then each layer's while the backward of the layer after it runs (the unpack hook of a
layer asks for the layer before). So a moved unit never holds more than about two layers on the
device, in its forward (the copies out trail the compute) as in its backward; bringing the whole unit
back before its backward would hold one micro-batch more at that backward's start. A layer here is a
transformer Block: what is saved from its start to the next one's start; what the embedding saves joins
the first, the head's the last. (Under full recompute what a Block keeps, its
input, is saved by torch.utils.checkpoint just before the Block starts, so it sits a layer early, in
every layer alike: the read-ahead is still one layer ahead.)

What moves is what autograd saves for the backward (saved-tensor hooks around the unit's forward),
except parameters and the unit's received input (they stay on the device anyway) and tensors under
``min_bytes`` (a copy's fixed cost would outweigh them). A tensor saved twice (a norm's input, the
gate's and up projection's shared input, the rotary tables) moves once and comes back once, with the
last layer that saved it (the first its backward reaches), and stays on the device until its last use
there, as it would without offload. A recomputed layer's kept input moves too. Not moved: the keys and
values token slices keep (context_parallel/token_slices.py) and the zero-bubble weight pass's stash
between BI and BW (layers/linear.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from mpformer.models.transformer import Block
from mpformer.parallel.device import HostCopies
from mpformer.pipeline.actions import Action, Op

Key = tuple[int, int]  # (microbatch, chunk)
OFFLOAD_MODES = ("none", "auto", "all")


def offload_units(actions: Sequence[Action], mode: str, keep: int = 1) -> set[Key]:
    """The units of one rank's list whose saved activations go to host memory (module docstring)."""
    return moved_units([(a.op, a.microbatch, a.chunk) for a in actions if not a.op.is_comm], mode, keep)


def moved_units(computes: Sequence[tuple[Op, int, int]], mode: str, keep: int = 1) -> set[Key]:
    """``offload_units`` on a rank's computes as (op, microbatch, chunk), in order: also the generators'
    compute orders (pipeline/schedules.py), from which the cost model counts the copies."""
    if mode == "none":
        return set()
    out, held = set(), 0
    for i, (op, mb, chunk) in enumerate(computes):
        key = (mb, chunk)
        if op is Op.F:
            follows = i + 1 < len(computes) and computes[i + 1][0] in (Op.B, Op.BI) and \
                (computes[i + 1][1], computes[i + 1][2]) == key
            if not follows and (mode == "all" or held >= keep):
                out.add(key)
            held += key not in out
        elif op in (Op.B, Op.BI) and key not in out:
            held -= 1
    return out


def prefetch_points(actions: Sequence[Action], units: set[Key]) -> dict[int, Key]:
    """Index in ``actions`` of the compute during which each moved unit comes back: the one before
    its backward (at the list's start, its backward itself)."""
    out: dict[int, Key] = {}
    last = None
    for i, a in enumerate(actions):
        if a.op.is_comm:
            continue
        key = (a.microbatch, a.chunk)
        if a.op in (Op.B, Op.BI) and key in units:
            out[last if last is not None else i] = key
        last = i
    return out


class _Saved:
    """What autograd keeps of a moved tensor, in every place it was saved: the copy, its unit and layer
    (the last that saved it), and how many of those places have not read it back yet."""

    __slots__ = ("copy", "key", "layer", "uses")

    def __init__(self, key: Key, layer: int, copy: dict) -> None:
        self.key, self.layer, self.copy, self.uses = key, layer, copy, 1


def _storage(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (its StorageImpl): shared by its views, as its address is, but also
    distinct on meta tensors (a rehearsal's), whose addresses are all 0."""
    return t.untyped_storage()._cdata


class ActivationOffload:
    """The saved activations of the moved units of one rank: out after their forward, back a layer at a
    time ahead of their backward."""

    def __init__(self, copies: HostCopies, model: nn.Module, units: set[Key], min_bytes: int | None = None) -> None:
        """``min_bytes`` (None: 1 MiB on CUDA, where each copy costs a pinned buffer, events and stream
        waits; 0 on CPU, where the copies exist to run this logic at the tests' small sizes)."""
        self.copies, self.units = copies, units
        self.min_bytes = (2**20 if copies.cuda else 0) if min_bytes is None else min_bytes
        self._params = {_storage(p) for p in model.parameters()}
        self._saved: dict[Key, list[list[_Saved]]] = {}  # per unit, per layer: its tensors, in saving order
        self._next: dict[Key, int] = {}  # per unit coming back: the next layer to ask for (they go last first)
        self._saving: list[list[_Saved]] | None = None  # the layers of the unit whose forward runs
        self._started = False  # in that forward: a Block has started (what comes before joins the first)
        self._then: dict[Key, Key] = {}  # a unit whose backward, at its first layer, asks for the next one's last
        self._seen: dict[tuple, tuple] = {}  # in that forward: a tensor's identity -> (weakref, its _Saved)
        self.moved_bytes = 0  # the last step's bytes sent out (each comes back once): metrics' offload_bytes
        for module in model.modules():
            if isinstance(module, Block):
                module.register_forward_pre_hook(self._new_layer)

    def _new_layer(self, module: nn.Module, args: tuple) -> None:
        # A Block starts (in a moved unit's forward; not in a recompute, which runs outside ``saving``):
        # the layer before is done, its copies out go.
        if self._saving is not None and self._saving[-1] and self._started:
            self._saving.append([])
            self.copies.flush()
        self._started = True

    def _known(self, t: torch.Tensor) -> _Saved | None:
        alive, saved = self._seen.get(self._ident(t), (None, None))
        return saved if alive is not None and alive() is not None else None  # alive: not memory reused since

    @staticmethod
    def _ident(t: torch.Tensor) -> tuple:
        return _storage(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype

    @staticmethod
    def _move(layers: list[list[_Saved]], saved: _Saved) -> None:
        """``saved`` to the layer whose forward runs: the last to save it, so the first to read it back."""
        layers[saved.layer].remove(saved)
        saved.layer = len(layers) - 1
        layers[-1].append(saved)

    @contextlib.contextmanager
    def saving(self, key: Key) -> Iterator[None]:
        """Around the forward of ``key``: what autograd saves of it goes out (if it is a moved unit)."""
        if key not in self.units:
            yield
            return
        layers = self._saving = self._saved.setdefault(key, [[]])
        self._started = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(key, layers, t), self._unpack):
                yield
            self.copies.flush()
        finally:
            self._saving = None
            self._seen = {}
            if len(layers) > 1 and not layers[-1]:  # the last Block saved nothing after it started (full
                layers.pop()  # recompute: its input sits a layer early): the read-ahead starts there

    def _pack(self, key: Key, layers: list[list[_Saved]], t: torch.Tensor) -> object:
        nbytes = t.numel() * t.element_size()
        # Kept as autograd would keep it: small tensors, another device's, a parameter's storage, and a
        # leaf that wants its gradient (the received activation: the engine holds it for that anyway).
        if nbytes < self.min_bytes or t.device != self.copies.device or (t.is_leaf and t.requires_grad) or \
                _storage(t) in self._params:
            return t
        saved = self._known(t)
        if saved is not None:  # the same tensor saved again: one copy, read where the backward meets it first
            saved.uses += 1
            if saved.layer != len(layers) - 1:
                self._move(layers, saved)
            return saved
        saved = _Saved(key, len(layers) - 1, self.copies.to_host(t.detach()))
        self._seen[self._ident(t)] = (weakref.ref(t), saved)
        layers[-1].append(saved)
        self.moved_bytes += nbytes
        return saved

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self._ask(packed.key, packed.layer - 1)  # the layer before comes back while this one's backward runs
        packed.uses -= 1
        return self.copies.result(packed.copy, keep=packed.uses > 0)

    def _ask(self, key: Key, down_to: int) -> None:
        """Start bringing back ``key``'s layers, last first, down to layer ``down_to``."""
        layers = self._saved.get(key)
        if layers is None:
            return
        nxt = self._next.get(key, len(layers) - 1)
        while down_to > 0 and not layers[down_to]:  # emptied (its tensors saved again later): the one below
            down_to -= 1
        while nxt >= max(down_to, 0):
            self.copies.to_device(*(saved.copy for saved in layers[nxt]))
            nxt -= 1
        self._next[key] = nxt
        if down_to < 0 and key in self._then:  # its first layer's backward runs: the next unit's last comes
            self._last(self._then.pop(key))

    def _last(self, key: Key) -> None:
        layers = self._saved.get(key)
        if layers is not None:
            self._ask(key, len(layers) - 1)

    def prefetch(self, key: Key, during: Action | None = None) -> None:
        """Before ``key``'s backward, with the compute before it (``during``) about to run: ``key``'s last
        layer comes back beside that compute. When that compute is itself a moved unit's backward, only
        once that backward reaches its first layer: a backward's two layers and the next one's last
        would otherwise be on the device together, one layer more than any other point holds."""
        if during is not None and during.op in (Op.B, Op.BI) and (during.microbatch, during.chunk) in self.units:
            self._then[during.microbatch, during.chunk] = key
            return
        self._last(key)

    def done(self, key: Key) -> None:
        """After the backward of ``key``: nothing of it is needed again."""
        self._saved.pop(key, None)
        self._next.pop(key, None)
        if key in self._then:  # its backward read nothing of its first layer: the next one's last now
            self._last(self._then.pop(key))

    def start(self) -> None:
        """A new step: nothing saved yet, no bytes moved."""
        self.clear()
        self.moved_bytes = 0

    def clear(self) -> None:
        """The step ended (or failed): drop what is left; ``moved_bytes`` stays readable."""
        self._saved.clear()
        self._next.clear()
        self._then.clear()
