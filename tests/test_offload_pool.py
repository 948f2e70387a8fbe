"""The aligned buffer pool: alignment, lazy allocation, eviction of prefetched blocks, waiting."""

import threading

import pytest
import torch

from zeroshard.offload.pool import BufferPool, aligned_empty

BLOCK = 8192


def make(num_buffers: int = 2) -> BufferPool:
    return BufferPool(
        num_buffers=num_buffers, buffer_bytes=BLOCK, align_bytes=4096, pin_memory=False
    )


def test_buffers_are_aligned_and_allocated_on_first_use():
    pool = make(3)
    assert pool.allocated_bytes == 0
    indices = [pool.acquire() for _ in range(3)]
    assert pool.allocated_bytes == 3 * BLOCK
    for i in indices:
        view = pool.view(i)
        assert view.numel() == BLOCK and view.data_ptr() % 4096 == 0
        assert len(pool.memoryview(i, 4096)) == 4096
    assert len({pool.view(i).data_ptr() for i in indices}) == 3


def test_bad_sizes_are_value_errors():
    with pytest.raises(ValueError, match="multiple of 4096"):
        BufferPool(num_buffers=2, buffer_bytes=5000, align_bytes=4096, pin_memory=False)
    with pytest.raises(ValueError, match="num_buffers"):
        BufferPool(num_buffers=0, buffer_bytes=BLOCK, align_bytes=4096, pin_memory=False)


def test_prefetch_never_evicts_but_demand_does():
    pool = make(2)
    a, b = pool.try_acquire(), pool.try_acquire()
    pool.put_cached("x", 0, a)
    pool.put_cached("y", 0, b)
    assert pool.try_acquire() is None  # a hint must not push out other hints
    assert pool.acquire() == a  # demand takes the oldest cached block
    assert pool.num_evictions == 1
    assert pool.take_cached("x", 0) is None  # evicted
    assert pool.take_cached("y", 0) == b
    pool.release(a)
    pool.release(b)
    assert pool.num_free() == 2 and pool.max_in_use == 2


def test_drop_cached_frees_only_that_name():
    pool = make(3)
    for block, name in enumerate(["x", "x", "y"]):
        pool.put_cached(name, block, pool.acquire())
    pool.drop_cached("x")
    assert pool.num_cached() == 1 and pool.num_free() == 2


def test_acquire_waits_for_a_release():
    pool = make(1)
    held = pool.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # nothing free and nothing cached: it waits
    pool.release(held)
    waiter.join(5)
    assert got == [held]


def test_aligned_empty():
    t = aligned_empty((3, 5), torch.bfloat16, align_bytes=4096, pin_memory=False)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
