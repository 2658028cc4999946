"""Real etcd, real node processes over loopback TCP, the real cluster client."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.client.transport import Exchange, Links, Reply, next_rid
from kvring.common import protocol as P
from kvring.common.chunk import DTYPE_SIZES, ChunkItem
from kvring.common.contract import Contract
from kvring.common.errors import ContractMismatch
from kvring.local.cluster import LocalCluster, NodeProcess

MiB = 1 << 20


def _random_chunk(rng: np.random.Generator):
    layers = int(rng.integers(1, 9))
    dtype = str(rng.choice(sorted(DTYPE_SIZES)))
    rest = [int(x) for x in rng.integers(1, 9, size=int(rng.integers(1, 4)))]
    nbytes = layers * int(np.prod(rest)) * DTYPE_SIZES[dtype]
    data = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    return os.urandom(16), data, [layers, *rest], dtype


def test_1000_random_chunks_read_back_byte_identical(cluster_factory):
    cluster = cluster_factory(nodes=3)
    rng = np.random.default_rng(7)
    chunks = [_random_chunk(rng) for _ in range(1000)]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(3)
        for i in range(0, 1000, 100):
            stored = client.put_many([ChunkItem.of(k, d, s, t, 16) for k, d, s, t in chunks[i:i + 100]])
            assert stored == [1] * 100
        keys = [c[0] for c in chunks]
        assert client.lookup(keys) == [True] * 1000
        whole = client.get(keys)
        for (key, data, shape, dtype), got in zip(chunks, whole):
            assert got is not None and got.key == key
            assert got.meta.shape == shape and got.meta.dtype == dtype and got.meta.tokens == 16
            assert np.array_equal(got.data, data)
        # Layer ranges, chosen per chunk, read back the same bytes as slicing the original.
        for key, data, shape, dtype in chunks[:300]:
            a = int(rng.integers(0, shape[0]))
            b = int(rng.integers(a + 1, shape[0] + 1))
            lb = data.nbytes // shape[0]
            got = client.get([key], layers=(a, b))[0]
            assert np.array_equal(got.data, data[a * lb:b * lb])
        # Streaming: every layer of every key arrives exactly once, intact.
        seen = {}
        for batch in client.iter_layers(keys[:200]):
            for i, view in zip(batch.indices, batch.views):
                lb = chunks[i][1].nbytes // chunks[i][2][0]
                assert bytes(view) == chunks[i][1][batch.layer * lb:(batch.layer + 1) * lb].tobytes()
                seen[(i, batch.layer)] = seen.get((i, batch.layer), 0) + 1
        assert len(seen) == sum(c[2][0] for c in chunks[:200]) and set(seen.values()) == {1}
        # Spread over all nodes.
        stats = client.stats()
        assert sum(s["chunks"] for s in stats.values()) == 1000
        assert all(s["chunks"] > 200 for s in stats.values())
        assert client.get([b"not-there-at-all"]) == [None]


def _wait(predicate, timeout: float, interval: float = 0.05) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    return None


def test_killed_node_leaves_within_ttl_and_returns_to_its_keys(cluster_factory):
    ttl = 3
    cluster = cluster_factory(nodes=3, lease_ttl=ttl)
    keys = [os.urandom(16) for _ in range(10_000)]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(3)
        owners_before = client.ring.owners_many(keys)
        victim = cluster.nodes[1]
        victim.kill()
        left_after = _wait(lambda: "node-1" not in client.ring.nodes, ttl + 2)
        assert left_after is not None, "the killed node was still on the ring after TTL + 2 s"
        assert all(o != ["node-1"] for o in client.ring.owners_many(keys))
        # Restarted with the same id, it owns exactly the same keys again.
        victim.start()
        assert _wait(lambda: "node-1" in client.ring.nodes, 10) is not None
        assert client.ring.owners_many(keys) == owners_before


def test_replica_serves_reads_when_a_node_is_killed(cluster_factory):
    cluster = cluster_factory(nodes=3, contract=Contract(replication=2))
    rng = np.random.default_rng(3)
    data = {os.urandom(16): rng.integers(0, 256, size=4096, dtype=np.uint8) for _ in range(200)}
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=1.0) as client:
        assert client.wait_for_nodes(3)
        assert client.put_many([ChunkItem.of(k, v, [4, 1024], "uint8", 8) for k, v in data.items()]) == [2] * 200
        cluster.nodes[0].kill()  # the ring still lists it until its lease runs out
        keys = list(data)
        assert client.lookup(keys) == [True] * 200
        got = client.get(keys)
        assert all(g is not None and np.array_equal(g.data, data[k]) for k, g in zip(keys, got))


def _fill_then_add_a_node(cluster, client, seed: int) -> tuple[dict[bytes, np.ndarray], list[bytes]]:
    """300 chunks on a 2-node ring, then a third node: the data and the keys it now owns."""
    rng = np.random.default_rng(seed)
    data = {os.urandom(16): rng.integers(0, 256, size=1024, dtype=np.uint8) for _ in range(300)}
    assert client.wait_for_nodes(2)
    client.put_many([ChunkItem.of(k, v, [2, 512], "uint8", 4) for k, v in data.items()])
    cluster.add_node()
    assert client.wait_for_nodes(3)
    moved = [k for k in data if client.ring.owners(k) == ["node-2"]]
    assert len(moved) > 30  # about a third moved to the new node
    return data, moved


def test_reads_fall_back_to_the_previous_owner_after_a_ring_change(cluster_factory):
    cluster = cluster_factory(nodes=2, node_args=["--no-handoff"])  # the fallback alone
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        data, moved = _fill_then_add_a_node(cluster, client, seed=4)  # node-2 holds none of them
        assert client.lookup(moved) == [True] * len(moved)
        got = client.get(moved)
        assert all(g is not None and np.array_equal(g.data, data[k]) for k, g in zip(moved, got))


def test_chunks_are_handed_off_to_their_new_owner(cluster_factory):
    cluster = cluster_factory(nodes=2)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        data, moved = _fill_then_add_a_node(cluster, client, seed=8)

        def settled():
            stats = client.stats()
            return stats["node-2"].get("chunks") == len(moved) and sum(s["chunks"] for s in stats.values()) == 300
        assert _wait(settled, 20) is not None, client.stats()
        assert sum(s["handed_off"] for s in client.stats().values()) == len(moved)
        # Each chunk now lives only on its owner, byte-identical.
        assert set(client.list_keys("node-2")) == set(moved)
        got = client.get(moved, node="node-2")
        assert all(g is not None and np.array_equal(g.data, data[k]) for k, g in zip(moved, got))
        for node_id in ("node-0", "node-1"):
            assert not set(client.list_keys(node_id)) & set(moved)


def test_etcd_outage_keeps_data_plane_up_and_nodes_reregister():
    ttl = 2
    with LocalCluster(nodes=3, memory=64 * MiB, lease_ttl=ttl, cluster="outage") as cluster:
        with ClusterClient(cluster.etcd, cluster="outage") as client:
            assert client.wait_for_nodes(3)
            before = {n: client.stats()[n]["registrations"] for n in client.ring.nodes}
            cluster.local_etcd.stop()
            time.sleep(ttl + 2)  # longer than the nodes' lease TTL
            assert not client.etcd_ok and len(client.ring) == 3  # the last ring is kept
            rng = np.random.default_rng(5)
            data = {os.urandom(16): rng.integers(0, 256, size=2048, dtype=np.uint8) for _ in range(100)}
            assert client.put_many([ChunkItem.of(k, v, [2, 1024], "uint8", 4) for k, v in data.items()]) == [1] * 100
            got = client.get(list(data))
            assert all(np.array_equal(g.data, data[k]) for k, g in zip(data, got))
            cluster.local_etcd.start()
            assert _wait(lambda: client.etcd_ok and len(client.members) == 3, 15) is not None

            def reregistered():
                stats = client.stats()
                return all(stats[n].get("registered") and stats[n]["registrations"] > before[n] for n in before)
            assert _wait(reregistered, 15) is not None
            got = client.get(list(data))
            assert all(np.array_equal(g.data, data[k]) for k, g in zip(data, got))


def test_putting_twice_the_budget_stays_within_budget_and_evicts_lru(cluster_factory):
    budget = 64 * MiB
    overhead = 160 * MiB  # stated fixed overhead of a node process (interpreter, numpy, buffers, payload pool)
    cluster = cluster_factory(nodes=1, memory=budget)
    node = psutil.Process(cluster.nodes[0].pid)
    chunk = MiB
    keys = [os.urandom(16) for _ in range(2 * budget // chunk)]
    rng = np.random.default_rng(6)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(1)
        hot = keys[0]
        peak_rss = 0
        for i, key in enumerate(keys):
            data = rng.integers(0, 256, size=chunk, dtype=np.uint8)
            assert client.put(key, data, [4, chunk // 4], "uint8", 64) == 1
            if i % 8 == 0:
                assert client.get([hot]) [0] is not None  # keep one early chunk hot
            stats = client.stats()["node-0"]
            assert stats["used"] <= budget
            peak_rss = max(peak_rss, node.memory_info().rss)
        stats = client.stats()["node-0"]
        assert stats["evictions"] >= len(keys) // 2 - 1
        present = client.lookup(keys)
        assert present[0]  # recently used, kept
        assert not any(present[1:len(keys) // 3])  # the oldest, unused ones went first
        assert all(present[-(budget // chunk) + 2:])  # the newest are there
    assert peak_rss <= budget + overhead, f"node RSS peaked at {peak_rss / MiB:.0f} MiB"


def test_contract_mismatch_is_refused_with_the_difference(cluster_factory):
    cluster = cluster_factory(nodes=1)
    other = NodeProcess("node-x", 64 * MiB, cluster.etcd, cluster.cluster, contract=Contract(chunk_size=512))
    with pytest.raises(RuntimeError) as info:
        other.start()
    assert "chunk_size" in str(info.value) and "512" in str(info.value) and "256" in str(info.value)
    with pytest.raises(ContractMismatch, match="replication: this process has 3, the cluster has 1"):
        ClusterClient(cluster.etcd, cluster=cluster.cluster, contract=Contract(replication=3))
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, contract=Contract()) as ok:
        assert ok.wait_for_nodes(1, exact=True)


def test_a_node_restarted_on_its_address_is_reached_at_once(cluster_factory):
    """Pooled connections to a node that restarted (same address) are found closed and replaced:
    the first request after the restart succeeds and the node is not marked failed."""
    cluster = cluster_factory(nodes=1)
    node = cluster.nodes[0]
    keys = [os.urandom(16) for _ in range(32)]
    data = np.arange(2048, dtype=np.uint8)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(1)
        assert client.put_many([ChunkItem.of(k, data, [2, 1024], "uint8", 4) for k in keys]) == [1] * 32
        assert all(client.lookup(keys))  # the pool now holds an idle connection to the node
        node.kill()
        node.data_port = int(node.data_addr.rsplit(":", 1)[1])
        node.start()
        assert not any(client.lookup(keys))  # a fresh (empty) node, reached on the first try
        assert client.marks.alive("node-0")
        assert client.put_many([ChunkItem.of(k, data, [2, 1024], "uint8", 4) for k in keys]) == [1] * 32
        assert all(c is not None and np.array_equal(c.data, data) for c in client.get(keys))


def test_a_hung_node_times_out_to_its_replica_and_its_late_replies_are_never_read(cluster_factory):
    """SIGSTOP, not a crash: the node's connections stay open and silent.  Reads fail over after
    ``timeout``; when the node wakes, what it still sends on the abandoned connections is never
    read as the answer to a later request (those connections were closed)."""
    cluster = cluster_factory(nodes=2, contract=Contract(replication=2), lease_ttl=30)
    rng = np.random.default_rng(4)
    data = {os.urandom(16): rng.integers(0, 256, size=8192, dtype=np.uint8) for _ in range(64)}
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=0.5, failure_backoff=60) as client:
        assert client.wait_for_nodes(2)
        assert client.put_many([ChunkItem.of(k, v, [8, 1024], "uint8", 8) for k, v in data.items()]) == [2] * 64
        keys = list(data)
        victim = cluster.nodes[0]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert client.lookup(keys) == [True] * 64
            got = client.get(keys)
            assert all(g is not None and np.array_equal(g.data, data[k]) for k, g in zip(keys, got))
            assert time.monotonic() - t0 < 5
            assert not client.marks.alive("node-0")
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        client.marks.forgive("node-0")
        for _ in range(5):  # node-0 answers again, on fresh connections, with the right bytes
            got = client.get(keys)
            assert all(g is not None and np.array_equal(g.data, data[k]) for k, g in zip(keys, got))
            assert client.lookup(keys) == [True] * 64
        assert client.ping("node-0") < 5


def test_a_client_kept_off_a_cpu_past_its_timeout_does_not_blame_the_node(cluster_factory):
    """A request queued, then the calling thread kept from running for longer than the node
    timeout before it pumps the exchange (a starved machine): the request goes out then, and the
    node's answer is read; the node is not failed for a silence that was the client's."""
    cluster = cluster_factory(nodes=1)
    node = cluster.nodes[0]
    links = Links(connect_timeout=5, buffer_pool_bytes=16 << 20)
    links.update({node.node_id: node.data_addr})
    try:
        with Exchange(links, timeout=0.3) as ex:
            ex.request(node.node_id, P.Lookup(rid=next_rid(), keys=[b"k" * 16]))
            time.sleep(0.6)  # off a CPU between queueing the request and sending it
            events = list(ex.events())
        assert [type(e) for e in events] == [Reply] and isinstance(events[0].msg, P.LookupReply)
    finally:
        links.close()


def test_a_connection_reset_as_a_request_is_sent_fails_that_node_alone(cluster_factory):
    """A node that resets a connection between the client taking it and sending on it (a node
    closing the connections a dropped CA admitted, a node restarting): the send fails, that node's
    request is a ``NodeUnavailable`` failure, and the request to the other node in the same
    exchange is answered.  The resetting peer is a plain socket that accepts and resets, since a
    real node cannot be made to close at that instant; the other node is real."""
    import socket
    import struct
    import threading

    from kvring.common.errors import NodeUnavailable

    cluster = cluster_factory(nodes=1)
    node = cluster.nodes[0]
    listener = socket.create_server(("127.0.0.1", 0))
    reset_done = threading.Event()

    def accept_and_reset() -> None:
        peer, _ = listener.accept()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
        peer.close()
        reset_done.set()

    threading.Thread(target=accept_and_reset, daemon=True).start()
    links = Links(connect_timeout=5, buffer_pool_bytes=16 << 20)
    links.update({node.node_id: node.data_addr, "resetter": f"127.0.0.1:{listener.getsockname()[1]}"})
    try:
        with Exchange(links, timeout=5) as ex:
            lost = ex.request("resetter", P.Lookup(rid=next_rid(), keys=[b"k" * 16]))
            asked = ex.request(node.node_id, P.Lookup(rid=next_rid(), keys=[b"k" * 16]))
            assert reset_done.wait(5)
            time.sleep(0.2)  # the reset has arrived before the first send, which it fails
            events = list(ex.events())
        failures = [e for e in events if not isinstance(e, Reply)]
        replies = [e for e in events if isinstance(e, Reply)]
        assert [(f.node_id, f.rids, type(f.error)) for f in failures] == [("resetter", [lost], NodeUnavailable)]
        assert [(r.node_id, r.rid, type(r.msg)) for r in replies] == [(node.node_id, asked, P.LookupReply)]
    finally:
        links.close()
        listener.close()


def test_a_chunk_missing_on_its_primary_is_found_and_read_on_its_replica(cluster_factory):
    """Replication protects: a primary that does not hold a chunk (restarted empty, or evicted
    it) is a miss there, not a miss of the cluster -- lookups, GETs and streamed GETs go on to
    the next owner, and a lookup's lease lands where the chunk is."""
    from kvring.cachenode.client.transport import next_rid
    from kvring.common import protocol as P

    cluster = cluster_factory(nodes=3, contract=Contract(replication=2))
    rng = np.random.default_rng(11)
    items = [ChunkItem.of(os.urandom(16), rng.integers(0, 256, 4096, dtype=np.uint8), [2, 2048], "uint8", 16)
             for _ in range(30)]
    keys = [it.key for it in items]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        client.wait_for_nodes(3)
        assert client.put_many(items) == [2] * 30
        for key in keys:  # gone from every primary
            assert client.request(client.owners(key)[0], P.Delete(rid=next_rid(), keys=[key])).deleted == 1
        assert client.lookup(keys, lease_ms=30_000) == [True] * 30
        leased = {n: s["leased_bytes"] for n, s in client.stats().items()}
        assert sum(leased.values()) >= 30 * 4096  # on the replicas, which hold them
        got = client.get(keys)
        assert all(c is not None and np.array_equal(c.data, it.payload) for c, it in zip(got, items))
        layers = {}
        for batch in client.iter_layers(keys):
            for i, view in zip(batch.indices, batch.views):
                layers[i, batch.layer] = bytes(view)
        assert layers == {(i, layer): it.payload[layer * 2048:(layer + 1) * 2048].tobytes()
                          for i, it in enumerate(items) for layer in range(2)}
        client.delete(keys[:3])  # on no owner now: a miss
        assert client.lookup(keys[:4]) == [False, False, False, True]
        assert client.get(keys[:4])[:3] == [None] * 3


def test_lookups_and_reads_of_more_keys_than_one_request_holds_are_split(cluster_factory, monkeypatch):
    """A long prompt's parts can outnumber what one request may name on a small cluster: the
    client cuts a node's share into several requests.  The limit is lowered in this (client)
    process to 7 keys, so 20 keys on one node take 3 LOOKUPs and 3 GETs; the node's own limit is
    untouched."""
    from kvring.common import protocol as P

    cluster = cluster_factory(nodes=1, memory=16 << 20)
    keys = [os.urandom(16) for _ in range(20)]
    data = [np.random.default_rng(i).integers(0, 255, size=2 * 64, dtype=np.uint8) for i in range(20)]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert all(client.put_many([ChunkItem.of(k, d, [2, 64], "uint8", 64) for k, d in zip(keys, data)]))
        monkeypatch.setattr(P, "MAX_KEYS_PER_REQUEST", 7)
        sent: dict[str, list[int]] = {"lookup": [], "get": []}
        for op, cls in (("lookup", P.Lookup), ("get", P.Get)):
            def spy(*args, _cls=cls, _op=op, **kw):
                sent[_op].append(len(kw["keys"]))
                return _cls(*args, **kw)
            monkeypatch.setattr(P, cls.__name__, spy)
        absent = [os.urandom(16) for _ in range(5)]
        assert client.lookup(keys + absent) == [True] * 20 + [False] * 5
        got = client.get(keys)
        assert [bytes(c.data) for c in got] == [d.tobytes() for d in data]
        layers = {}
        for batch in client.iter_layers(keys):
            for i, view in zip(batch.indices, batch.views):
                layers[(batch.layer, i)] = bytes(view)
        assert layers == {(layer, i): data[i][layer * 64:(layer + 1) * 64].tobytes()
                          for layer in range(2) for i in range(20)}
    assert sorted(sent["lookup"]) == [4, 7, 7, 7] and sorted(sent["get"]) == [6, 6, 7, 7, 7, 7]
