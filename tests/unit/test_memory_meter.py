"""parallel/memory_meter.py's StorageMeter against the C library's own count of bytes in use (glibc's
``mallinfo2``: every tensor's memory comes from malloc on CPU), and what it leaves out."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from mpformer.parallel.device import Device
from mpformer.parallel.memory_meter import PeakMemory, StorageMeter


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]


def _malloc_in_use() -> int:
    """Bytes glibc has handed out: its heap's in-use chunks and its mmapped ones (large tensors)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("the C library has no mallinfo2 (glibc >= 2.33)")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                                     torch.nn.Linear(1024, 256)) for _ in range(4)])


def test_meter_counts_what_malloc_counts():
    """After the forward (the saved activations) and after the backward (the gradients): the meter's
    bytes equal malloc's growth within 1% (malloc adds a chunk header per block, and the interpreter's
    own small objects); the first pass warms one-time buffers up and is not compared."""
    import gc

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no worker threads' arenas in the count
    gc.collect()  # earlier tests' garbage, freed by a collection inside the window, would count against it
    gc.disable()
    try:
        model, x = _model(), torch.randn(512, 256)
        for step in range(3):
            for p in model.parameters():
                p.grad = None
            before = _malloc_in_use()
            with StorageMeter() as meter:
                loss = model(x).square().mean()
                forward, forward_malloc = meter.current, _malloc_in_use() - before
                loss.backward()
                del loss
                end, end_malloc = meter.current, _malloc_in_use() - before
            if step:
                assert forward == pytest.approx(forward_malloc, rel=1e-2)
                assert end == pytest.approx(end_malloc, rel=1e-2)
        # the forward saves each block's two 512x1024 fp32 activations and its 512x256 output (fp32)
        assert forward >= 4 * (2 * 512 * 1024 + 512 * 256) * 4
        grads = sum(p.numel() * 4 for p in model.parameters())
        assert end == grads and meter.peak > forward
    finally:
        gc.enable()
        torch.set_num_threads(threads)


def test_meter_leaves_out_what_was_there_and_other_threads():
    """Parameters and views of them (a transposed weight) are not new memory; a tensor another thread
    allocates (HostCopies' copy thread) is not counted; a freed tensor leaves the count."""
    import threading

    w = torch.randn(1024, 1024)
    with StorageMeter() as meter:
        wt = w.t()
        assert meter.current == 0
        y = w @ wt
        assert meter.current == y.numel() * 4
        other = []
        t = threading.Thread(target=lambda: other.append(torch.randn(1024, 1024)))
        t.start()
        t.join()
        assert meter.current == y.numel() * 4
        del y
        assert meter.current == 0
    assert meter.peak == 1024 * 1024 * 4


def test_peak_memory_on_cpu_is_the_meters_peak():
    with PeakMemory(Device("cpu")) as m:
        a = torch.ones(1000)
        b = a * 2
        del a, b
        c = torch.ones(500)
    assert m.peak == 8000 and c.numel() == 500
