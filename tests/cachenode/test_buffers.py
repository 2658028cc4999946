"""The node's pool of freed payload buffers: reused only when nothing refers to them."""

from __future__ import annotations

import numpy as np

from kvring.cachenode.buffers import MIN_POOLED, BufferPool
from kvring.cachenode.store import ChunkStore
from kvring.common.chunk import make_meta


def test_a_buffer_is_reused_only_once_no_view_of_it_remains():
    pool = BufferPool(limit=4 * MIN_POOLED)
    buf = pool.take(MIN_POOLED)
    view = memoryview(buf)[:16]  # as a GET still sending from a deleted chunk holds
    pool.give(buf)
    del buf
    other = pool.take(MIN_POOLED)
    assert other is not view.obj and pool.reused == 0  # still in use: a fresh buffer instead
    del view
    again = pool.take(MIN_POOLED)
    assert pool.reused == 1 and pool.bytes == 0 and again.nbytes == MIN_POOLED


def test_the_pool_is_bounded_and_keeps_only_large_arrays():
    pool = BufferPool(limit=2 * MIN_POOLED)
    for _ in range(5):
        pool.give(np.empty(MIN_POOLED, np.uint8))
    pool.give(np.empty(1024, np.uint8))
    pool.give(bytearray(MIN_POOLED))
    assert pool.bytes == 2 * MIN_POOLED
    assert pool.take(3 * MIN_POOLED).nbytes == 3 * MIN_POOLED and pool.reused == 0  # no such size: fresh


def test_the_store_hands_evicted_and_deleted_payloads_to_the_pool():
    pool = BufferPool(limit=1 << 30)
    store = ChunkStore(3 * (MIN_POOLED + 1024), recycle=pool.give)
    for i in range(4):  # the fourth evicts the first
        buf = pool.take(MIN_POOLED)
        buf[:] = i
        store.put(bytes([i]) * 16, make_meta(buf, [1, MIN_POOLED], "uint8", 1), buf)
    del buf
    assert store.evictions == 1 and pool.bytes == MIN_POOLED
    reused = pool.take(MIN_POOLED)
    assert pool.reused == 1 and reused[0] == 0  # the evicted chunk's buffer
    assert store.delete(bytes([1]) * 16) and pool.bytes == MIN_POOLED
    assert store.get(bytes([2]) * 16).buf[0] == 2  # stored payloads are never handed out


def test_a_lending_pool_reuses_what_its_callers_dropped():
    pool = BufferPool(limit=2 * MIN_POOLED, lend=True)
    first = pool.take(MIN_POOLED)
    second = pool.take(MIN_POOLED)
    assert first is not second and pool.bytes == 2 * MIN_POOLED
    third = pool.take(MIN_POOLED)  # both still held by the caller; the pool is full: a fresh one
    assert third is not first and third is not second and pool.reused == 0 and pool.bytes == 2 * MIN_POOLED
    first_id = id(first)
    del first
    again = pool.take(MIN_POOLED)
    assert id(again) == first_id and pool.reused == 1
    view = memoryview(again)[:8]
    del again
    assert id(pool.take(MIN_POOLED)) != first_id  # a view of it is still alive
    del view


def test_a_full_lending_pool_makes_room_for_a_new_size_from_idle_buffers():
    pool = BufferPool(limit=4 * MIN_POOLED, lend=True)
    held = pool.take(2 * MIN_POOLED)  # still in use by its caller
    pool.take(2 * MIN_POOLED)  # dropped at once: idle
    assert pool.bytes == 4 * MIN_POOLED
    small = [pool.take(MIN_POOLED) for _ in range(2)]  # the idle one goes, the held one stays
    assert pool.bytes == 4 * MIN_POOLED and all(b.nbytes == MIN_POOLED for b in small)
    held_id = id(held)
    del held
    assert id(pool.take(2 * MIN_POOLED)) == held_id  # still pooled: reused once its caller let go
