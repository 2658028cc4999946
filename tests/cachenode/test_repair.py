"""Replicas that protect, with real etcd and real node processes: nodes SIGKILLed and restarted
empty lose nothing, and the survivors restore every chunk's copies in the background."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
from chunk_reader import Reader
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract

CHUNKS = 2_000
RESTORE_BOUND_S = 30.0  # the bound this test states for 2 copies again after a restart


def _payload(i: int) -> bytes:
    """Chunk ``i``'s bytes (2-6 KiB, different for every chunk, reproducible)."""
    seed = hashlib.blake2b(i.to_bytes(4, "little"), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(seed, "little")).bytes(2048 + (i % 5) * 1024)


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"repair-%d" % i, digest_size=16).digest()


def _copied(client: ClusterClient, nodes: list[str]) -> int:
    """Copies the nodes' repair passes restored so far (their ``/stats``)."""
    stats = client.stats()
    return sum(stats[n]["repair"]["copied_total"] for n in nodes)


def test_three_nodes_killed_and_restarted_empty_in_turn_lose_no_chunk(cluster_factory):
    cluster = cluster_factory(nodes=3, lease_ttl=3, contract=Contract(chunk_size=16, replication=2))
    node_ids = [n.node_id for n in cluster.nodes]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0, failure_backoff=1.0) as client, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0, failure_backoff=1.0) as reading:
        assert client.wait_for_nodes(3)
        items = [ChunkItem.of(_key(i), _payload(i), (1, len(_payload(i))), "uint8", 16) for i in range(CHUNKS)]
        for start in range(0, CHUNKS, 200):
            assert client.put_many(items[start:start + 200]) == [2] * len(items[start:start + 200])
        assert all(n == 2 for n in client.copies(node_ids).values())

        reader = Reader(reading, CHUNKS, _key, _payload)
        thread = threading.Thread(target=reader.run, daemon=True)
        thread.start()
        restored_in: list[float] = []
        restored: list[int] = []
        try:
            for index in range(3):
                survivors = [n for n in node_ids if n != node_ids[index]]
                copied_before = _copied(client, survivors)
                old_pid = cluster.nodes[index].pid
                new = cluster.restart_empty(index)
                restarted = time.monotonic()
                # A new process, so an empty store (repair may be filling it already: no list_keys == []).
                assert new.pid != old_pid
                # Every chunk is readable right away, from the surviving copy.
                chunks = client.get([_key(i) for i in range(CHUNKS)])
                unreadable = [i for i, c in enumerate(chunks) if c is None or bytes(c.data) != _payload(i)]
                assert unreadable == [], f"after restarting {new.node_id}: {len(unreadable)} chunks unreadable"
                # The survivors copy back what the restarted node owned.
                wait_for(lambda: (c := client.copies(node_ids)) and len(c) == CHUNKS
                         and all(n == 2 for n in c.values()), RESTORE_BOUND_S,
                         f"2 copies of every chunk after {new.node_id} restarted empty")
                restored_in.append(time.monotonic() - restarted)
                # The restarted node owns about 2/3 of the chunks; the survivors' /stats count the copies.
                restored.append(_copied(client, survivors) - copied_before)
                assert restored[-1] >= CHUNKS // 2
        finally:
            reader.stop.set()
            thread.join(10)
        print(f"2 copies restored in {', '.join(f'{t:.1f}s' for t in restored_in)} ({restored} chunks); reader: {reader.reads} reads, "
              f"{reader.misses} misses, {len(reader.errors)} errors")
        assert reader.wrong == []
        assert reader.reads > 0


def test_a_chunk_whose_replica_write_was_missed_gets_its_copy_back(cluster_factory):
    """A copy missing without any ring change (a PUT that reached one owner only) is restored by
    the periodic pass."""
    cluster = cluster_factory(nodes=2, lease_ttl=3, contract=Contract(chunk_size=16, replication=2),
                              node_args=["--repair-interval", "1"])
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(2)
        keys = [_key(i) for i in range(50)]
        client.put_many([ChunkItem.of(k, _payload(i), (1, len(_payload(i))), "uint8", 16)
                         for i, k in enumerate(keys)])
        wait_for(lambda: client.stats()["node-0"]["repair"]["passes"] >= 1, 10, "node-0's first repair pass")
        assert client.delete(keys[:20], node="node-1") == 20  # a replica lost behind the ring's back
        wait_for(lambda: all(client.holders("node-1", keys)), 15, "the missing copies restored")
        repair = client.stats()["node-0"]["repair"]
        assert repair["copied_total"] >= 20 and repair["trigger"] in ("periodic", "retry")


def test_a_node_lost_for_good_and_a_node_joining_leave_exactly_two_copies(cluster_factory):
    """A node that never comes back: once its lease runs out the ring drops it and the survivors
    copy its share to the new owners.  A node that joins: the chunks it now owns move to it, and
    the copies whose holders no longer own them leave (each only once its owners hold it)."""
    cluster = cluster_factory(nodes=3, lease_ttl=2, contract=Contract(chunk_size=16, replication=2))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0, failure_backoff=1.0) as client:
        assert client.wait_for_nodes(3)
        keys = [_key(i) for i in range(600)]
        client.put_many([ChunkItem.of(k, _payload(i), (1, len(_payload(i))), "uint8", 16)
                         for i, k in enumerate(keys)])
        cluster.nodes[2].kill()
        assert client.wait_for_nodes(2, timeout=10, exact=True)
        wait_for(lambda: all(n == 2 for n in client.copies(["node-0", "node-1"]).values())
                 and len(client.copies(["node-0", "node-1"])) == len(keys), 20, "2 copies on the survivors")
        joined = cluster.add_node()
        assert client.wait_for_nodes(3, exact=True)
        members = ["node-0", "node-1", joined.node_id]
        wait_for(lambda: all(sorted(holders) == sorted(client.owners(k))
                             for k, holders in _placement(client, members, keys).items()),
                 20, "every chunk on exactly its two owners")
        assert [c is not None and bytes(c.data) == _payload(i) for i, c in enumerate(client.get(keys))] == \
            [True] * len(keys)


def _placement(client: ClusterClient, nodes: list[str], keys: list[bytes]) -> dict[bytes, list[str]]:
    where: dict[bytes, list[str]] = {k: [] for k in keys}
    for node_id in nodes:
        for k, held in zip(keys, client.holders(node_id, keys)):
            if held:
                where[k].append(node_id)
    return where


def test_a_periodic_pass_copies_nothing_to_a_full_node(cluster_factory):
    """On a node at 90 % of its budget or more, a missing copy is most likely one it evicted:
    copying it back would only evict a warmer chunk, so periodic passes leave it alone."""
    cluster = cluster_factory(nodes=2, memory=16 << 20, lease_ttl=3, contract=Contract(chunk_size=16, replication=2),
                              node_args=["--repair-interval", "0.5"])
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(2)
        keys = [b"full-%06d" % i for i in range(240)]  # 240 x 64 KiB: 94 % of 16 MiB on each node
        payload = bytes(64 << 10)
        for start in range(0, len(keys), 40):
            client.put_many([ChunkItem.of(k, payload, (1, len(payload)), "uint8", 16) for k in keys[start:start + 40]])
        wait_for(lambda: client.stats()["node-0"]["repair"]["passes"] >= 1, 10, "node-0's first repair pass")
        assert client.delete(keys[:5], node="node-1") == 5
        stats = client.stats()["node-1"]
        assert stats["used"] >= 0.9 * stats["capacity"]
        passes = client.stats()["node-0"]["repair"]["passes"]
        wait_for(lambda: client.stats()["node-0"]["repair"]["passes"] >= passes + 3, 10, "three more periodic passes")
        assert client.holders("node-1", keys[:5]) == [False] * 5
        assert client.stats()["node-0"]["repair"]["trigger"] == "periodic"
