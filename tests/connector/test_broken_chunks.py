"""A chunk whose part was lost where no node saw it go (its node killed or restarted empty, a
save only some ranks finished) is withdrawn from the pool's KV events once a lookup finds it
broken (``connector/broken_chunks.py``).  Real etcd, real node processes, the pool stream read
with vLLM's decoder; the parts laid out as the connector lays them (``ChunkParts``)."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time

import numpy as np
from kv_event_tap import EventTap, credited
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.pool_events import PoolEvents
from kvring.common.chunk import ChunkBlocks, ChunkItem
from kvring.common.contract import Contract
from kvring.connector.broken_chunks import BrokenChunks
from kvring.connector.parts import ChunkParts
from kvring.connector.stats import Counters
from kvring.events.relay import RelaySettings

BLOCK, CHUNK = 16, 64
PARTS = ChunkParts(num_kv_heads=4, stages=((0, 2),))  # the anchor (head 0) and three parts carrying it
_prompts = itertools.count(1)


def _chunk(key: bytes) -> list[ChunkItem]:
    """A chunk's parts as the connector stores them (``ChunkParts.keys`` order): the anchor names
    the chunk's four blocks, the others name the anchor."""
    prompt = next(_prompts) * 1000
    anchor = PARTS.anchor
    items = []
    for part in PARTS.parts:
        data = np.frombuffer(os.urandom(64 << 10), dtype=np.uint8)
        item = ChunkItem.of(part.key(key), data, [2, 32 << 10], "uint8", CHUNK, "ns")
        if part == anchor:
            blocks = ChunkBlocks.of([prompt + b for b in range(4)], None, list(range(prompt, prompt + CHUNK)), BLOCK)
            item = item.with_blocks(blocks)
        else:
            item = item.with_anchor(anchor.key(key))
        items.append(item)
    return items


def _find(client: ClusterClient, ok) -> tuple[bytes, list[ChunkItem]]:
    """A chunk key whose parts' owners satisfy ``ok(owners)``, and its parts."""
    for _ in range(10_000):
        key = os.urandom(16)
        if ok([client.owners(p.key(key))[0] for p in PARTS.parts]):
            return key, _chunk(key)
    raise AssertionError("no such chunk key found")


def _part_on(client: ClusterClient, node_id: str) -> tuple[bytes, list[ChunkItem]]:
    """A chunk with a part on ``node_id`` and its anchor elsewhere."""
    return _find(client, lambda owners: owners[0] != node_id and node_id in owners[1:])


@contextlib.contextmanager
def _withdrawing(client: ClusterClient, grace: float, **settings):
    counters = Counters()
    broken = BrokenChunks(client, counters, grace=grace, **settings)
    try:
        yield broken, counters
    finally:
        broken.close()


def _hashes(items: list[ChunkItem]) -> set:
    return set(items[0].meta.blocks.block_hashes)


def _report(client: ClusterClient, broken: BrokenChunks, keys: list[bytes]) -> list[int]:
    """What the scheduler does with a lookup's answer: the chunks found broken go to ``broken``."""
    present = client.lookup(PARTS.keys(keys))
    found = PARTS.broken(present)
    for chunk in found:
        broken.found(PARTS.anchor.key(keys[chunk.chunk]), [p.key(keys[chunk.chunk]) for p in chunk.missing])
    return [chunk.chunk for chunk in found]


def _counts(counters: Counters) -> dict:
    stats = counters.take()
    return {k: v for k, v in (stats.data if stats else {}).items() if k.startswith("broken")}


def test_chunks_that_lost_a_part_with_a_restarted_node_leave_the_pool_stream_and_whole_ones_stay(cluster_factory):
    """A node is killed and started again empty under its id (a container restart): chunk A had a
    part there, its anchor elsewhere.  No node saw that part go, so A stays credited -- until a
    lookup finds A's anchor without the part: A is withdrawn (its anchor deleted).  Chunk B, all
    of whose parts are elsewhere, stays credited and whole; a second lookup of A finds nothing
    to report."""
    cluster = cluster_factory(nodes=3, contract=Contract(chunk_size=CHUNK))
    with PoolEvents(cluster.etcd, cluster.cluster, RelaySettings(check_interval=0.5), interval=0.2) as stream, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        tap = EventTap([stream.events_addr])
        try:
            wait_for(lambda: stream.stats()["nodes"] == 3, 10, "the relay following the three nodes")
            victim = cluster.nodes[2].node_id
            a_key, a = _part_on(client, victim)
            b_key, b = _find(client, lambda owners: victim not in owners)
            for chunk in (a, b):
                assert client.put_many(chunk) == [1] * len(chunk)
            wait_for(lambda: credited(tap.events()) == _hashes(a) | _hashes(b), 10, "both chunks on the pool stream")
            assert PARTS.broken(client.lookup(PARTS.keys([a_key, b_key]))) == []  # whole: nothing to report

            cluster.restart_empty(2)
            wait_for(lambda: client.ping(victim) < 5, 10, "the restarted node answering")
            time.sleep(1.5)  # nothing withdraws A by itself (no node let its part go)
            assert credited(tap.events()) == _hashes(a) | _hashes(b)

            with _withdrawing(client, grace=0.5) as (broken, counters):
                assert _report(client, broken, [a_key, b_key]) == [0]
                wait_for(lambda: credited(tap.events()) == _hashes(b), 10, "chunk A withdrawn")
                assert client.lookup([PARTS.anchor.key(a_key)]) == [False]  # its anchor deleted
                assert all(client.lookup(PARTS.keys([b_key])))
                assert _counts(counters) == {"broken_chunks": 1, "broken_chunks_withdrawn": 1,
                                             "broken_chunks_skipped": 0}
                assert _report(client, broken, [a_key, b_key]) == []  # no anchor: nothing to withdraw
        finally:
            tap.close()


def test_a_part_whose_node_left_the_ring_withdraws_its_chunk(cluster_factory):
    """A node killed for good: once its lease runs out it leaves the ring, and the new owners of
    its keys do not hold them.  A lookup right after (the previous ring still consulted) finds
    chunk A broken, and A is withdrawn: a former owner that is no longer a member holds nothing
    a load could read."""
    cluster = cluster_factory(nodes=3, contract=Contract(chunk_size=CHUNK), lease_ttl=2)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client, \
            _withdrawing(client, grace=0.2) as (broken, counters):
        assert client.wait_for_nodes(3)
        victim = cluster.nodes[2]
        a_key, a = _part_on(client, victim.node_id)
        assert client.put_many(a) == [1] * len(a)
        victim.kill()
        wait_for(lambda: victim.node_id not in client.ring.nodes, 15, "the killed node off the ring")
        assert client.membership.view.previous() is not None  # still within the handoff window
        assert _report(client, broken, [a_key]) == [0]
        wait_for(lambda: client.lookup([PARTS.anchor.key(a_key)]) == [False], 10, "chunk A's anchor deleted")
        assert _counts(counters)["broken_chunks_withdrawn"] == 1


def test_a_hung_owner_or_a_save_still_under_way_keeps_the_chunk(cluster_factory):
    """Two things look like a lost part and are not.  A part whose owner is hung (SIGSTOP) is
    missing from the lookup, but its owner cannot say it does not hold it: the chunk is kept.  A
    part saved after the lookup, within the grace period (a save whose workers had not put every
    part yet), is there when the chunk is checked: kept.  Neither anchor is deleted."""
    cluster = cluster_factory(nodes=3, contract=Contract(chunk_size=CHUNK), lease_ttl=30)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=0.5, failure_backoff=0.1) as client, \
            _withdrawing(client, grace=1.0) as (broken, counters):
        assert client.wait_for_nodes(3)
        hung = cluster.nodes[2]
        h_key, h = _part_on(client, hung.node_id)
        s_key, s = _find(client, lambda owners: hung.node_id not in owners)
        assert client.put_many(h) == [1] * len(h)
        assert client.put_many(s[:2]) == [1, 1]  # the rest of its parts come later

        os.kill(hung.pid, signal.SIGSTOP)
        try:
            assert sorted(_report(client, broken, [h_key, s_key])) == [0, 1]
            assert client.put_many(s[2:]) == [1] * (len(s) - 2)  # the save finishes within the grace
            time.sleep(2.5)  # past the grace and the check
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        client.marks.forgive(hung.node_id)
        assert client.lookup([PARTS.anchor.key(h_key), PARTS.anchor.key(s_key)]) == [True, True]
        assert all(client.lookup(PARTS.keys([h_key, s_key])))
        assert _counts(counters) == {"broken_chunks": 2, "broken_chunks_withdrawn": 0, "broken_chunks_skipped": 0}


def test_found_is_bounded_and_takes_a_chunk_once_per_recheck(cluster_factory):
    """The scheduler's side never waits and never grows without bound: an anchor reported again
    within ``recheck`` is taken once; past ``max_pending`` waiting, chunks are counted skipped."""
    cluster = cluster_factory(nodes=1, contract=Contract(chunk_size=CHUNK))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client, \
            _withdrawing(client, grace=60.0, max_pending=3) as (broken, counters):
        t0 = time.monotonic()
        for _ in range(2):
            for i in range(5):
                broken.found(bytes([i]) * 16, [bytes([i]) * 17])
        assert time.monotonic() - t0 < 0.5
        assert _counts(counters) == {"broken_chunks": 3, "broken_chunks_withdrawn": 0, "broken_chunks_skipped": 4}
