"""A connector started while its cluster is out of reach does not keep vLLM from serving
(``connector/attach.py``): real etcd started late on the port the connector was given, real
node processes.  vLLM's own start with the cluster down is in ``test_vllm_cluster_down.py``."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
from polling import wait_for

from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract
from kvring.connector.attach import connect
from kvring.connector.config import ConnectorConfig
from kvring.local.cluster import LocalCluster, LocalEtcd


def _item(key: bytes) -> ChunkItem:
    return ChunkItem.of(key, np.frombuffer(os.urandom(4096), dtype=np.uint8), [2, 2048], "uint8", 256)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_a_connector_started_before_etcd_serves_misses_and_reaches_the_cluster_when_it_comes(caplog):
    """etcd is not running: ``connect`` returns after its wait, keying by the default chunk size,
    with one warning; lookups miss and saves are dropped, without an error.  etcd and a node then
    start on that address: the client reaches them on its own, and stores and reads as usual."""
    etcd = LocalEtcd()  # its port chosen, nothing listening yet
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            client, chunk_size = connect(ConnectorConfig(etcd=etcd.endpoint, cluster="late", attach_wait_ms=1000))
        try:
            assert time.monotonic() - t0 < 5
            assert chunk_size == 256 and not client.attached and client.contract is None
            assert "not reached within 1s: vLLM serves without it" in caplog.text
            assert "set chunk_size to the cluster's" in caplog.text
            key = os.urandom(16)
            assert client.lookup([key]) == [False]
            assert client.put_many([_item(key)]) == [0]
            assert client.held_nowhere([key]) == [False]  # no owner asked: nothing known

            etcd.start()
            with LocalCluster(nodes=1, memory=64 << 20, etcd=etcd.endpoint, cluster="late"):
                wait_for(lambda: client.attached and client.wait_for_nodes(1, timeout=0.1), 20,
                         "the connector's client reaching the cluster")
                assert client.contract == Contract() and client.membership.usable
                item = _item(key)
                assert client.put_many([item]) == [1]
                assert client.lookup([key]) == [True]
                assert np.array_equal(client.get([key])[0].data, item.payload)
        finally:
            client.close()
    finally:
        etcd.close()


def test_a_cluster_reached_late_with_another_chunk_size_is_a_miss_not_wrong_kv(etcd_server, caplog):
    """etcd answers but the cluster has no contract yet (no node has started): the connector keys
    by the default 256.  The first node then records chunk_size 512: the keys mean something
    else there, so every lookup is a miss and every save is dropped, with an error naming the
    difference, and nothing is stored."""
    client, chunk_size = connect(ConnectorConfig(etcd=etcd_server.endpoint, cluster="late-512", attach_wait_ms=1000))
    try:
        assert chunk_size == 256 and not client.attached
        with caplog.at_level(logging.ERROR), \
                LocalCluster(nodes=1, memory=64 << 20, etcd=etcd_server.endpoint, cluster="late-512",
                             contract=Contract(chunk_size=512)) as cluster:
            wait_for(lambda: client.attached, 20, "the connector's client reaching the cluster")
            assert "chunk_size: this connector has 256, the cluster has 512" in caplog.text
            assert not client.membership.usable
            key = os.urandom(16)
            assert client.put_many([_item(key)]) == [0]
            assert client.lookup([key]) == [False]
            node = cluster.nodes[0].node_id
            assert client.list_keys(node) == []
    finally:
        client.close()


def test_a_connector_closed_before_it_reached_the_cluster_leaves_nothing_running():
    """vLLM shut down while the cluster was never reached: ``close`` returns at once and the
    attempts stop with it."""
    before = _threads()
    etcd = LocalEtcd()
    try:
        client, _ = connect(ConnectorConfig(etcd=etcd.endpoint, cluster="never", attach_wait_ms=500))
        t0 = time.monotonic()
        client.close()
        assert time.monotonic() - t0 < 6
        assert client.membership._attacher.cancelled() or client.membership._attacher.done()
        wait_for(lambda: not {n for n in _threads() - before if n.startswith("kvring-lookup")}, 5,
                 "the client's threads gone")
    finally:
        etcd.close()
