"""The nodes' KV events (vLLM's wire format, decoded here with vLLM's own classes): real node
processes, real etcd, chunks that name their vLLM blocks (``ChunkItem.with_blocks``)."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
from faults import inject
from kv_event_tap import EventTap, removed_hashes, replay, stored_hashes
from polling import wait_for
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.disk.records import DATA_SUFFIX
from kvring.common.chunk import ChunkBlocks, ChunkItem
from kvring.common.contract import Contract

BLOCK = 16
CHUNK_TOKENS = 64  # 4 blocks per chunk
NAMESPACE = "kvring/v1/events"


def _chunk(i: int, nbytes: int = 64 << 10, namespace: str = NAMESPACE, lora: str | None = None) -> ChunkItem:
    """Chunk ``i`` of one long prompt: its 4 blocks hashed 4i..4i+3 (parent 4i-1), tokens 64i.."""
    payload = np.full(nbytes // 4, i, dtype=np.float32).reshape(2, -1)
    item = ChunkItem.of_array(i.to_bytes(16, "big"), payload, tokens=CHUNK_TOKENS, namespace=namespace)
    hashes = [1000 + 4 * i + b for b in range(4)]
    blocks = ChunkBlocks.of(hashes, 1000 + 4 * i - 1 if i else None,
                            list(range(CHUNK_TOKENS * i, CHUNK_TOKENS * (i + 1))), BLOCK, lora_name=lora,
                            extra_keys=[[lora] if lora else None] * 4)
    return item.with_blocks(blocks)


def _hashes(i: int) -> list[int]:
    return [1000 + 4 * i + b for b in range(4)]


def _rot_chunk_one(disk_dir: str) -> None:
    """Flip a byte of chunk 1's payload (all 1.0) where its segment file holds it."""
    run = np.full(64, 1, dtype=np.float32).tobytes()
    (segment, at), = [(f, data.find(run)) for f in Path(disk_dir).glob(f"*{DATA_SUFFIX}")
                      if (data := f.read_bytes()).find(run) >= 0]
    with open(segment, "r+b") as f:
        f.seek(at + 8)
        f.write(b"\xff")


@pytest.fixture
def one_node(cluster_factory):
    cluster = cluster_factory(nodes=1, memory=1 << 20, contract=Contract(chunk_size=CHUNK_TOKENS))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        record = next(iter(client.members.values()))
        tap = EventTap([record.events_addr])
        time.sleep(0.3)  # ZMQ: a subscription takes effect a moment after connecting
        try:
            yield cluster, client, record, tap
        finally:
            tap.close()


def test_stores_evictions_deletes_and_flushes_are_announced(one_node):
    cluster, client, record, tap = one_node
    assert client.put_many([_chunk(i) for i in range(4)]) == [1] * 4
    plain = ChunkItem.of_array(b"no-blocks-chunk!", np.zeros((2, 64), dtype=np.float32), tokens=CHUNK_TOKENS)
    assert client.put_many([plain]) == [1]  # a chunk without blocks is stored, not announced
    wait_for(lambda: len(stored_hashes(tap.events())) == 16, 10, "4 stores announced")
    stored = [e for e in tap.events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [_hashes(i) for i in range(4)]
    assert stored[2].parent_block_hash == _hashes(1)[-1] and stored[0].parent_block_hash is None
    assert stored[3].token_ids == list(range(3 * CHUNK_TOKENS, 4 * CHUNK_TOKENS))
    assert (stored[0].medium, stored[0].locality, stored[0].ownership) == ("CPU", "REMOTE",
                                                                             f"kvring/{cluster.cluster}")

    # A duplicate PUT stores nothing new and announces nothing.
    assert client.put_many([_chunk(0)]) == [1]
    # 1 MiB of memory holds ~15 chunks of 64 KiB: 30 more evict the oldest ones.
    assert sum(client.put_many([_chunk(i) for i in range(4, 34)])) == 30
    wait_for(lambda: len(stored_hashes(tap.events())) == 34 * 4, 10, "34 stores announced")
    present = client.holders(record.node_id, [_chunk(i).key for i in range(34)])
    evicted = [i for i in range(34) if not present[i]]
    assert len(evicted) > 10
    wait_for(lambda: len(removed_hashes(tap.events())) == 4 * len(evicted), 10, "the evictions announced")
    assert sorted(removed_hashes(tap.events())) == sorted(h for i in evicted for h in _hashes(i))

    # Deleted: exactly that chunk's blocks go.
    kept = [i for i in range(34) if present[i]]
    before = len(removed_hashes(tap.events()))
    assert client.delete([_chunk(kept[0]).key]) == 1
    wait_for(lambda: len(removed_hashes(tap.events())) == before + 4, 10, "the delete announced")
    assert removed_hashes(tap.events())[before:] == _hashes(kept[0])

    # Flushed: every chunk of the namespace goes (the one without blocks stays unannounced).
    assert client.flush_namespace(NAMESPACE) == len(kept) - 1
    wait_for(lambda: len(removed_hashes(tap.events())) == before + 4 * len(kept), 10, "the flush announced")
    assert sorted(removed_hashes(tap.events())) == sorted(h for i in range(34) for h in _hashes(i))
    assert all(isinstance(e, (BlockStored, BlockRemoved)) for e in tap.events())

    stats = httpx.get(f"{record.admin_addr}/stats", timeout=5).json()["kv_events"]
    assert stats["published_events"] == 1 + 34 + 34 and stats["dropped_events"] == 0  # + the start's clear


def test_a_late_subscriber_gets_the_history_and_a_restarted_node_starts_with_all_blocks_cleared(one_node):
    cluster, client, record, tap = one_node
    items = [_chunk(i, lora="adapter-a") for i in range(3)]
    assert client.put_many(items) == [1] * 3
    wait_for(lambda: len(stored_hashes(tap.events())) == 12, 10, "3 stores announced")

    history = replay(record.events_replay_addr)  # a subscriber joining now
    assert [seq for seq, _ in history] == list(range(len(history)))
    events = [e for _, batch in history for e in batch.events]
    assert isinstance(events[0], AllBlocksCleared)  # the node started empty
    assert [e.block_hashes for e in events[1:]] == [_hashes(i) for i in range(3)]
    assert all(e.lora_name == "adapter-a" and e.extra_keys == [("adapter-a",)] * 4 for e in events[1:])
    assert replay(record.events_replay_addr, start=len(history) - 1) == history[-1:]  # from a sequence number
    assert replay(record.events_replay_addr, start=10_000) == []  # nothing that far yet

    # Restarted empty: a new incarnation, its sequence from 0, its history one AllBlocksCleared.
    cluster.restart_empty(0)
    new = wait_for(lambda: (r := client.members.get(record.node_id)) and r.incarnation != record.incarnation and r,
                   30, "the restarted node's record")
    history = wait_for(lambda: replay(new.events_replay_addr), 10, "the restarted node's history")
    assert len(history) == 1 and history[0][0] == 0
    assert [type(e) for e in history[0][1].events] == [AllBlocksCleared]


def test_malformed_blocks_are_refused_and_never_announced(one_node):
    cluster, client, record, tap = one_node
    good = _chunk(0)
    blocks = good.meta.blocks
    bad = {
        "token ids for other blocks": msgspec.structs.replace(blocks, token_ids=blocks.token_ids[:-4]),
        "a negative hash": msgspec.structs.replace(blocks, block_hashes=[-1, 1, 2, 3]),
        "more blocks than tokens": msgspec.structs.replace(blocks, block_size=32),
        "extra keys not msgpack": msgspec.structs.replace(blocks, extra_keys=b"\xc1\xc1"),
        "extra keys per block": msgspec.structs.replace(blocks, extra_keys=msgspec.msgpack.encode([None])),
        "a huge LoRA name": msgspec.structs.replace(blocks, lora_name="x" * 10_000),
    }
    for what, blocks in bad.items():
        item = ChunkItem(good.key, good.payload, msgspec.structs.replace(good.meta, blocks=blocks))
        assert client.put_to({record.node_id: [item]}) == {record.node_id: [False]}, what
    assert client.holders(record.node_id, [good.key]) == [False]
    errors = httpx.get(f"{record.admin_addr}/stats", timeout=5).json()["errors"]
    assert sum(errors.values()) >= len(bad)
    assert client.put_many([good]) == [1]  # the node still serves
    wait_for(lambda: stored_hashes(tap.events()), 10, "the good chunk announced")
    assert stored_hashes(tap.events()) == _hashes(0)


def test_every_copy_is_announced_by_its_node_repaired_copies_included(cluster_factory):
    """R=2: both owners announce a chunk; an owner restarted empty announces it again once repair
    has copied it back (a copy keeps the blocks its chunk names)."""
    cluster = cluster_factory(nodes=3, memory=8 << 20, contract=Contract(chunk_size=CHUNK_TOKENS, replication=2))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        records = dict(client.members)
        tap = EventTap([r.events_addr for r in records.values()])
        time.sleep(0.3)
        try:
            items = [_chunk(i) for i in range(6)]
            assert client.put_many(items) == [2] * 6
            wait_for(lambda: len(stored_hashes(tap.events())) == 2 * 6 * 4, 10, "two copies of 6 chunks announced")
            owners = client.owners(items[0].key)
            index = next(i for i, n in enumerate(cluster.nodes) if n.node_id == owners[0])
            held = [i for i, item in enumerate(items) if owners[0] in client.owners(item.key)]
            tap.close()

            cluster.restart_empty(index)
            new = wait_for(lambda: (r := client.members.get(owners[0])) and
                           r.incarnation != records[owners[0]].incarnation and r, 30, "the restarted node")
            expected = sorted(h for i in held for h in _hashes(i))
            announced = lambda: stored_hashes(e for _, b in replay(new.events_replay_addr) for e in b.events)  # noqa: E731
            wait_for(lambda: sorted(announced()) == expected, 30,
                     "the restarted node announcing the copies repair gave it back")
        finally:
            tap.close()


def test_the_replay_buffer_keeps_the_newest_batches_within_its_bounds():
    """The publisher alone (no node): a replay serves the newest batches that fit its bounds."""
    from kvring.events.publisher import EventPublisher, PublisherSettings
    from kvring.events.wire import PoolIdentity

    identity = PoolIdentity("bounded")
    publisher = EventPublisher(PublisherSettings(buffer_batches=1000, buffer_bytes=5_000, interval=0))
    try:
        for i in range(40):  # one batch each (the publisher sends what is queued at once)
            publisher.publish(identity.stored(_chunk(i).meta.blocks))
            wait_for(lambda: publisher.stats()["published_batches"] == i + 1, 5, "the batch sent")
        stats = publisher.stats()
        assert stats["replay_buffer_bytes"] <= 5_000 and 0 < stats["replay_buffer_batches"] < 40
        history = replay(f"tcp://127.0.0.1:{publisher.replay_port}")
        kept = stats["replay_buffer_batches"]
        assert [seq for seq, _ in history] == list(range(40 - kept, 40))
        assert [e.block_hashes for _, b in history for e in b.events] == [_hashes(i) for i in range(40 - kept, 40)]
    finally:
        publisher.close()


def test_a_chunk_rotting_on_disk_unread_is_found_by_the_scrub_and_announced_removed(cluster_factory):
    """No GET asks for it: the node's background scrub reads it again, drops it and announces its
    blocks removed, and its /metrics count the scrub's bytes and passes."""
    cluster = cluster_factory(nodes=1, memory=1 << 20, disk=32 << 20, contract=Contract(chunk_size=CHUNK_TOKENS),
                              node_args=["--disk-scrub-interval", "0.5", "--disk-scrub-rate", "64MiB"])
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        tap = EventTap([next(iter(client.members.values())).events_addr])
        time.sleep(0.3)
        try:
            assert client.put_many([_chunk(i) for i in range(40)]) == [1] * 40  # 2.5 MiB through 1 MiB
            wait_for(lambda: len(stored_hashes(tap.events())) == 160, 10, "40 stores announced")
            wait_for(lambda: client.stats()["node-0"]["disk"]["queued"] == 0, 10, "the disk writes")
            assert client.stats()["node-0"]["disk"]["reads"] == 0
            _rot_chunk_one(cluster.nodes[0].disk_dir)  # evicted from memory: only on disk
            wait_for(lambda: removed_hashes(tap.events()) == _hashes(1), 20, "the scrub announcing the rotten chunk")
            disk = client.stats()["node-0"]["disk"]
            assert disk["corrupt"] == 1 and disk["reads"] == 0 and disk["scrub_passes"] >= 1
            assert client.lookup([(1).to_bytes(16, "big"), (2).to_bytes(16, "big")]) == [False, True]
        finally:
            tap.close()
    metrics = httpx.get(cluster.nodes[0].admin_addr + "/metrics", timeout=5).text
    scrubbed = float(next(line.split()[1] for line in metrics.splitlines()
                          if line.startswith("kvring_node_disk_scrubbed_bytes_total ")))
    assert scrubbed >= 40 * (64 << 10)
    assert "kvring_node_disk_corrupt_total 1.0" in metrics


def test_with_a_disk_tier_events_follow_what_the_node_holds_not_which_tier(cluster_factory):
    """Memory evicting a chunk to the disk, or a read bringing it back, is not announced; a chunk
    leaving both tiers is (deleted, its disk record found corrupt when read, or its disk segment
    evicted); a node restarted with its disk announces what it kept after its ``AllBlocksCleared``."""
    cluster = cluster_factory(nodes=1, memory=1 << 20, disk=32 << 20, contract=Contract(chunk_size=CHUNK_TOKENS))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        record = next(iter(client.members.values()))
        tap = EventTap([record.events_addr])
        time.sleep(0.3)
        try:
            assert client.put_many([_chunk(i) for i in range(40)]) == [1] * 40  # 2.5 MiB through 1 MiB
            wait_for(lambda: len(stored_hashes(tap.events())) == 160, 10, "40 stores announced")
            wait_for(lambda: client.stats()["node-0"]["disk"]["queued"] == 0, 10, "the disk writes")
            assert client.stats()["node-0"]["evictions"] > 20
            assert all(c is not None for c in client.get([i.to_bytes(16, "big") for i in range(40)]))  # promoted
            # Chunk 2 only on disk (20 chunks read after it push it out of memory), chunk 0 read back
            # into memory last (memory holds what a disk record does not: its blocks come from the
            # journal); deleting them announces both, from either tier.
            for i in range(20, 40):
                assert client.get([i.to_bytes(16, "big")]) != [None]
            assert client.get([(0).to_bytes(16, "big")]) != [None]
            time.sleep(0.5)
            assert removed_hashes(tap.events()) == [] and len(stored_hashes(tap.events())) == 160
            assert client.delete([(0).to_bytes(16, "big"), (2).to_bytes(16, "big")]) == 2
            try:
                wait_for(lambda: sorted(removed_hashes(tap.events())) == _hashes(0) + _hashes(2), 10,
                         "the deletes announced")
            except AssertionError as exc:  # say what was announced instead
                raise AssertionError(f"{exc}; removed {removed_hashes(tap.events())}, stored "
                                     f"{len(stored_hashes(tap.events()))}; node {client.stats()['node-0']}") from None

            # Chunk 1, held only on disk, rots there (a byte of its payload flipped in its segment):
            # the read that finds it answers a miss, and its blocks are announced removed, so a
            # KV-aware router stops sending its prompts here.
            _rot_chunk_one(cluster.nodes[0].disk_dir)
            assert client.get([(1).to_bytes(16, "big")]) == [None]
            wait_for(lambda: sorted(removed_hashes(tap.events())) == _hashes(0) + _hashes(1) + _hashes(2), 10,
                     "the corrupt chunk announced")
            assert client.stats()["node-0"]["disk"]["corrupt"] == 1

            # Past the disk's budget its oldest segment goes: what was only there is announced removed.
            assert client.put_many([_chunk(i) for i in range(40, 640)]) == [1] * 600
            wait_for(lambda: client.stats()["node-0"]["disk"]["evicted"] > 0, 20, "a disk segment evicted")
            time.sleep(0.5)
            held = client.lookup([i.to_bytes(16, "big") for i in range(1, 640)])
            gone = {h for i, h_ in zip(range(1, 640), held) if not h_ for h in _hashes(i)}
            assert gone and set(removed_hashes(tap.events())) == gone | set(_hashes(0))  # 2: not held, in gone
        finally:
            tap.close()
    kept = [i for i, h in zip(range(1, 640), held) if h]
    cluster.restart(0)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        record = wait_for(lambda: client.members.get("node-0"), 10, "the restarted node")
        history = wait_for(lambda: (h := replay(record.events_replay_addr)) and
                           len(stored_hashes([e for _, b in h for e in b.events])) == 4 * len(kept) and h,
                           20, "the restarted node announcing what its disk kept")
        assert isinstance(history[0][1].events[0], AllBlocksCleared)
        assert sorted(stored_hashes([e for _, b in history for e in b.events])) == sorted(
            h for i in kept for h in _hashes(i))


def test_with_a_disk_tier_a_chunk_let_go_while_queued_for_the_disk_is_announced_once_held_nowhere(cluster_factory):
    """Memory lets a chunk go unannounced while its disk write is queued (the disk will hold it).
    If the chunk is then deleted before it is written, or its write fails (here: a chunk too large
    for the disk), it is held nowhere, and its blocks are announced removed; one memory still
    holds stays announced as held, whatever its write did."""
    cluster = cluster_factory(nodes=1, memory=16 << 20, disk=16 << 20, contract=Contract(chunk_size=CHUNK_TOKENS),
                              node_args=["--fault-injection"])
    small, big, kept = _chunk(0), _chunk(1, nbytes=9 << 20), _chunk(2, nbytes=9 << 20)  # the disk takes 8 MiB at most
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        tap = EventTap([next(iter(client.members.values())).events_addr])
        time.sleep(0.3)
        try:
            inject(cluster, cluster.nodes[0], "disk-stall?seconds=3")  # the writes wait in the queue
            for item in (small, big, kept):  # the third pushes the first two out of memory
                assert client.put_many([item]) == [1]
            assert client.stats()["node-0"]["evictions"] == 2 and client.stats()["node-0"]["disk"]["queued"] == 3
            assert client.delete([small.key]) == 1
            wait_for(lambda: removed_hashes(tap.events()) == _hashes(0), 10, "the queued chunk's delete announced")
            wait_for(lambda: client.stats()["node-0"]["disk"]["too_large"] == 2, 10, "the large writes refused")
            wait_for(lambda: sorted(removed_hashes(tap.events())) == _hashes(0) + _hashes(1), 10,
                     "the chunk whose write failed announced")
            time.sleep(0.5)
            assert sorted(removed_hashes(tap.events())) == _hashes(0) + _hashes(1)  # not the one memory holds
            assert sorted(stored_hashes(tap.events())) == _hashes(0) + _hashes(1) + _hashes(2)
            assert client.lookup([small.key, big.key, kept.key]) == [False, False, True]
        finally:
            tap.close()


def test_a_flush_while_a_restarted_node_announces_its_disk_leaves_nothing_announced_as_held(cluster_factory):
    """A restarted node announces what its disk kept while it already serves: a namespace flushed
    meanwhile leaves no block announced as held (each chunk is either announced before its
    removal or not at all), and a chunk kept in another namespace stays announced.  (The flush
    lands during the announcement or after it, as timing has it; the exclusion of a removal
    overtaken by a late announcement comes from announcing on the loop, ``_announce_kept``.)"""
    n = 4000
    cluster = cluster_factory(nodes=1, memory=1 << 20, disk=64 << 20, contract=Contract(chunk_size=CHUNK_TOKENS))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        for start in range(0, n, 1000):
            items = [_chunk(i, nbytes=1024) for i in range(start, start + 1000)]
            assert client.put_many(items) == [1] * 1000
        assert client.put_many([_chunk(n, nbytes=1024, namespace="kept")]) == [1]
        wait_for(lambda: client.stats()["node-0"]["disk"]["queued"] == 0, 20, "the disk writes")
    cluster.restart(0)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        record = wait_for(lambda: client.members.get("node-0"), 10, "the restarted node")
        assert client.flush_namespace(NAMESPACE) == n
        assert client.lookup([(n).to_bytes(16, "big")]) == [True]

        def held() -> collections.Counter:
            counts: collections.Counter = collections.Counter()
            for _, batch in replay(record.events_replay_addr):
                for event in batch.events:
                    if isinstance(event, AllBlocksCleared):
                        counts.clear()
                    elif isinstance(event, BlockStored):
                        counts.update(event.block_hashes)
                    elif isinstance(event, BlockRemoved):
                        counts.subtract(h for h in event.block_hashes if counts[h] > 0)
            return +counts
        wait_for(lambda: set(held()) == set(_hashes(n)), 20, "the ledger settled on the kept chunk")
        time.sleep(0.5)
        assert set(held()) == set(_hashes(n))
