"""A node's two tiers as one set (``Holdings``) while a disk read is under way: a real data loop
(``Server``), a real memory store and a real disk tier over files.  Each test holds one read
between the disk handing the chunk back and the loop taking it (a pause around the tier's own
``read_record``), changes what the node holds meanwhile, then lets the read finish."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from polling import wait_for

from kvring.cachenode.disk.identity import DiskIdentity
from kvring.cachenode.disk.tier import DiskConfig, DiskTier
from kvring.cachenode.framing import FrameLimits
from kvring.cachenode import holdings as holdings_module
from kvring.cachenode.holdings import Holdings
from kvring.cachenode.server import Server
from kvring.cachenode.store import ChunkStore
from kvring.common.chunk import ChunkItem

IDENTITY = DiskIdentity(cluster="c", node_id="node-0", contract='{"chunk_size": 256}')
MIB = 1 << 20


def _item(namespace: str = "ns") -> ChunkItem:
    payload = np.frombuffer(os.urandom(MIB), dtype=np.uint8)
    return ChunkItem.of(os.urandom(16), payload, [4, MIB // 4], "uint8", 16, namespace)


class _Node:
    """A data loop on its thread, a 4 MiB memory store and a 64 MiB disk of 16 MiB segments."""

    def __init__(self, path) -> None:
        self.server = Server("127.0.0.1", 0, lambda conn, message: None, FrameLimits(1 << 16, 4, 2 * MIB, 4 * MIB))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.disk = DiskTier(DiskConfig(str(path), capacity=64 * MIB, segment_bytes=16 * MIB, read_timeout=30.0,
                                        scrub_rate=0), IDENTITY, take=lambda n: np.empty(n, dtype=np.uint8))
        self.disk.open()
        self.holdings = Holdings(ChunkStore(4 * MIB), self.disk, self.server)
        self._held: dict[bytes, threading.Event] = {}
        self._before: dict[bytes, threading.Event] = {}
        self.paused = threading.Event()
        read_record = self.disk.read_record

        def held_read(key, location, take=None, fd=-1):
            before = self._before.get(key)
            if before is not None:  # held before it opens its segment's file
                self.paused.set()
                assert before.wait(30)
            got = read_record(key, location, take, fd)
            release = self._held.get(key)
            if release is not None:
                self.paused.set()
                assert release.wait(30)
            return got

        self.disk.read_record = held_read

    def put(self, items: list[ChunkItem], settle: bool = True) -> None:
        for item in items:
            assert self.server.call(lambda item=item: self.holdings.put(item.key, item.meta, item.payload))
        if settle:
            wait_for(lambda: not self.disk.stats()["queued"], 20, "the disk writes")

    def fetch_held(self, key: bytes, meanwhile) -> object:
        """Fetch ``key`` (only on disk), run ``meanwhile()`` while its read is held, then let it
        finish; the entry the fetch answered."""
        release, answered, out = threading.Event(), threading.Event(), []
        self._held[key] = release
        self.paused.clear()
        self.server.call(lambda: self.holdings.fetch([key], lambda entries: (out.append(entries[0]), answered.set())))
        assert self.paused.wait(10), "the read did not start"
        meanwhile()
        release.set()
        assert answered.wait(10)
        del self._held[key]
        return out[0]

    def close(self) -> None:
        self.server.stop()
        self.thread.join(10)
        self.disk.close()


@pytest.fixture
def node(tmp_path):
    n = _Node(tmp_path)
    yield n
    n.close()


def _in_memory(node: _Node, key: bytes) -> bool:
    return node.server.call(lambda: key in node.holdings.store)


def test_a_chunk_memory_let_go_while_its_disk_write_is_queued_is_served_from_the_queue(node):
    """Memory lets chunks go as new ones come; a slow disk may not have written them yet.  A GET
    then is served from the queued write's buffer (not a miss while the node holds the chunk),
    memory takes it back, and the disk still writes it."""
    items = [_item() for _ in range(8)]
    node.disk.stall(2.0)
    node.put(items, settle=False)  # memory keeps the last 4; the disk has written none
    first = items[0]
    assert not _in_memory(node, first.key) and not node.disk.holds(first.key) and first.key in node.disk
    answered, out = threading.Event(), []
    node.server.call(lambda: node.holdings.fetch([first.key], lambda entries: (out.append(entries[0]), answered.set())))
    assert answered.wait(1.0), "the GET waited on the disk"
    assert out[0] is not None and bytes(out[0].buf) == bytes(first.payload) and _in_memory(node, first.key)
    wait_for(lambda: node.disk.holds(first.key), 20, "the queued write")
    meta, buf = node.disk.read_record(first.key, node.disk.location(first.key))
    assert bytes(buf) == bytes(first.payload)


def test_a_read_whose_segment_is_evicted_meanwhile_is_served_and_held_in_memory(node):
    """The chunk was read whole and checked before its segment went: it is served (bytes equal)
    and memory holds it, rather than a miss that recomputes what the node had just read."""
    items = [_item() for _ in range(80)]
    node.put(items[:40])  # memory keeps the last 4; the first ones are only on disk
    first = items[0]
    assert not _in_memory(node, first.key) and node.disk.holds(first.key)

    def evict() -> None:
        node.put(items[40:])
        assert not node.disk.holds(first.key)  # its segment went (never marked read: not carried)

    entry = node.fetch_held(first.key, evict)
    assert entry is not None and bytes(entry.buf) == bytes(first.payload)
    assert _in_memory(node, first.key)


@pytest.mark.parametrize("how", ["delete", "flush"])
def test_a_read_whose_chunk_is_deleted_meanwhile_never_brings_it_back(node, how):
    """A DELETE (or a flush of the chunk's namespace) while the chunk is being read: the read
    answers a miss and neither tier holds the chunk after it.  A read of another namespace under
    way through the same flush is served."""
    doomed, other = _item("a"), _item("b")
    node.put([doomed, other] + [_item() for _ in range(8)])  # both only on disk now
    assert not _in_memory(node, doomed.key) and not _in_memory(node, other.key)

    def delete() -> None:
        if how == "delete":
            assert node.server.call(lambda: node.holdings.delete(doomed.key))
        else:
            assert node.server.call(lambda: node.holdings.delete_namespace("a")) == 1

    assert node.fetch_held(doomed.key, delete) is None
    assert not _in_memory(node, doomed.key) and not node.disk.holds(doomed.key)
    assert not node.server.call(lambda: node.holdings.lookup([doomed.key], 0))[0]

    def flush_a() -> None:
        node.server.call(lambda: node.holdings.delete_namespace("a"))

    entry = node.fetch_held(other.key, flush_a)
    assert entry is not None and bytes(entry.buf) == bytes(other.payload) and _in_memory(node, other.key)


def test_a_leased_lookup_holds_a_chunk_on_disk_through_its_segments_eviction(node):
    """A LOOKUP that leases a chunk only on disk promises the GET that follows (a worker is about
    to load it).  Its read starts at once; the chunk's segment is evicted before the read gets to
    the file, and a GET comes while the read is still under way.  The GET waits for that read
    (not a miss because the disk no longer names the chunk), is served the chunk whole, and
    memory holds it under the LOOKUP's lease."""
    items = [_item() for _ in range(80)]
    node.put(items[:40])
    first = items[0]
    assert not _in_memory(node, first.key) and node.disk.holds(first.key)
    before = node._before[first.key] = threading.Event()
    assert node.server.call(lambda: node.holdings.lookup([first.key], 30_000)) == [True]
    assert node.paused.wait(10), "the LOOKUP started no read"
    node.put(items[40:])
    assert not node.disk.holds(first.key) and node.disk.stats()["kept_for_reads"] == 1  # its segment went
    answered, out = threading.Event(), []
    node.server.call(lambda: node.holdings.fetch([first.key], lambda entries: (out.append(entries[0]), answered.set())))
    assert not answered.wait(0.3), "the GET did not wait for the read under way"
    before.set()
    assert answered.wait(10) and out[0] is not None and bytes(out[0].buf) == bytes(first.payload)
    assert node.server.call(lambda: node.holdings.store.leased_bytes()) >= len(first.payload)
    assert node.disk.stats()["read_gone"] == 0 and node.holdings.prefetched == 1


def test_leased_lookups_read_ahead_at_most_max_prefetches_and_a_get_reads_the_rest_itself(node, monkeypatch):
    """Reads ahead are bounded (``MAX_PREFETCHES``, 2 here): a LOOKUP of more chunks found only on
    disk starts that many, counts the rest as skipped, and their GET reads them for itself; a
    LOOKUP of a chunk already being read joins that read, whatever the bound."""
    monkeypatch.setattr(holdings_module, "MAX_PREFETCHES", 2)
    items = [_item() for _ in range(12)]
    node.put(items)
    on_disk = [it for it in items if not _in_memory(node, it.key)][:4]
    assert len(on_disk) == 4
    gates = {it.key: threading.Event() for it in on_disk}
    node._before.update(gates)
    keys = [it.key for it in on_disk]
    assert node.server.call(lambda: node.holdings.lookup(keys, 30_000)) == [True] * 4
    assert node.paused.wait(10), "the LOOKUP started no read"
    assert (node.holdings.prefetched, node.holdings.prefetch_skipped) == (2, 2)
    assert node.server.call(lambda: node.holdings.lookup(keys[:1], 30_000)) == [True]  # joins its read
    assert (node.holdings.prefetched, node.holdings.prefetch_skipped) == (3, 2)
    for gate in gates.values():
        gate.set()
    answered, out = threading.Event(), []
    node.server.call(lambda: node.holdings.fetch(keys, lambda entries: (out.extend(entries), answered.set())))
    assert answered.wait(10)
    assert [bytes(e.buf) for e in out] == [bytes(it.payload) for it in on_disk]  # the skipped ones too
