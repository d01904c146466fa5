"""Device abstraction: cpu + gloo, or cuda + nccl. The only module that touches torch.cuda.

A rehearsal (training/rehearsal.py) runs a GPU's rank on one CPU process: ``Device("cuda",
rehearsal=True)`` keeps every decision made by device on its CUDA branch while the tensors live on the
meta device (shapes and dtypes, no data) and nothing touches the CUDA runtime. Code that chooses by a
tensor's device asks ``kernel_device(t)`` (a meta tensor stands for a GPU's), and reads or switches
autocast through ``autocast_dtype`` / ``no_autocast`` (meta tensors have no autocast of their own:
parallel/meta_autocast.py applies CUDA's policy to them).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from mpformer.core.errors import ConfigError
from mpformer.parallel import meta_autocast
from mpformer.parallel.host_buffers import HostBufferCache

DEVICE_KINDS = ("auto", "cpu", "cuda")
# What module constructors accept for their parameters' placement.
DeviceLike = torch.device | str | None


def kernel_device(t: torch.Tensor) -> str:
    """The device kind whose kernels and rules apply to ``t``: its own, but "cuda" for a meta tensor (only a
    rehearsal runs them, and its target is a GPU)."""
    return "cuda" if t.device.type == "meta" else t.device.type


def host_ints(t: torch.Tensor, stand_in: Callable[[], list[int]]) -> list[int]:
    """``t``'s integers on the host (a sync on a GPU: a caller's one read of a step's phase). A meta tensor has
    no values: the read is still made (a rehearsal records it where a GPU would wait) and ``stand_in()`` is
    what it returns, a defined stand-in the caller chooses (uniform routing for the experts' counts)."""
    values = t.tolist()
    if t.device.type != "meta":
        return values
    out = stand_in()
    if len(out) != t.numel():
        raise AssertionError(f"host_ints: the stand-in has {len(out)} values for {t.numel()}")
    return out


def host_tensor(values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    """``values`` (host integers: group sizes, offsets) as a tensor on ``device`` without waiting for it.
    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which synchronises the stream (the
    host waits for every kernel queued before it; ``torch.cuda.set_sync_debug_mode`` flags it); staged in
    pinned memory, the copy is queued behind them instead, and the host allocator keeps the staging
    buffer until the copy has run."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts ``t``'s GEMMs to where it is on for ``t``'s device, else None."""
    if t.device.type == "meta":
        mode = meta_autocast.active()
        return mode.dtype if mode is not None and mode.enabled else None
    return torch.get_autocast_dtype(t.device.type) if torch.is_autocast_enabled(t.device.type) else None


@contextlib.contextmanager
def no_autocast(t: torch.Tensor) -> Iterator[None]:
    """Autocast off for ``t``'s device inside the block (the kernels take their inputs' dtypes as they are)."""
    if t.device.type != "meta":
        with torch.autocast(t.device.type, enabled=False):
            yield
        return
    mode = meta_autocast.active()
    was = mode.enabled if mode is not None else False
    if mode is not None:
        mode.enabled = False
    try:
        yield
    finally:
        if mode is not None:
            mode.enabled = was


def compose_contexts(*fns: Callable | None) -> Callable | None:
    """Checkpoint ``context_fn``s run together (None ones left out): their forward contexts around the
    forward, their recompute contexts around the recompute, in the order given."""
    live = [f for f in fns if f is not None]
    if len(live) <= 1:
        return live[0] if live else None

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        pairs = [f() for f in live]

        @contextlib.contextmanager
        def stacked(which: int) -> Iterator[None]:
            with contextlib.ExitStack() as stack:
                for p in pairs:
                    stack.enter_context(p[which])
                yield

        return stacked(0), stacked(1)
    return contexts


def recompute_contexts(t: torch.Tensor, inner: Callable | None = None) -> Callable:
    """A ``context_fn`` for torch.utils.checkpoint on ``t``'s device that also runs the recompute under the
    autocast the forward ran under: torch's checkpoint restores CUDA's and the CPU's autocast itself, not
    a rehearsal's (parallel/meta_autocast.py). ``inner``: another context_fn to compose (the tp-rank
    dropout stream's)."""
    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        fwd, rec = inner() if inner is not None else (contextlib.nullcontext(), contextlib.nullcontext())
        mode = meta_autocast.active() if t.device.type == "meta" else None
        if mode is None or not mode.enabled:
            return fwd, rec

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            with rec, meta_autocast.MetaAutocast(mode.dtype):
                yield

        return fwd, recompute()
    return contexts


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" or "cuda": what every decision made by device reads
    index: int = 0  # the CUDA device this process drives, among those visible to it
    rehearsal: bool = False  # tensors on meta standing in for this device's; the CUDA runtime never touched

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    @property
    def live_cuda(self) -> bool:
        """A real GPU: the CUDA runtime (streams, events, the allocator's statistics) is there to call."""
        return self.kind == "cuda" and not self.rehearsal

    @property
    def torch_device(self) -> torch.device:
        if self.rehearsal:
            return torch.device("meta")
        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")

    def autocast(self, dtype: torch.dtype) -> contextlib.AbstractContextManager:
        """Autocast to ``dtype`` on this device (a rehearsal: CUDA's policy on its meta tensors)."""
        if self.rehearsal:
            return meta_autocast.MetaAutocast(dtype)
        return torch.autocast(self.kind, dtype=dtype)

    def activate(self) -> None:
        """Bind this process to its device (one GPU per process under torchrun)."""
        if self.live_cuda:
            torch.cuda.set_device(self.index)

    def make_deterministic(self) -> None:
        """Kernels that give the same bits on every run (train.deterministic): what a bit-exact resume
        on CUDA needs, where some default kernels accumulate with atomics in a varying order (index_add
        in the embedding's backward, some attention backwards). cuBLAS needs its workspace fixed before
        its first use. CPU kernels here are deterministic already; the flag costs GPU speed."""
        if self.kind == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True)

    def set_tf32(self, enabled: bool) -> None:
        """fp32 matmuls and convolutions on TF32 tensor cores (train.tf32: on by default, as torchtitan and
        Megatron-LM run): 10 mantissa bits in the products, fp32 accumulation. Nothing on a CPU."""
        if self.live_cuda:
            torch.backends.cuda.matmul.allow_tf32 = enabled
            torch.backends.cudnn.allow_tf32 = enabled

    def synchronize(self) -> None:
        if self.live_cuda:
            torch.cuda.synchronize(self.index)

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated on the device, or None where the allocator does not track it (CPU)."""
        return torch.cuda.max_memory_allocated(self.index) if self.live_cuda else None

    def memory_allocated(self) -> int:
        """Bytes allocated on the device now (0 on CPU: parallel/memory_meter.py counts there)."""
        return torch.cuda.memory_allocated(self.index) if self.live_cuda else 0

    def reset_peak_memory(self) -> None:
        if self.live_cuda:
            torch.cuda.reset_peak_memory_stats(self.index)

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The generators dropout draws from: the CPU one, and this GPU's when on cuda."""
        state = {"torch": torch.get_rng_state()}
        if self.live_cuda:
            state["cuda"] = torch.cuda.get_rng_state(self.index)
        return state

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["torch"])
        if self.live_cuda and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.index)

    def name(self) -> str:
        """What the device is, for reports ("NVIDIA H200", or the CPU's vector ISA)."""
        if self.rehearsal:
            return f"{self.kind} (rehearsed on meta tensors)"
        if self.kind == "cuda":
            return torch.cuda.get_device_name(self.index)
        return f"cpu ({torch.backends.cpu.get_cpu_capability()})"

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if self.live_cuda and dtype == torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        if self.live_cuda and dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return torch.cuda.get_device_capability() >= (8, 9)  # _scaled_mm's float8 kernels: Ada, Hopper on
        return True


class Stopwatch:
    """Time marks in the device's own order, read as host seconds afterwards. On CPU a mark is
    ``perf_counter`` (the work before it is done when the call returns). On CUDA it is an event
    recorded on the current stream, resolved by ``seconds`` after the recording: synchronising at
    every mark instead would serialise the host with the GPU and hide the very overlap a pipeline
    trace is meant to show. CUDA times are the origin's host time plus event-measured elapsed time,
    so ranks of one node still share perf_counter's clock."""

    def __init__(self, device: Device) -> None:
        self.cuda = device.live_cuda
        if self.cuda:
            torch.cuda.synchronize(device.index)  # once per window: fixes the origin on both clocks
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
        self.origin_s = time.perf_counter()

    def mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: object) -> float:
        if not self.cuda:
            return float(mark)
        mark.synchronize()
        return self.origin_s + self.origin.elapsed_time(mark) / 1e3


class HostCopies:
    """Copies of tensors to host memory and back beside the compute (pipeline/offload.py).

    CUDA: each direction on a side stream of its own, host buffers pinned, ordered by events: a copy
    out starts once the compute stream has produced the tensor, and the device memory goes back to the
    caching allocator once it is done (``record_stream``: the caller may drop the tensor at once); a
    copy back waits for its copy out and is waited for by the compute stream where it is used.
    CPU: the same three steps on one background thread (first in, first out, so a copy back follows its
    copy out): the copy out is made on that thread, into a host buffer that an earlier copy freed where
    one fits (as the caching host allocator gives pinned buffers on CUDA), and the tensor a copy back
    fills is allocated on the caller's, as on CUDA. The thread takes the copies a batch at a time: the
    copies out asked for until ``flush`` (the offload flushes at every layer), the copies back of one
    ``to_device`` call; each hand-over costs the caller a wake-up of the thread and a wait for the
    interpreter's lock, about as long as a small layer's copies. Host memory is the device's on a CPU,
    so nothing is saved there; what this gives is the offload's logic and timing run for real, and a
    device-memory figure where only the caller's allocations count (parallel/memory_meter.py).
    A rehearsal: the copies are meta tensors, those out made where no dispatch mode sees them (host
    memory, which the rehearsal does not count as the device's), those back where it does."""

    def __init__(self, device: Device) -> None:
        self.cuda, self.meta = device.live_cuda, device.rehearsal
        self.device = device.torch_device
        if self.meta:
            return
        if self.cuda:
            self.out_stream, self.in_stream = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        else:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="mpformer-offload")
            self.host = HostBufferCache()  # the caching host allocator's part (parallel/host_buffers.py)
            self._pending: list[tuple[torch.Tensor, dict]] = []  # copies out not yet handed to the thread

    def to_host(self, t: torch.Tensor) -> dict:
        """Start copying ``t`` out (CPU: at the next ``flush``); returns the copy's record for
        ``to_device`` and ``result``."""
        if self.meta:
            with _disable_current_modes():
                return {"host": torch.empty_like(t)}
        if not self.cuda:
            copy: dict = {}
            self._pending.append((t, copy))
            return copy
        stream = self.out_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # t's own strides where it is dense (a saved transposed view comes back as it went, so the
            # backward's GEMMs take the layout they would have; CPU's cache keeps them too); else packed
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)  # a non-dense t: the copy engine gathers it (a temporary on this stream)
            t.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        return {"host": host, "out": done}

    def flush(self) -> None:
        """CPU: hand the copies out asked for since the last flush to the thread, as one task. CUDA:
        nothing (each is on its stream already)."""
        if self.meta or self.cuda or not self._pending:
            return
        tensors, copies = zip(*self._pending)
        self._pending = []
        done = self.pool.submit(_copies_out, self.host, tensors)
        for i, copy in enumerate(copies):
            copy["host"] = (done, i)

    def to_device(self, *copies: dict) -> None:
        """Start bringing copies back (prefetch); ``result`` waits for each."""
        todo = [c for c in copies if "back" not in c]
        if not todo:
            return
        if self.meta:
            for c in todo:
                c["back"], c["in"] = torch.empty_like(c["host"]), None
            return
        if not self.cuda:
            self.flush()
            # The copies out's shapes and strides (a dense tensor's kept): done by now but for a
            # unit whose backward follows at once, where this waits for them, as CUDA's stream would.
            backs = [torch.empty_like(c["host"][0].result()[c["host"][1]]) for c in todo]
            done = self.pool.submit(_copies_back, [(b, *c["host"]) for b, c in zip(backs, todo)])
            for b, c in zip(backs, todo):  # a record has both or neither
                c["back"], c["in"] = b, done
            return
        for copy in todo:
            self._to_device(copy)

    def _to_device(self, copy: dict) -> None:
        # Allocated on the compute stream (its cached blocks are the ones the compute reuses), filled on
        # the side stream once the copy out is done.
        host, stream = copy["host"], self.in_stream
        back = torch.empty_like(host, device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        stream.wait_event(copy["out"])
        with torch.cuda.stream(stream):
            back.copy_(host, non_blocking=True)
            back.record_stream(stream)
            copy["in"] = torch.cuda.Event()
            copy["in"].record(stream)
        copy["back"] = back

    def result(self, copy: dict, keep: bool = False) -> torch.Tensor:
        """The tensor again on the device, usable on the current stream. Unless ``keep`` (a tensor saved
        in more places, read again later), the record lets go of it, so that autograd frees it node by
        node as without offload (asked again, it is copied back again)."""
        self.to_device(copy)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(copy["in"])
        elif not self.meta:
            copy["in"].result()
        if keep:
            return copy["back"]
        del copy["in"]
        return copy.pop("back")


def _copies_out(host: HostBufferCache, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [host.empty_like(t).copy_(t) for t in tensors]


def _copies_back(pairs: Sequence[tuple[torch.Tensor, Future, int]]) -> None:
    # Returns nothing: a result would keep the device tensors alive after autograd let go of them.
    for back, done, i in pairs:
        back.copy_(done.result()[i])


def gpu_index(local_rank: int, local_world: int, visible: int) -> int:
    """The visible GPU a process drives. Two launch styles are normal: every process of a node sees
    all its GPUs (torchrun's default: GPU = LOCAL_RANK), or each sees only its own (SLURM's
    --gpus-per-task, Kubernetes, a per-rank CUDA_VISIBLE_DEVICES: one visible GPU, index 0).
    Anything else would put two ranks on one GPU, which NCCL rejects later and less clearly."""
    if visible <= 0:
        raise ConfigError("train.device=cuda but no CUDA device is visible; valid here: cpu, auto")
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise ConfigError(f"LOCAL_RANK={local_rank} (of {local_world} processes on this node) but this process sees "
                      f"{visible} GPUs; valid: one visible GPU per process, or at least LOCAL_WORLD_SIZE visible")


def resolve_device(kind: str = "auto", local_rank: int | None = None) -> Device:
    """Pick the device for this process: 'auto' takes cuda when a GPU is visible, else cpu."""
    if kind not in DEVICE_KINDS:
        raise ConfigError(f"train.device={kind!r} is unknown; valid: {', '.join(DEVICE_KINDS)}")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    has_cuda = torch.cuda.is_available()
    if kind == "cuda" and not has_cuda:
        raise ConfigError("train.device=cuda but no CUDA device is visible; valid here: cpu, auto")
    if kind == "auto":
        kind = "cuda" if has_cuda else "cpu"
    if kind == "cpu":
        return Device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    return Device("cuda", gpu_index(local_rank, local_world, torch.cuda.device_count()))
