"""parallel/host_buffers.py: host buffers reused across copies, laid out as ``torch.empty_like`` lays them
out, and bounded."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from mpformer.parallel.device import Device, HostCopies
from mpformer.parallel.host_buffers import HostBufferCache, dense_strides


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 6),
    lambda: torch.randn(6, 4).t(),  # a saved transposed weight: dense, not contiguous
    lambda: torch.randn(2, 3, 5).permute(2, 0, 1),
    lambda: torch.randn(4, 1, 6)[:, :, ::2],  # not dense: packed
    lambda: torch.randn(3, 1).expand(3, 4),  # overlapping: packed
    lambda: torch.randn(1, 5).as_strided((1, 5), (99, 1)),  # a size-1 dim's stride does not matter
    lambda: torch.randn(0, 3),
    lambda: torch.arange(12, dtype=torch.int64).view(3, 4),
    lambda: torch.randn(3, 4).to(torch.bfloat16),
])
def test_layout_is_empty_likes(make):
    t = make()
    out = HostBufferCache().empty_like(t).copy_(t)
    ref = torch.empty_like(t)
    assert (out.shape, out.dtype, out.device) == (ref.shape, ref.dtype, ref.device)
    if t.numel():
        assert out.stride() == ref.stride() == dense_strides(t)
    assert torch.equal(out, t)


def test_a_freed_buffer_is_lent_again_and_the_cache_is_bounded():
    cache = HostBufferCache()
    a = cache.empty_like(torch.empty(256))
    a_ptr = a.data_ptr()
    del a
    gc.collect()
    b = cache.empty_like(torch.empty(16, 16))  # the same bytes, another shape: the same buffer
    assert b.data_ptr() == a_ptr and (cache.reused, cache.allocated) == (1, 1)
    c = cache.empty_like(torch.empty(8))  # another size: a new one
    assert c.data_ptr() != a_ptr and cache.allocated == 2
    assert cache.in_use == 256 * 4 + 8 * 4 and cache.high_water == cache.in_use
    del b, c
    assert (cache.in_use, cache.free_bytes) == (0, 256 * 4 + 8 * 4)
    # Shapes that change every time: what is kept free never exceeds the most lent at once.
    for n in range(1, 40):
        x = cache.empty_like(torch.empty(n * 64))
        del x
        assert cache.free_bytes <= cache.high_water
    cache.clear()
    assert cache.free_bytes == 0


def test_buffers_given_back_from_other_threads():
    """Buffers die on autograd's threads and the compute's while the copy thread takes them: the
    counts stay exact."""
    cache = HostBufferCache()
    lent: list[torch.Tensor] = [cache.empty_like(torch.empty(32)) for _ in range(200)]

    def drop(part: list[torch.Tensor]) -> None:
        part.clear()

    threads = [threading.Thread(target=drop, args=(lent[i::4],)) for i in range(4)]
    lent.clear()  # only the threads' lists hold them now
    taken = []
    for th in threads:
        th.start()
    for _ in range(100):
        taken.append(cache.empty_like(torch.empty(32)))
    for th in threads:
        th.join()
    assert cache.in_use == 100 * 32 * 4
    assert cache.allocated + cache.reused == 300
    del taken
    assert cache.in_use == 0 and cache.free_bytes == cache.high_water


def test_host_copies_reuse_their_buffers_on_cpu():
    """HostCopies' CPU copies out land in buffers that earlier copies freed: a steady step touches no
    new host memory (parallel/host_buffers.py's docstring for why that matters)."""
    copies = HostCopies(Device("cpu"))
    for step in range(3):
        records = [copies.to_host(torch.full((64, 32), float(step * 4 + i))) for i in range(4)]
        copies.flush()
        for i, r in enumerate(records):
            assert torch.equal(copies.result(r), torch.full((64, 32), float(step * 4 + i)))
        del records, r
    assert (copies.host.allocated, copies.host.reused) == (4, 8)
