"""The node's pool of freed payload buffers: reused only when nothing refers to them."""

from __future__ import annotations

import numpy as np

from kvring.cachenode.buffers import MIN_POOLED, SLAB, BufferPool, SlabPool
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


def test_a_full_pool_lets_the_buffers_freed_longest_ago_go_first():
    pool = BufferPool(limit=3 * MIN_POOLED)
    old = [np.empty(MIN_POOLED, np.uint8) for _ in range(3)]  # a size no longer stored
    for i in range(3):
        pool.give(old[i])
    new = np.empty(2 * MIN_POOLED, np.uint8)
    pool.give(new)  # the two oldest go to make room
    assert pool.bytes == 3 * MIN_POOLED
    del new
    assert pool.take(2 * MIN_POOLED).nbytes == 2 * MIN_POOLED and pool.reused == 1
    del old[:]
    assert pool.take(MIN_POOLED) is not None and pool.reused == 2  # the newest of the old size stayed


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


def test_a_duplicate_puts_buffer_goes_to_the_pool_and_the_stored_copy_stays():
    pool = BufferPool(limit=1 << 30)
    store = ChunkStore(1 << 20, recycle=pool.give)
    first, again = pool.take(MIN_POOLED), pool.take(MIN_POOLED)
    first[:], again[:] = 1, 2
    key = b"k" * 16
    assert store.put(key, make_meta(first, [1, MIN_POOLED], "uint8", 1), first)
    assert not store.put(key, make_meta(again, [1, MIN_POOLED], "uint8", 1), again)
    assert pool.bytes == MIN_POOLED and store.get(key).buf[0] == 1
    del again
    assert pool.take(MIN_POOLED)[0] == 2 and pool.reused == 1  # the next PUT is read into it


def test_a_slab_is_carved_again_once_every_payload_in_it_is_dropped():
    pool = SlabPool(limit=2 * SLAB)
    first = pool.take(MIN_POOLED)
    second = pool.take(3 * MIN_POOLED)  # another size, the same slab, right after the first
    assert first.base is second.base and pool.bytes == SLAB
    start = first.__array_interface__["data"][0]
    assert second.__array_interface__["data"][0] == start + MIN_POOLED
    view = memoryview(second)[:8]  # as a caller still holding a layer's view does
    del first, second
    other = pool.take(MIN_POOLED)  # the slab is not idle: carved on from where it was
    assert other.__array_interface__["data"][0] == start + 4 * MIN_POOLED and pool.reused == 0
    del other, view
    again = pool.take(2 * MIN_POOLED)  # every payload dropped: carved again from its start
    assert again.__array_interface__["data"][0] == start and pool.reused == 1 and pool.bytes == SLAB


def test_the_slab_pool_is_bounded_and_makes_room_from_idle_slabs():
    pool = SlabPool(limit=2 * SLAB + MIN_POOLED)
    held = [pool.take(SLAB // 2) for _ in range(4)]  # two slabs, both in use
    assert pool.bytes == 2 * SLAB
    extra = pool.take(SLAB // 2)  # full and nothing idle: memory of its own, outside the pool
    assert all(extra.base is not h.base for h in held) and pool.bytes == 2 * SLAB
    del held[2:], extra  # the second slab is idle now
    big = pool.take(SLAB + MIN_POOLED)  # larger than a slab: the idle one goes to make room
    assert big.nbytes == SLAB + MIN_POOLED and pool.bytes == 2 * SLAB + MIN_POOLED
    assert big.base.nbytes == SLAB + MIN_POOLED
    del big
    small = pool.take(MIN_POOLED)  # any idle slab large enough serves any size
    assert small.base.nbytes == SLAB + MIN_POOLED and pool.reused == 1


def test_reserved_slabs_are_mapped_ahead_and_serve_the_first_reads():
    pool = SlabPool(limit=3 * SLAB)
    pool.reserve(SLAB + 1)  # rounded up to whole slabs
    assert pool.bytes == 2 * SLAB
    a, b = pool.take(SLAB), pool.take(SLAB)  # no new slab: the reserved ones
    assert pool.bytes == 2 * SLAB and a.base is not b.base and pool.reused == 0
    pool.reserve(100 * SLAB)
    assert pool.bytes == 3 * SLAB  # never past the limit
