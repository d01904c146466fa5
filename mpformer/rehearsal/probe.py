"""What a rehearsed rank does, watched op by op: its memory by kind, its attention kernels, any
score- or mask-shaped tensor, and every op that would wait for the GPU.

One dispatch mode (``Probe``) sees every op the rank runs on its meta tensors, forward and backward
alike (autograd carries the mode into the backward):

    memory      every storage an op returns is counted from then until it dies (the caching
                allocator's live bytes between ops, as its allocated-bytes counter would read them; a
                kernel's own scratch is not seen). Each byte has a kind: weights, grads, master,
                optimizer (the gradient engine's buffers, named by ``classify``), activations (a storage
                autograd saves for backward, seen by a saved-tensors hook), other (the rest: in-flight
                outputs and gradients, communication and pipeline buffers, casts). ZeRO-3's gathered
                buffers change size without an op (``resize_``): they are read again whenever an op
                uses them and wherever a new peak is decided.
    kernels     each fused attention op by the kernel it is (flash, efficient, cudnn), and each call of
                torch's generic SDPA, which on these tensors (and on a GPU that no fused kernel takes)
                is the math kernel; and the experts' grouped GEMMs (``grouped_mm``: calls and FLOPs), and the
                float8 GEMMs' calls by kernel (``scaled_mm``: ``_scaled_mm``, ``_scaled_grouped_mm``)
    flops       each op's FLOPs by torch's own formulas (torch.utils.flop_counter's registry: GEMMs and the
                fused attention kernels; ``grouped_mm_flops`` for torch._grouped_mm, which it lacks), once
                ``count_flops`` is set (the steps, not the build). Not FlopCounterMode itself: its module
                tracker keeps checkpointed layers' outputs alive.
    squares     a tensor whose last two dimensions are an attention call's query and key lengths, both
                at least ``SQUARE_MIN``: a score or mask matrix
    syncs       an op that needs a device value on the host (parallel/host_syncs.py), ``tolist`` and a copy
                to the host (``.cpu()``). On
                meta tensors it cannot run: it is recorded with where it came from and a stand-in value
                is returned (zeros; False for flags), so the step goes on. Those inside a
                ``record_function(REPORT)`` region are the step's one reporting boundary.

Where each falls is the innermost ``record_function`` name (the pipeline's actions, the step's micro-
batches) and the module running forward, or the autograd node running backward.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from mpformer.parallel.host_syncs import REPORT_BOUNDARY as REPORT
from mpformer.parallel.host_syncs import is_sync

KINDS = ("weights", "grads", "master", "optimizer", "activations", "other")
LARGEST = 8  # storages named in the report, largest first
SQUARE_MIN = 4096
_aten = torch.ops.aten
_ROOT = str(Path(__file__).resolve().parents[1])  # mpformer/: the first frame of ours names the line

# The fused attention ops by kernel (forward and backward alike: one call each).
ATTENTION_OPS = {}
for _name, _kernel in (("_scaled_dot_product_flash_attention", "flash"), ("_flash_attention_forward", "flash"),
                       ("_scaled_dot_product_efficient_attention", "efficient"),
                       ("_efficient_attention_forward", "efficient"),
                       ("_scaled_dot_product_cudnn_attention", "cudnn"),
                       ("_scaled_dot_product_flash_attention_for_cpu", "cpu_flash")):
    for _suffix in ("", "_backward"):
        _op = getattr(_aten, _name + _suffix, None)
        if _op is not None:
            ATTENTION_OPS[_op.default] = _kernel


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args, out_val=None, **kwargs) -> int:
    """``torch._grouped_mm``'s FLOPs (torch's registry has none): 2 x the multiply-adds of every group, whose
    sizes (``offs``) a meta tensor does not hold, but whose sum does not need them. ``a`` [m, k] or
    [G, m, k], ``b`` [k, n] or [G, k, n]: 2d x 3d (the experts' forward and input gradient) groups a's m
    rows, 2d x 2d (the weight gradient) groups the k they share, 3d x 2d groups b's n columns."""
    g = a.shape[0] if a.dim() == 3 and b.dim() == 3 else 1
    return 2 * g * a.shape[-2] * a.shape[-1] * b.shape[-1]


# torch's formulas by op (GEMMs, the fused attention kernels), and the ones it lacks
# torch < 2.8 has no _grouped_mm (the experts then take the loop: layers/expert_gemm.py grouped_ok)
_GROUPED_MM = getattr(_aten, "_grouped_mm", None)
FLOPS = {**flop_registry, **({_GROUPED_MM: grouped_mm_flops} if _GROUPED_MM is not None else {})}


@dataclass
class Finding:
    """One op of note: what it was, where in mpformer it came from, and where in the step it ran."""

    op: str
    line: str
    where: str
    shape: tuple[int, ...] = ()
    boundary: bool = False

    def to_dict(self) -> dict:
        out = {"op": self.op, "line": self.line, "where": self.where}
        if self.shape:
            out["shape"] = list(self.shape)
        if self.boundary:
            out["boundary"] = True
        return out


_TOOLS = ("/rehearsal/", "/parallel/meta_autocast.py")  # the rehearsal's own frames, never the line that asked
_READERS = ("host_ints",)  # functions that read for their caller (parallel/device.py): the caller's line is named


def our_line() -> str:
    """The innermost frame in mpformer (outside the rehearsal's own code) of the current stack, as path:line."""
    for frame in reversed(traceback.extract_stack()):
        if (frame.filename.startswith(_ROOT) and not any(t in frame.filename for t in _TOOLS)
                and frame.name not in _READERS):
            return f"{Path(frame.filename).relative_to(Path(_ROOT).parent)}:{frame.lineno}"
    return "?"


@dataclass
class _Entry:
    ref: StorageWeakRef
    nbytes: int
    kind: str
    origin: tuple = ()  # (op, region, module): where the storage was made, named when it is among the largest


class Probe(TorchDispatchMode):
    """``with probe: ...`` over a rank's build and steps; then ``peak``, ``peak_by_kind``, ``peak_where``,
    ``kernels``, ``squares``, ``syncs``. ``lengths``: the query and key lengths its attention sees
    (for ``squares``; its attention calls add theirs); ``widths``: its feature widths (hidden, head and
    projection sizes), never a score's key length."""

    def __init__(self, lengths: Iterable[int] = (), widths: Iterable[int] = ()) -> None:
        super().__init__()
        self.lengths, self.widths = set(lengths), set(widths)
        self.live: dict[int, _Entry] = {}
        self.resizable: dict[int, torch.Tensor] = {}
        self.current = 0
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.peak, self.peak_by_kind, self.peak_where = 0, dict.fromkeys(KINDS, 0), ""
        self.largest: list[dict] = []  # the peak's largest activations and others (a snapshot each 1% of new peak)
        self._snapshot_at = 0
        self.kernels: collections.Counter[str] = collections.Counter()
        self.grouped_mm = {"calls": 0, "flops": 0}  # the experts' grouped GEMMs (layers/expert_gemm.py)
        # float8 GEMMs by kernel: the linears' and the experts' loop (_scaled_mm), the experts' grouped kernel
        self.scaled_mm = {"_scaled_mm": 0, "_scaled_grouped_mm": 0}
        self.squares: list[Finding] = []
        self.syncs: list[Finding] = []
        self.regions: list[str] = []  # the open record_function ranges' names, innermost last
        self._handles: list[object] = []
        self.modules: list[str] = []
        self.phase = "build"
        self.flops, self.count_flops = 0, False

    # ---- what the driver tells it ---------------------------------------------------------------
    def classify(self, tensors: Iterable[torch.Tensor | None], kind: str) -> None:
        """The storages of ``tensors`` hold ``kind`` (the engine's buffers, once it has built them)."""
        for t in tensors:
            if t is None or not t.is_meta:
                continue
            e = self._entry(t.untyped_storage())
            self.by_kind[e.kind] -= e.nbytes
            e.kind = kind
            self.by_kind[kind] += e.nbytes

    def resizes(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """``tensors``' storages change size without an op (ZeRO-3's gathered units)."""
        tensors = [t for t in tensors if t.is_meta]
        self.classify(tensors, kind)
        for t in tensors:
            self.resizable[t.untyped_storage()._cdata] = t

    def saved(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensors pack hook: an unclassified storage autograd keeps for backward is an activation."""
        if t.is_meta:
            e = self.live.get(t.untyped_storage()._cdata)
            if e is not None and e.kind == "other":
                self.by_kind["other"] -= e.nbytes
                e.kind = "activations"
                self.by_kind["activations"] += e.nbytes
        return t

    def where(self) -> str:
        node = torch._C._current_autograd_node()
        inner = f"backward {node.name()}" if node is not None else (f"{self.modules[-1]} forward" if self.modules
                                                                     else "")
        outer = self.regions[-1] if self.regions else self.phase
        return f"{outer}: {inner}" if inner else outer

    # ---- the op hook --------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        kwargs = kwargs or {}
        if func is torch.ops.profiler._record_function_enter_new.default:
            handle = func(*args, **kwargs)
            self.regions.append(str(args[0]))
            self._handles.append(handle)
            return handle
        if func is torch.ops.profiler._record_function_exit._RecordFunction:
            # by its handle: an exit whose enter this mode did not see (torch's own ranges) closes nothing
            for i in range(len(self._handles) - 1, -1, -1):
                if self._handles[i] is args[0]:
                    del self._handles[i], self.regions[i]
                    break
        if func is _aten._to_copy.default and args[0].is_meta and kwargs.get("device") == torch.device("cpu"):
            return self._sync(func, args, kwargs)  # a copy to the host (``.cpu()``): it waits for the device
        if is_sync(func, args, kwargs) and any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(args)):
            return self._sync(func, args)
        kernel = ATTENTION_OPS.get(func)
        if kernel is not None:
            self.kernels[kernel] += 1
            q, k = args[0], args[1]
            if "backward" not in str(func):
                self.lengths.update((q.shape[-2], k.shape[-2]))
        if self.resizable:
            self._resized(args)
        out = func(*args, **kwargs)
        self._track(func, out)
        if _GROUPED_MM is not None and func is _GROUPED_MM.default:
            self.grouped_mm["calls"] += 1
            self.grouped_mm["flops"] += grouped_mm_flops(*args)
        if (scaled := func._overloadpacket.__name__) in self.scaled_mm:
            self.scaled_mm[scaled] += 1
        if self.count_flops and (count := FLOPS.get(func._overloadpacket)) is not None:
            self.flops += int(count(*args, **kwargs, out_val=out))
        return out

    def _sync(self, func, args, kwargs=None) -> object:
        inside = REPORT in self.regions
        self.syncs.append(Finding(str(func), our_line(), self.where(), boundary=inside))
        if func is _aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0
        if func is _aten._to_copy.default:  # zeros, as for tolist
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if func is _aten.nonzero.default:
            return torch.zeros((0, args[0].dim()), dtype=torch.int64, device=args[0].device)
        raise RuntimeError(f"{func} needs device values on the host ({our_line()}): a rehearsal cannot run it")

    def _entry(self, st: torch.UntypedStorage) -> _Entry:
        key = st._cdata
        e = self.live.get(key)
        if e is None:
            e = self.live[key] = _Entry(StorageWeakRef(st), st.nbytes(), "other")
            self.current += e.nbytes
            self.by_kind["other"] += e.nbytes
        return e

    def _resized(self, args: tuple) -> None:
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor) and t.is_meta:
                key = t.untyped_storage()._cdata
                if key in self.resizable:
                    self._refresh_size(key)

    def _refresh_size(self, key: int) -> None:
        e, n = self.live[key], self.resizable[key].untyped_storage().nbytes()
        self.current += n - e.nbytes
        self.by_kind[e.kind] += n - e.nbytes
        e.nbytes = n

    def _track(self, func, out) -> None:
        grew = False
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_meta:
                st = t.untyped_storage()
                if st._cdata not in self.live:
                    e = self._entry(st)
                    e.origin = (func, tuple(self.regions[-1:]), tuple(self.modules[-1:]), tuple(t.shape), t.dtype)
                    grew = True
                    self._square(func, t)
        if grew and self.current > self.peak:
            self._forget_freed()
            if self.current > self.peak:
                self.peak, self.peak_by_kind, self.peak_where = self.current, dict(self.by_kind), self.where()
                if self.peak > 1.01 * self._snapshot_at:
                    self._snapshot_at = self.peak
                    step = [e for e in self.live.values() if e.kind in ("activations", "other")]
                    top = sorted(step, key=lambda e: -e.nbytes)[:LARGEST]
                    self.largest = [{"bytes": e.nbytes, "kind": e.kind, "op": str(e.origin[0]) if e.origin else "",
                                     "where": ": ".join(e.origin[1] + e.origin[2]) if e.origin else "build",
                                     "shape": list(e.origin[3]) if e.origin else [],
                                     "dtype": str(e.origin[4]) if e.origin else ""} for e in top]

    def _forget_freed(self) -> None:
        """Storages that died since, dropped; the resizable ones read again (a free is not an op)."""
        for key in [k for k, e in self.live.items() if e.ref.expired()]:
            e = self.live.pop(key)
            self.resizable.pop(key, None)
            self.current -= e.nbytes
            self.by_kind[e.kind] -= e.nbytes
        for key in self.resizable:
            self._refresh_size(key)

    def _square(self, func, t: torch.Tensor) -> None:
        if t.dim() < 2:
            return
        a, b = t.shape[-2], t.shape[-1]
        if a >= SQUARE_MIN and b >= SQUARE_MIN and a in self.lengths and b in self.lengths and b not in self.widths:
            self.squares.append(Finding(str(func), our_line(), self.where(), tuple(t.shape)))

    def final(self) -> int:
        """The bytes live now (after the last step), frees accounted."""
        self._forget_freed()
        return self.current


class ModuleNames:
    """Global forward hooks naming the module running forward on the probe's stack (its ``modules``). The
    exit hook runs even when the forward raises: a checkpoint's recompute stops early by raising inside
    the forward (torch.utils.checkpoint's early stop), which left the recomputed module's name on the
    stack and named every later op of the step after it (the engine's end-of-backward reductions read
    as "layers.0.mlp.experts forward")."""

    def __init__(self, probe: Probe, model: torch.nn.Module) -> None:
        names = {id(m): n or "model" for n, m in model.named_modules()}
        self.probe, self.names = probe, names
        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
                        torch.nn.modules.module.register_module_forward_hook(self._exit, always_call=True)]

    def _enter(self, module, args) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.probe.modules.append(name)

    def _exit(self, module, args, out) -> None:
        if id(module) in self.names and self.probe.modules:
            self.probe.modules.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class FunctionProbe(TorchFunctionMode):
    """What the dispatch mode cannot see: calls of torch's generic SDPA on meta tensors (torch picks its
    math kernel for them, only CUDA tensors reach its fused-kernel choice, as a GPU does for a call no
    fused kernel takes: counted as ``math``), and ``tolist`` of a meta tensor (a host sync, recorded,
    zeros returned)."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):  # torch's signature
        if func is torch.nn.functional.scaled_dot_product_attention and args and args[0].is_meta:
            self.probe.kernels["math"] += 1
            self.probe.lengths.update((args[0].shape[-2], args[1].shape[-2]))
        if func is torch.Tensor.tolist and args[0].is_meta:
            p = self.probe
            p.syncs.append(Finding("Tensor.tolist", our_line(), p.where(), boundary=REPORT in p.regions))
            return torch.zeros(args[0].shape, dtype=args[0].dtype).tolist()
        return func(*args, **(kwargs or {}))
