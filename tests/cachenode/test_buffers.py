"""Buffers: the node's pool of freed payload buffers (reused only when nothing refers to them),
the client's slabs, and a frame reader's memory (what arrived, never what was declared)."""

from __future__ import annotations

import os
import random
import socket
import tracemalloc

import numpy as np
import pytest

from kvring.cachenode.buffers import MIN_POOLED, SLAB, BufferPool, SlabPool
from kvring.cachenode.framing import FIRST_BUFFER, MAGIC, PREFIX, RECV_BUFFER, FrameLimits, FrameReader, pack
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


LIMITS = FrameLimits(max_header=1 << 20, max_payloads=4, max_payload=64 << 20, max_total=64 << 20)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def _send_some(sock: socket.socket, data: bytes) -> int:
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0


def _drain(reader: FrameReader, sock: socket.socket) -> list:
    """Every message the bytes waiting on ``sock`` complete."""
    got = reader.read(sock)
    while reader.received:
        got += reader.read(sock)
    return got


def _pump(reader: FrameReader, a: socket.socket, b: socket.socket, data: bytes) -> list:
    """Send ``data`` on ``a`` while reading ``b``; the messages read."""
    got, sent = [], 0
    while sent < len(data) or reader.received:
        sent += _send_some(a, data[sent:])
        got += reader.read(b)
    return got


def test_a_receive_buffer_starts_small_doubles_with_full_reads_and_is_let_go_when_idle(pair):
    a, b = pair
    reader = FrameReader(LIMITS)
    message = b"".join(pack(b"h" * 100, [b"p" * 1000]))
    data = message * 400  # 450 KB of small messages
    sent = _send_some(a, data)
    assert sent > 4 * FIRST_BUFFER
    got = reader.read(b)
    assert reader.received == FIRST_BUFFER  # taken at the first read, small
    sizes = [reader.received]
    while sent < len(data) or reader.received:
        sent += _send_some(a, data[sent:])
        got += reader.read(b)
        sizes.append(reader.received)
    # Full reads double it (less a partial message moved to its front), up to RECV_BUFFER.
    assert sizes[1] > FIRST_BUFFER and RECV_BUFFER // 2 < max(sizes) <= RECV_BUFFER, sizes
    assert len(got) == 400 and reader.held == 0
    reader.trim()
    _send_some(a, message * 20)
    reader.read(b)
    assert reader.received == FIRST_BUFFER  # a fresh small buffer after an idle spell


def test_a_large_header_costs_what_arrived_not_what_its_prefix_declared(pair):
    a, b = pair
    reader = FrameReader(LIMITS)
    header = os.urandom(1 << 20)
    data = PREFIX.pack(MAGIC, len(header), 0, 0) + header
    tracemalloc.start()
    try:
        a.sendall(data[:PREFIX.size])
        assert _drain(reader, b) == []
        assert reader.declared == PREFIX.size + len(header) and reader.held == PREFIX.size
        assert tracemalloc.get_traced_memory()[1] < 2 * FIRST_BUFFER  # the buffer, no header's worth
        sent = PREFIX.size + _send_some(a, data[PREFIX.size:PREFIX.size + 100_000])
        assert _drain(reader, b) == [] and reader.held == sent
        assert tracemalloc.get_traced_memory()[1] < sent + RECV_BUFFER + (64 << 10)
    finally:
        tracemalloc.stop()
    got = _pump(reader, a, b, data[sent:])
    assert bytes(got[0].header) == header and reader.held == 0 and reader.declared == 0


def test_a_large_payloads_buffer_is_taken_once_its_first_byte_is_here(pair):
    a, b = pair
    taken = []
    reader = FrameReader(LIMITS, allocate=lambda n: taken.append(n) or np.empty(n, np.uint8))
    payload = os.urandom(8 << 20)
    head, _ = pack(b"h" * 200, [payload])
    a.sendall(head)
    assert _drain(reader, b) == [] and taken == []  # a declared 8 MiB takes nothing yet
    assert reader.declared == len(head) + len(payload)
    a.sendall(payload[:1])
    assert _drain(reader, b) == [] and taken == [len(payload)]
    sent = 1
    got = []
    while not got:
        sent += _send_some(a, payload[sent:])
        got += reader.read(b)
        if reader.received:
            assert reader.held == len(head) + sent or got
    assert np.array_equal(got[0].payloads[0], np.frombuffer(payload, np.uint8)) and reader.held == 0


def test_messages_cut_anywhere_come_out_whole():
    rng = random.Random(3)
    limits = FrameLimits(max_header=1 << 20, max_payloads=8, max_payload=4 << 20, max_total=16 << 20)
    messages = []
    for _ in range(60):
        header = os.urandom(rng.choice([0, 5, 300, 70_000, 1 << 20]))
        payloads = [os.urandom(rng.choice([0, 3, 1000, 65_535, 65_536, 300_000, 2 << 20]))
                    for _ in range(rng.choice([0, 1, 2, 4]))]
        messages.append((header, payloads))
    data = b"".join(b"".join(bytes(memoryview(x)) for x in pack(h, p)) for h, p in messages)
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        b.setblocking(False)
        reader = FrameReader(limits)
        got, sent = [], 0
        while len(got) < len(messages):
            if sent < len(data):
                sent += _send_some(a, data[sent:sent + rng.choice([1, 7, 14, 100, 5000, 70_000, 1 << 20])])
            got += reader.read(b)
            assert reader.held <= sent
            if rng.random() < 0.2:
                reader.trim()
    for (header, payloads), message in zip(messages, got):
        assert bytes(message.header) == header
        assert [bytes(memoryview(p)) for p in message.payloads] == payloads
    assert reader.held == 0
