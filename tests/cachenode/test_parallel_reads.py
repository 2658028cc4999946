"""A GET round across several nodes reads each node on a thread of its own (``Reads._parallel``):
real etcd, real TLS node processes over loopback, the real cluster client.

What must hold however the readers interleave: every byte delivered is the stored byte, a layer
whose checksum a reader finds wrong is never delivered (it is read from the replica), a caller
that stops early stops the readers and leaves no reply to be read by a later request, and a
reader's own error reaches the caller."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from faults import inject

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.client import reads as reads_module
from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract

LAYERS, LAYER_BYTES = 6, 64 << 10


@pytest.fixture(scope="module")
def cluster(etcd_server):
    from kvring.local.cluster import LocalCluster

    with LocalCluster(nodes=3, memory=256 << 20, etcd=etcd_server.endpoint, cluster="test-parallel-reads",
                      contract=Contract(replication=2), tls=True, node_args=["--fault-injection"]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    # Reader threads forced on: this machine may have too few CPUs for the client to pick them.
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls, read_threads=True) as client:
        assert client.wait_for_nodes(3)
        yield client


@pytest.fixture
def stored(client):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    data = {os.urandom(16): rng.integers(0, 256, size=LAYERS * LAYER_BYTES, dtype=np.uint8) for _ in range(36)}
    items = [ChunkItem.of(k, v, [LAYERS, LAYER_BYTES], "uint8", 16) for k, v in data.items()]
    assert client.put_many(items) == [2] * len(items)
    return data


@pytest.fixture
def readers(monkeypatch):
    """Each node reader's thread and node, and whether it returned."""
    runs: list[dict] = []
    original = reads_module.Reads._read_node

    def recorded(self, node_id, *args):
        run = {"thread": threading.current_thread().name, "node": node_id, "returned": False}
        runs.append(run)
        try:
            return original(self, node_id, *args)
        finally:
            run["returned"] = True

    monkeypatch.setattr(reads_module.Reads, "_read_node", recorded)
    return runs


def _layers(client: ClusterClient, keys: list[bytes]) -> dict[tuple[int, int], list[bytes]]:
    """Every delivery of every (key, layer), in order (a failover may deliver a layer twice)."""
    got: dict[tuple[int, int], list[bytes]] = {}
    for batch in client.iter_layers(keys):
        for i, view in zip(batch.indices, batch.views):
            got.setdefault((i, batch.layer), []).append(bytes(view))
    return got


def _expected(data: dict, keys: list[bytes]) -> dict[tuple[int, int], bytes]:
    return {(i, layer): data[k][layer * LAYER_BYTES:(layer + 1) * LAYER_BYTES].tobytes()
            for i, k in enumerate(keys) for layer in range(LAYERS)}


def test_a_read_across_nodes_has_a_reader_per_node_and_delivers_every_byte(client, stored, readers):
    keys = list(stored)
    expected = _expected(stored, keys)
    got = _layers(client, keys)
    assert set(got) == set(expected)
    assert all(deliveries == [expected[at]] for at, deliveries in got.items())
    nodes = {r["node"] for r in readers}
    assert len(nodes) == 3 and len(readers) == 3  # one reader per node of the round
    assert all(r["thread"].startswith("kvring-read") for r in readers)
    assert threading.current_thread().name not in {r["thread"] for r in readers}
    chunks = client.get(keys)  # whole chunks (one payload of every layer each), the same path
    assert all(c is not None and np.array_equal(c.data, stored[k]) for k, c in zip(keys, chunks))


def test_a_corrupt_layer_a_reader_finds_is_never_delivered_and_is_read_from_the_replica(cluster, client, stored,
                                                                                       readers):
    keys = list(stored)
    victim = keys[5]
    assert inject(cluster, client.owners(victim)[0], f"corrupt?key={victim.hex()}") == 200
    dropped = client.reads.corrupt_dropped
    expected = _expected(stored, keys)
    got = _layers(client, keys)
    # Every delivery is the stored bytes: the corrupt layer was caught by its reader's checksum.
    assert set(got) == set(expected)
    assert all(d == expected[at] for at, deliveries in got.items() for d in deliveries)
    assert client.reads.corrupt_dropped == dropped + 1  # and the corrupt copy was deleted
    # The first round's three readers found it; the replica's round asks one node, on this thread.
    assert len(readers) == 3


def test_a_caller_that_stops_early_stops_the_readers_and_later_reads_are_right(client, stored, readers):
    keys = list(stored)
    stream = client.iter_layers(keys)
    next(stream)  # one node's first layer; the others' readers are mid-stream
    stream.close()
    deadline = time.monotonic() + 5
    while not all(r["returned"] for r in readers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert readers and all(r["returned"] for r in readers)
    expected = _expected(stored, keys)
    for _ in range(3):  # connections that held unread replies were closed, not reused
        got = _layers(client, keys)
        assert got == {at: [b] for at, b in expected.items()}


def test_a_readers_own_error_reaches_the_caller(client, stored, monkeypatch):
    def broken(*args):
        raise RuntimeError("a reader's bug")

    monkeypatch.setattr(reads_module, "_digests", broken)
    with pytest.raises(RuntimeError, match="a reader's bug"):
        _layers(client, list(stored))
    monkeypatch.undo()
    keys = list(stored)
    got = _layers(client, keys)
    assert got == {at: [b] for at, b in _expected(stored, keys).items()}


def test_a_hung_node_times_out_to_its_replica_while_the_other_readers_deliver(cluster_factory, readers):
    """SIGSTOP: one reader waits out ``timeout`` on its silent node while the others deliver; its
    keys are then read from their replicas, and the node's late replies are never read."""
    import signal

    cluster = cluster_factory(nodes=3, contract=Contract(replication=2), lease_ttl=30)
    rng = np.random.default_rng(5)
    data = {os.urandom(16): rng.integers(0, 256, size=LAYERS * LAYER_BYTES, dtype=np.uint8) for _ in range(24)}
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=0.5, failure_backoff=60,
                       read_threads=True) as client:
        assert client.wait_for_nodes(3)
        assert client.put_many([ChunkItem.of(k, v, [LAYERS, LAYER_BYTES], "uint8", 16)
                                for k, v in data.items()]) == [2] * len(data)
        keys = list(data)
        expected = _expected(data, keys)
        victim = cluster.nodes[0]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got = _layers(client, keys)
            assert time.monotonic() - t0 < 5
            assert set(got) == set(expected)
            assert all(d == expected[at] for at, deliveries in got.items() for d in deliveries)
            assert not client.marks.alive("node-0")
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        client.marks.forgive("node-0")
        for _ in range(3):  # node-0 answers again, on fresh connections, with the right bytes
            assert _layers(client, keys) == {at: [b] for at, b in expected.items()}
    assert len({r["node"] for r in readers}) == 3


def test_reader_threads_are_picked_by_the_cpus_the_process_may_use(monkeypatch, tmp_path):
    """On by default from ``READERS_MIN_CPUS`` CPUs: those the process may run on, capped by its
    cgroup's CPU quota (a Kubernetes CPU limit on a large machine)."""
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(reads_module, "CGROUP_CPU_MAX", str(cpu_max))
    monkeypatch.setattr(reads_module.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert reads_module.readers_pay_off()  # no cgroup file: the 16 CPUs
    cpu_max.write_text("max 100000\n")
    assert reads_module.readers_pay_off()
    cpu_max.write_text("200000 100000\n")  # a limit of 2 CPUs
    assert not reads_module.readers_pay_off()
    cpu_max.write_text("400000 100000\n")
    assert reads_module.readers_pay_off()
    monkeypatch.setattr(reads_module.os, "sched_getaffinity", lambda pid: {0, 1})
    assert not reads_module.readers_pay_off()
