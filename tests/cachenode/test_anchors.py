"""A chunk part a node lets go by itself takes its chunk's anchor with it (``cachenode/anchors.py``):
with real etcd, real node processes and the pool stream read with vLLM's decoder; the node's two
tiers over real files (``Holdings``: which departures count); and ``AnchorDrops``' bounds."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import urllib.request

import msgspec
import numpy as np
import pytest
from kv_event_tap import EventTap, credited
from polling import wait_for

from kvring.cachenode.anchors import AnchorDrops
from kvring.cachenode.client import ClusterClient
from kvring.cachenode.disk.identity import DiskIdentity
from kvring.cachenode.disk.tier import DiskConfig, DiskTier
from kvring.cachenode.framing import FrameLimits
from kvring.cachenode.holdings import Holdings
from kvring.cachenode.pool_events import PoolEvents
from kvring.cachenode.server import Server
from kvring.cachenode.store import ChunkStore
from kvring.common.chunk import ChunkBlocks, ChunkItem
from kvring.common.contract import Contract
from kvring.common.errors import KVRingError, ProtocolError
from kvring.events.relay import RelaySettings

MIB = 1 << 20
BLOCK, CHUNK = 16, 64
PARTS = 4  # the anchor (naming the chunk's 4 blocks) and 3 parts naming the anchor
_prompts = itertools.count(1)


def _payload(size: int) -> np.ndarray:
    return np.frombuffer(os.urandom(size), dtype=np.uint8)


def _chunk(key: bytes, size: int = MIB // 4) -> list[ChunkItem]:
    """One chunk's parts as the connector stores them: part 0 names the chunk's 4 blocks (a
    prompt's first), parts 1..3 name part 0's key as their anchor."""
    prompt = next(_prompts) * 1000
    parts = [ChunkItem.of(key + bytes([p]), _payload(size), [2, size // 2], "uint8", CHUNK, "ns")
             for p in range(PARTS)]
    blocks = ChunkBlocks.of([prompt + b for b in range(4)], None, list(range(prompt, prompt + CHUNK)), BLOCK)
    return [parts[0].with_blocks(blocks)] + [p.with_anchor(parts[0].key) for p in parts[1:]]


def _hashes(parts: list[ChunkItem]) -> set:
    return set(parts[0].meta.blocks.block_hashes)


def _find(client: ClusterClient, ok) -> list[ChunkItem]:
    """A chunk whose parts' owners (one each) satisfy ``ok(owners)``."""
    for _ in range(10_000):
        key = os.urandom(15)
        if ok([client.owners(key + bytes([p]))[0] for p in range(PARTS)]):
            return _chunk(key)
    raise AssertionError("no such chunk key found")


def _flood(client: ClusterClient, node: str, gone: set[bytes]) -> int:
    """Store 1 MiB fillers (naming no anchor) on ``node`` until it has let ``gone`` go (looked at
    in its key list: a LOOKUP would count as a use and keep them)."""
    n = 0
    while gone & set(client.list_keys(node)):
        filler = ChunkItem.of(os.urandom(16), _payload(MIB), [2, MIB // 2], "uint8", CHUNK, "filler")
        assert client.put_to({node: [filler]})[node] == [True]
        n += 1
        assert n < 64, f"{node} never let the parts go"
    return n


def test_a_part_a_node_evicts_takes_its_chunk_off_the_pool_stream_unless_another_node_holds_it(cluster_factory):
    """Chunk A's part 2 is evicted from its node: no load can take A whole, and nobody holds that
    part, so the node deletes A's anchor (on another node), whose blocks leave the pool stream.
    Chunk C's part 2 is evicted from a node that held a copy while its owner holds it too: C is
    whole, its anchor stays.  Chunk B has no part on the flooded node and stays credited."""
    # Without handoff, which would move the copy below to its owner (a delete, not an eviction).
    cluster = cluster_factory(nodes=3, memory=8 * MIB, contract=Contract(chunk_size=CHUNK), node_args=["--no-handoff"])
    with PoolEvents(cluster.etcd, cluster.cluster, RelaySettings(check_interval=0.5), interval=0.2) as stream, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        tap = EventTap([stream.events_addr])
        try:
            wait_for(lambda: stream.stats()["nodes"] == 3, 10, "the relay following the three nodes")
            a = _find(client, lambda owners: owners[2] != owners[0])
            flooded = client.owners(a[2].key)[0]
            b = _find(client, lambda owners: flooded not in owners)
            c = _find(client, lambda owners: flooded not in owners)
            for chunk in (a, b, c):
                assert client.put_many(chunk) == [1] * PARTS
            assert client.put_to({flooded: [c[2]]})[flooded] == [True]  # a copy beside its owner's
            everything = _hashes(a) | _hashes(b) | _hashes(c)
            wait_for(lambda: credited(tap.events()) == everything, 10, "the three chunks on the pool stream")

            on_flooded = [client.owners(p.key)[0] == flooded for p in a]  # part 2 and maybe others
            _flood(client, flooded, {a[2].key, c[2].key})
            wait_for(lambda: credited(tap.events()) == _hashes(b) | _hashes(c), 10, "chunk A withdrawn")
            assert client.lookup([p.key for p in a]) == [False] + [not f for f in on_flooded[1:]]  # its anchor deleted
            assert client.lookup([p.key for p in b + c]) == [True] * 2 * PARTS
            counts = client.stats()[flooded]["anchors"]
            assert counts["parts"] == sum(on_flooded) + 1 and counts["held_elsewhere"] == 1
            assert counts["anchors_deleted"] == 1 and counts["skipped"] == counts["failed"] == 0
            node = next(n for n in cluster.nodes if n.node_id == flooded)
            metrics = urllib.request.urlopen(f"{node.admin_addr}/metrics", timeout=5).read().decode()
            assert "kvring_node_anchor_anchors_deleted_total 1.0" in metrics.splitlines()

            # A part deleted (not evicted) leaves its anchor: whoever deleted it meant what it deleted.
            client.delete([b[1].key])
            time.sleep(1.0)  # five of the anchors' batches
            assert client.lookup([b[0].key]) == [True]
            assert client.stats()[client.owners(b[1].key)[0]]["anchors"]["parts"] == 0
        finally:
            tap.close()


def test_an_owner_that_does_not_answer_keeps_the_chunk(cluster_factory):
    """A node lets go a copy of chunk C's part 2 whose owner is stopped (SIGSTOP): it cannot be
    told that the owner holds the part, so it keeps C's anchor, counted as held elsewhere, rather
    than delete a chunk that may be whole.  The owner resumed, C is whole and its anchor there."""
    cluster = cluster_factory(nodes=3, memory=8 * MIB, contract=Contract(chunk_size=CHUNK), node_args=["--no-handoff"])
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0) as client:
        c = _find(client, lambda owners: len(set(owners)) == 2 and owners[0] != owners[2])
        owner = client.owners(c[2].key)[0]
        flooded = next(n for n in client.members if n not in (owner, client.owners(c[0].key)[0]))  # no part of C
        assert client.put_many(c) == [1] * PARTS
        assert client.put_to({flooded: [c[2]]})[flooded] == [True]  # a copy beside its owner's
        stopped = next(n for n in cluster.nodes if n.node_id == owner)
        stopped.proc.send_signal(signal.SIGSTOP)
        try:
            _flood(client, flooded, {c[2].key})
            wait_for(lambda: client.stats()[flooded]["anchors"]["held_elsewhere"] == 1, 15,
                     "the copy's owner asked, and kept as held elsewhere")
        finally:
            stopped.proc.send_signal(signal.SIGCONT)
        counts = client.stats()[flooded]["anchors"]
        assert counts["anchors_deleted"] == 0 and counts["failed"] == 0
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as fresh:  # (the first ejected the stopped node)
        assert fresh.lookup([p.key for p in c]) == [True] * PARTS


def _credited_but_broken(client: ClusterClient, chunks: list[list[ChunkItem]], pool: set) -> list[int]:
    """The chunks whose blocks the pool stream credits though a part of theirs is held nowhere
    (looked at in the nodes' key lists: a LOOKUP would count as a use)."""
    held = {k for n in client.members for k in client.list_keys(n)}
    return [i for i, parts in enumerate(chunks)
            if _hashes(parts) <= pool and not all(p.key in held for p in parts)]


def test_under_churn_every_chunk_the_pool_stream_credits_can_be_loaded_whole(cluster_factory):
    """Three nodes of 8 MiB take 64 chunks of 1 MiB (4 parts each): memory turns over more than
    twice, each node evicting its own least recently used parts.  The anchors are looked up as
    the chunks come (the prompts in use), so it is mostly other parts that go, leaving chunks
    whose anchor is held and a part is not.  Once the nodes have handed on what they let go, the
    pool stream credits no chunk that lacks a part."""
    cluster = cluster_factory(nodes=3, memory=8 * MIB, contract=Contract(chunk_size=CHUNK))
    with PoolEvents(cluster.etcd, cluster.cluster, RelaySettings(check_interval=0.5), interval=0.2) as stream, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        tap = EventTap([stream.events_addr])
        try:
            wait_for(lambda: stream.stats()["nodes"] == 3, 10, "the relay following the three nodes")
            chunks = [_chunk(os.urandom(15)) for _ in range(64)]
            for i, parts in enumerate(chunks):
                assert client.put_many(parts) == [1] * PARTS
                client.lookup([c[0].key for c in chunks[:i]])  # a use of every anchor so far
            evicted = sum(s["evictions"] for s in client.stats().values())
            assert evicted > 64 * PARTS / 2
            wait_for(lambda: not _credited_but_broken(client, chunks, credited(tap.events())), 15,
                     "no credited chunk missing a part")
            pool = credited(tap.events())
            assert any(_hashes(parts) <= pool for parts in chunks)  # the newest chunks are whole, and credited
            deleted = sum(s["anchors"]["anchors_deleted"] for s in client.stats().values())
            assert deleted > 0, deleted
        finally:
            tap.close()


def test_an_anchor_that_cannot_be_a_key_is_refused(cluster_factory):
    cluster = cluster_factory(nodes=1, memory=8 * MIB, contract=Contract(chunk_size=CHUNK))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        node = next(iter(client.members))
        good = _chunk(os.urandom(15))[1]
        for what, anchor in {"empty": b"", "longer than a key": b"k" * 65}.items():
            item = ChunkItem(good.key, good.payload, msgspec.structs.replace(good.meta, anchor=anchor))
            assert client.put_to({node: [item]}) == {node: [False]}, what
            with pytest.raises(ProtocolError, match="anchor"):
                good.with_anchor(anchor)
        assert client.holders(node, [good.key]) == [False]
        assert client.put_to({node: [good]}) == {node: [True]}  # the node still serves


class _Gone:
    """Stands in for the node's ``AnchorDrops`` (whose sending the cluster test covers): records
    the parts handed to it."""

    def __init__(self) -> None:
        self.parts: list[tuple[bytes, bytes]] = []

    def part_gone(self, key: bytes, anchor: bytes) -> None:
        self.parts.append((key, anchor))


IDENTITY = DiskIdentity(cluster="c", node_id="node-0", contract='{"chunk_size": 64}')


@pytest.fixture
def loop():
    server = Server("127.0.0.1", 0, lambda conn, message: None, FrameLimits(1 << 16, 4, 2 * MIB, 4 * MIB))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(10)


def _anchored(n: int) -> list[ChunkItem]:
    return [ChunkItem.of(os.urandom(16), _payload(MIB), [2, MIB // 2], "uint8", CHUNK, "ns").with_anchor(b"A" * 16)
            for _ in range(n)]


def test_memory_alone_hands_on_what_it_evicts_not_what_is_deleted(loop):
    holdings = Holdings(ChunkStore(4 * MIB), None, loop)
    holdings.anchors = gone = _Gone()
    items = _anchored(6)
    for item in items:
        assert loop.call(lambda item=item: holdings.put(item.key, item.meta, item.payload))
    evicted = [item.key for item in items if not loop.call(lambda item=item: item.key in holdings)]
    assert evicted and [k for k, _ in gone.parts] == evicted and {a for _, a in gone.parts} == {b"A" * 16}
    before = len(gone.parts)
    assert loop.call(lambda: holdings.delete(items[-1].key))
    assert loop.call(lambda: holdings.delete_namespace("ns")) > 0
    assert len(gone.parts) == before


def test_with_a_disk_a_part_goes_when_the_disk_lets_it_go_with_its_anchor_from_the_journal(loop, tmp_path):
    """Memory letting a part go hands nothing on (the disk holds it); its segment's eviction does,
    with the anchor its journal entry kept; a delete from the disk does not."""
    disk = DiskTier(DiskConfig(str(tmp_path), capacity=64 * MIB, segment_bytes=16 * MIB, scrub_rate=0), IDENTITY,
                    take=lambda n: np.empty(n, dtype=np.uint8))
    disk.open()
    try:
        holdings = Holdings(ChunkStore(4 * MIB), disk, loop)
        holdings.anchors = gone = _Gone()
        items = _anchored(80)

        def put(batch: list[ChunkItem]) -> None:
            for item in batch:
                assert loop.call(lambda item=item: holdings.put(item.key, item.meta, item.payload))
            wait_for(lambda: not disk.stats()["queued"], 20, "the disk writes")

        put(items[:20])
        assert not loop.call(lambda: items[0].key in holdings.store) and items[0].key in disk
        assert loop.call(lambda: holdings.delete(items[5].key))
        assert gone.parts == []  # memory let 16 go, the disk holds them; the delete is nobody's loss
        put(items[20:])
        evicted = [item.key for item in items if not loop.call(lambda item=item: item.key in holdings)]
        assert disk.stats()["evicted"] >= 15
        wait_for(lambda: len(gone.parts) == len(evicted) - 1, 10, "the evicted parts handed on")
        assert {k for k, _ in gone.parts} == set(evicted) - {items[5].key}
        assert {a for _, a in gone.parts} == {b"A" * 16}
    finally:
        disk.close()


def test_parts_wait_bounded_and_a_cluster_out_of_reach_costs_only_their_anchors():
    """Past ``max_pending`` parts are counted skipped, not queued; a batch whose cluster cannot be
    reached (the connect below fails as a ``ClusterClient`` does when etcd is not there) is
    counted failed and dropped, once, and the thread goes on."""
    attempts = []

    def unreachable():
        attempts.append(time.monotonic())
        raise KVRingError("cannot connect to etcd at 127.0.0.1:1")

    drops = AnchorDrops(unreachable, interval=0.05, batch=2, max_pending=3)
    try:
        for i in range(5):
            drops.part_gone(bytes([i]) * 8, b"anchor")
        drops.part_gone(bytes([0]) * 8, b"anchor")  # already waiting: once
        drops.part_gone(b"anchor", b"anchor")  # a part naming itself: never
        assert (drops.counts.parts, drops.counts.skipped) == (3, 2)
        drops.start()
        wait_for(lambda: drops.counts.failed == 3, 5, "both batches failed")
        assert len(attempts) == 2  # one batch per turn: the second waited for the next
        drops.part_gone(b"late", b"anchor")
        wait_for(lambda: drops.counts.failed == 4, 5, "the next part failed too")
        assert drops.counts.anchors_deleted == 0
    finally:
        drops.stop()
