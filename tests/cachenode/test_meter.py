"""What a read's ``ReadMeter`` records, node by node, against real node processes: the bytes and
present keys each node answered with, and a stopped node as a failure, never as a slow sample."""

from __future__ import annotations

import os
import signal

import numpy as np

from kvring.cachenode.client import ClusterClient, ReadMeter
from kvring.common.chunk import ChunkItem

LAYERS, TOKENS, WIDTH = 4, 16, 1024  # a chunk: 4 layers of 16 KiB


def _store(client: ClusterClient, n: int) -> tuple[list[bytes], int]:
    rng = np.random.default_rng(3)
    keys = [os.urandom(16) for _ in range(n)]
    data = rng.integers(0, 256, size=LAYERS * TOKENS * WIDTH, dtype=np.uint8)
    assert client.put_many([ChunkItem.of(k, data, [LAYERS, TOKENS, WIDTH], "uint8", TOKENS) for k in keys]) == [1] * n
    return keys, data.nbytes


def test_a_meter_splits_a_read_by_node(cluster_factory):
    cluster = cluster_factory(nodes=3)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(3)
        keys, chunk_bytes = _store(client, 60)
        owners = client.ring.primaries(keys)
        meter = ReadMeter()
        assert client.lookup([*keys, os.urandom(16)], meter=meter) == [True] * len(keys) + [False]
        lookups = {t.node_id: t for t in meter.transfers()}
        assert {n: t.hits for n, t in lookups.items() if t.hits} == {n: owners.count(n) for n in set(owners)}
        assert all(t.ok and t.nbytes == 0 for t in lookups.values())
        meter = ReadMeter()
        found = [None] * len(keys)
        got = sum(len(b.indices) for b in client.iter_layers(keys, found=found, meter=meter))
        assert got == len(keys) * LAYERS and all(found)
        reads = {t.node_id: t for t in meter.transfers()}
        assert {n: t.nbytes for n, t in reads.items()} == {n: owners.count(n) * chunk_bytes for n in set(owners)}
        assert all(t.ok and 0 <= t.first_reply_s <= t.seconds for t in reads.values())


def test_a_stopped_node_is_a_failure_of_that_node_and_the_others_are_measured(cluster_factory):
    cluster = cluster_factory(nodes=3)
    victim = cluster.nodes[0]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=1.0) as client:
        assert client.wait_for_nodes(3)
        keys, chunk_bytes = _store(client, 60)
        owners = client.ring.primaries(keys)
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            meter = ReadMeter()
            list(client.iter_layers(keys, meter=meter))
            reads = {t.node_id: t for t in meter.transfers()}
            assert not reads[victim.node_id].ok and reads[victim.node_id].nbytes == 0
            assert reads[victim.node_id].seconds >= 1.0  # it was waited for until the timeout
            healthy = {n: t for n, t in reads.items() if n != victim.node_id}
            assert all(t.ok for t in healthy.values())
            assert {n: t.nbytes for n, t in healthy.items()} == {
                n: owners.count(n) * chunk_bytes for n in set(owners) if n != victim.node_id}
            # A load abandoned while a node still owes it bytes: that node failed, the rest measured.
            meter = ReadMeter()
            stream = client.iter_layers(keys, meter=meter)
            next(stream)
            abandoned = {t.node_id: t for t in meter.transfers(abandoned=True)}
            assert not abandoned[victim.node_id].ok
            stream.close()
        finally:
            os.kill(victim.pid, signal.SIGCONT)
