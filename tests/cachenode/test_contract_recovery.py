"""The cluster contract is never a default, survives etcd losing its data, and a contract that
changes under a running client stops its reads and writes; etcd going away does not make nodes
unready.  Real etcd servers, real node processes."""

from __future__ import annotations

import itertools
import logging
import shutil
import threading
import time

import numpy as np
import pytest
from polling import readyz, wait_for

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract
from kvring.common.errors import MembershipError
from kvring.local.cluster import LocalCluster, LocalEtcd
from kvring.membership.registrar import refresh_period
from kvring.membership.settings import EtcdSettings

REAL = Contract(chunk_size=64, replication=2)  # not the defaults (256, 1)
_names = itertools.count()


def _name() -> str:
    return f"contract-{next(_names)}"


def _etcd(cluster, fn):
    """``fn(etcd)`` against the cluster's etcd; None while it cannot be reached (gRPC keeps
    refusing for its reconnect backoff after etcd came back)."""
    try:
        return cluster.etcd_run(fn)
    except MembershipError:
        return None


def _items(n: int, tag: bytes) -> list[ChunkItem]:
    data = np.arange(256, dtype=np.uint8)
    return [ChunkItem.of(tag + i.to_bytes(8, "big"), data, [1, 256], "uint8", 4) for i in range(n)]


def test_a_client_started_before_any_contract_waits_for_the_real_one(etcd_server):
    name = _name()
    got: dict = {}

    def connect() -> None:
        try:
            got["client"] = ClusterClient(etcd_server.endpoint, cluster=name, contract_wait=30)
        except Exception as exc:  # handed to the test thread
            got["error"] = exc

    waiter = threading.Thread(target=connect)
    waiter.start()
    time.sleep(1.5)  # the client is waiting: nothing recorded yet
    assert waiter.is_alive() and not got
    with LocalCluster(nodes=1, etcd=etcd_server.endpoint, cluster=name, contract=REAL, memory=64 << 20):
        waiter.join(20)
        assert "error" not in got, got.get("error")
        client = got["client"]
        try:
            assert client.contract == REAL  # never the defaults it would have taken before
            client.wait_for_nodes(1)
            assert client.put_many(_items(4, b"w")) == [1] * 4  # replication 2 on one node: one copy
        finally:
            client.close()


def test_a_client_finding_no_contract_fails_with_a_clear_error(etcd_server):
    started = time.monotonic()
    with pytest.raises(MembershipError, match="has no contract in etcd .* none of its nodes has started"):
        ClusterClient(etcd_server.endpoint, cluster=_name(), contract_wait=1)
    assert time.monotonic() - started < 10


def _rejoin_bound(settings: EtcdSettings, ttl: float) -> float:
    """How long a node may take to register again once etcd answers: a retry comes every
    ``refresh_period(ttl)`` s, and one that began while etcd was still down can spend the
    connect timeout and a call's before it fails; two such retries, and slack for a loaded
    2-core machine."""
    return 2 * (settings.timeout + settings.call_timeout + refresh_period(ttl)) + 5


def test_etcd_wiped_the_contract_comes_back_and_nodes_stay_ready_while_it_is_down(caplog):
    caplog.set_level(logging.DEBUG, logger="kvring.local.cluster")  # the nodes' logs, shown if it fails
    etcd = LocalEtcd().start()
    ttl = 3
    try:
        with LocalCluster(nodes=2, etcd=etcd.endpoint, cluster="wiped", contract=REAL, lease_ttl=ttl,
                          memory=64 << 20) as cluster, \
                ClusterClient(etcd.endpoint, cluster="wiped", timeout=2) as client:
            client.wait_for_nodes(2)
            assert client.contract == REAL
            assert all(client.put_many(_items(20, b"a")))
            # etcd stopped: past the nodes' lease TTL, they keep serving and stay ready.
            etcd.stop()
            time.sleep(ttl + 2)
            assert all(readyz(n.admin_addr) == 200 for n in cluster.nodes)
            assert all(client.lookup([it.key for it in _items(20, b"a")]))
            # Its data lost: an empty etcd on the same port.  The client keeps its ring meanwhile
            # (an empty etcd is not a cluster whose nodes all left).
            shutil.rmtree(etcd.data_dir)
            wiped = time.monotonic()
            etcd.start()
            rings = []
            watcher = threading.Thread(target=lambda: [rings.append(len(client.ring)) or time.sleep(0.05)
                                                       for _ in range(60)])
            watcher.start()
            recorded = wait_for(lambda: _etcd(cluster, lambda e: e.read_contract()), ttl + 5, "the contract back")
            assert recorded == REAL and time.monotonic() - wiped <= ttl + 5
            rejoin = _rejoin_bound(EtcdSettings.parse(etcd.endpoint), ttl)  # the nodes' settings: the defaults
            wait_for(lambda: len((_etcd(cluster, lambda e: e.members()) or ({},))[0]) == 2, rejoin, "both nodes back")
            assert client.wait_for_nodes(2, timeout=5, exact=True)
            watcher.join()
            assert min(rings) >= 1, rings  # never an empty ring while the nodes re-registered
            assert client.contract == REAL and client.membership.conflict is None
            assert all(client.put_many(_items(20, b"b")))
            assert all(client.lookup([it.key for it in _items(20, b"b")]))
    finally:
        etcd.close()


def test_a_contract_that_changes_under_a_client_stops_its_reads_and_writes(cluster_factory):
    cluster = cluster_factory(nodes=1, contract=REAL)
    key = f"/kvring/{cluster.cluster}/contract".encode()
    items = _items(8, b"c")
    keys = [it.key for it in items]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        client.wait_for_nodes(1)
        assert all(client.put_many(items)) and all(client.lookup(keys))
        other = Contract(chunk_size=128, replication=2)
        cluster.etcd_run(lambda e: e.call(lambda c: c.put(key, other.to_json())))
        wait_for(lambda: client.membership.conflict, 5, "the change noticed")
        assert "chunk_size" in client.membership.conflict
        assert client.lookup(keys) == [False] * 8  # misses: the connector recomputes
        assert client.get(keys) == [None] * 8
        assert client.put_many(_items(2, b"d")) == [0, 0]
        cluster.etcd_run(lambda e: e.call(lambda c: c.put(key, REAL.to_json())))
        wait_for(lambda: client.membership.conflict is None, 5, "the contract back")
        assert all(client.lookup(keys))
