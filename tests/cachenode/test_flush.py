"""Namespace flush: the store's namespace index, the wire format of ChunkMeta's namespace, and
Flush across a real cluster (real etcd, real node processes)."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.client.transport import next_rid
from kvring.cachenode.store import ENTRY_OVERHEAD, ChunkStore
from kvring.common import protocol as P
from kvring.common.chunk import ChunkItem, ChunkMeta, make_meta
from kvring.common.errors import RemoteError


def _chunk(n: int, namespace: str = ""):
    buf = np.zeros(n, dtype=np.uint8)
    return make_meta(buf, [1, n], "uint8", 1, namespace), buf


def test_store_index_follows_put_delete_eviction_and_flush():
    C = 100 + ENTRY_OVERHEAD  # what a 100-byte chunk costs the budget
    store = ChunkStore(capacity_bytes=10 * C)
    for i in range(3):
        store.put(b"a%d" % i, *_chunk(100, "A"))
        store.put(b"b%d" % i, *_chunk(100, "B"))
    store.put(b"none", *_chunk(100))
    assert store.namespaces() == {"A": 3, "B": 3}
    store.delete(b"a0")
    assert store.namespaces() == {"A": 2, "B": 3}
    # Eviction (LRU: b0 and a1 are the oldest left) keeps the index true.
    store.put(b"big", *_chunk(6 * C - ENTRY_OVERHEAD, "C"))
    assert b"b0" not in store and b"a1" not in store
    assert store.namespaces() == {"A": 1, "B": 2, "C": 1}
    assert store.delete_namespace("B") == 2
    assert store.namespaces() == {"A": 1, "C": 1}
    assert b"none" in store and b"a2" in store and store.used == 8 * C
    assert store.delete_namespace("B") == 0 and store.delete_namespace("nope") == 0
    with pytest.raises(ValueError, match="empty namespace"):
        store.delete_namespace("")
    assert len(store) == 3


def test_namespace_is_a_trailing_field_old_and_new_peers_agree():
    class OldMeta(msgspec.Struct, frozen=True, array_like=True):  # ChunkMeta before namespaces
        shape: list[int]
        dtype: str
        tokens: int
        checksums: list[int]

    old = msgspec.msgpack.encode(OldMeta([2, 8], "uint8", 4, [1, 2]))
    assert msgspec.msgpack.decode(old, type=ChunkMeta) == ChunkMeta([2, 8], "uint8", 4, [1, 2], "")
    new = msgspec.msgpack.encode(ChunkMeta([2, 8], "uint8", 4, [1, 2], "ns"))
    assert msgspec.msgpack.decode(new, type=OldMeta) == OldMeta([2, 8], "uint8", 4, [1, 2])
    with pytest.raises(Exception, match="namespace of 300 bytes"):
        make_meta(np.zeros(8, dtype=np.uint8), [1, 8], "uint8", 1, "n" * 300)


def test_flush_across_the_cluster_leaves_other_namespaces_alone(cluster_factory):
    cluster = cluster_factory(nodes=3)
    data = np.arange(64, dtype=np.uint8)
    keys = {ns: [os.urandom(16) for _ in range(60)] for ns in ("tenant-a", "tenant-b", "")}
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(3)
        for ns, ks in keys.items():
            assert client.put_many([ChunkItem.of(k, data, [2, 32], "uint8", 8, ns) for k in ks]) == [1] * 60
        # Per-item namespaces (the handoff path) land in the same index.
        extra = [os.urandom(16) for _ in range(5)]
        client.put_many([ChunkItem.of(k, data, [2, 32], "uint8", 8, "tenant-a") for k in extra])
        keys["tenant-a"] += extra
        assert sum(s["namespaces"] for s in client.stats().values()) >= 4  # both tenants, on several nodes

        per_node = client.flush_namespace_nodes("tenant-a")
        assert set(per_node) == {n.node_id for n in cluster.nodes} and sum(per_node.values()) == 65
        assert not any(client.lookup(keys["tenant-a"]))
        assert all(client.lookup(keys["tenant-b"])) and all(client.lookup(keys[""]))
        assert client.flush_namespace("tenant-a") == 0  # idempotent
        assert client.flush_namespace("tenant-b") == 60
        assert all(client.lookup(keys[""]))  # chunks without a namespace are never flushed

        with pytest.raises(ValueError, match="non-empty"):
            client.flush_namespace("")
        # A node refuses an empty namespace on the wire too, instead of reading it as "everything".
        node_id = cluster.nodes[0].node_id
        with pytest.raises(RemoteError, match="bad_namespace"):
            client.request(node_id, P.Flush(rid=next_rid(), namespace=""))
        assert all(client.lookup(keys[""]))


def test_replicas_are_all_flushed(cluster_factory):
    from kvring.common.contract import Contract

    cluster = cluster_factory(nodes=3, contract=Contract(replication=2))
    data = np.arange(64, dtype=np.uint8)
    ks = [os.urandom(16) for _ in range(30)]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(3)
        assert client.put_many([ChunkItem.of(k, data, [2, 32], "uint8", 8, "t") for k in ks]) == [2] * 30
        assert client.flush_namespace("t") == 60  # copies, across the nodes that held them
        assert sum(s["chunks"] for s in client.stats().values()) == 0
