"""parallel/host_buffers.py: host buffers reused across copies, laid out as ``torch.empty_like`` lays them
out, lent until no tensor uses them, given back safely from any thread, and bounded."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from mpformer.parallel.device import Device, HostCopies
from mpformer.parallel.host_buffers import HostBufferCache


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
    lambda: torch.randn(2, 8, 5, 6).to(memory_format=torch.channels_last)[:, :4],  # not dense: channels_last kept
    lambda: torch.tensor(3.0),
])
def test_layout_is_empty_likes(make):
    t = make()
    out = HostBufferCache().empty_like(t).copy_(t)
    ref = torch.empty_like(t)
    assert (out.shape, out.dtype, out.device) == (ref.shape, ref.dtype, ref.device)
    assert out.stride() == ref.stride()
    assert torch.equal(out, t)


def test_a_sparse_tensor_keeps_its_form():
    t = torch.sparse_coo_tensor([[0], [5]], [1.0], (4, 8), check_invariants=True)
    assert HostBufferCache().empty_like(t).layout == torch.sparse_coo


def test_a_freed_buffer_is_lent_again_and_not_before():
    cache = HostBufferCache()
    a = cache.empty_like(torch.empty(256))
    a_ptr = a.data_ptr()
    alias = a[::2]  # a view outlives the loan's own tensor: the block stays lent
    del a
    gc.collect()
    b = cache.empty_like(torch.empty(16, 16))
    b_ptr = b.data_ptr()
    assert b_ptr != a_ptr and cache.allocated == 2
    del alias, b
    c = cache.empty_like(torch.empty(16, 16))  # the same bytes, another shape: a freed block
    assert c.data_ptr() in (a_ptr, b_ptr) and (cache.reused, cache.allocated) == (1, 2)
    assert (cache.in_use, cache.free_bytes, cache.high_water) == (1024, 1024, 2048)
    d = cache.empty_like(torch.empty(8))  # another size: a new block, and the free 1024 go (over 2048)
    assert cache.allocated == 3 and (cache.in_use, cache.free_bytes) == (1024 + 32, 0)
    del c, d
    assert (cache.in_use, cache.free_bytes) == (0, 1024 + 32)
    cache.clear()
    assert cache.free_bytes == 0


def test_new_shapes_replace_stale_ones_within_the_high_water():
    """After a change of shapes the new sizes are kept and reused, and what is lent and free together
    never exceeds the most lent at once."""
    cache = HostBufferCache()
    for shape_step in [(512,)] * 3 + [(384,)] * 3 + [(100,), (200,)] * 3:
        before = cache.allocated
        lent = [cache.empty_like(torch.empty(shape_step[0] * 64)) for _ in range(4)]
        assert cache.in_use + cache.free_bytes <= cache.high_water
        del lent
        assert cache.in_use + cache.free_bytes <= cache.high_water
    assert before == cache.allocated  # the last step reused every block
    assert cache.high_water == 4 * 512 * 64 * 4


def test_a_buffer_given_back_inside_the_cache_does_not_deadlock():
    """A loan can die while its thread is inside the cache's lock (a garbage collection that starts in
    there): giving it back must not wait for that lock."""
    cache = HostBufferCache()
    loan = [cache.empty_like(torch.empty(64))]

    def drop_under_the_lock() -> None:
        with cache._lock:
            loan.clear()

    th = threading.Thread(target=drop_under_the_lock, daemon=True)
    th.start()
    th.join(timeout=10)
    assert not th.is_alive(), "the finalizer waited for the lock its own thread holds"
    assert cache.in_use == 0 and cache.free_bytes == 64 * 4


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
