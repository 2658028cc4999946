"""Shared fixtures: one real etcd server per test session, real node processes per test."""

from __future__ import annotations

import itertools
import os
import shutil

import pytest

from kvring.engine.run import IN_PROCESS_ENV
from kvring.engine.zygote import ZYGOTE_ENV
from kvring.local.cluster import LocalCluster, LocalEtcd

_names = itertools.count()

# vLLM engines of one worker (``kvring.engine.run``, here and in the benchmarks the tests run) keep
# their engine core and worker in one process: each start imports vLLM once instead of three times,
# some 20 s less on 2 cores, over some forty starts.  The processes vLLM runs in production are
# still exercised: by `vllm serve` (test_vllm_serve, test_dashboard), by every tensor- and
# pipeline-parallel engine (test_vllm_parallel, test_vllm_mla), and by the tests that race loads
# against hung or killed nodes (test_vllm_hung_node, the hybrid stop/kill test: "in_process": False).
os.environ.setdefault(IN_PROCESS_ENV, "1")
# And each engine instance forks from a zygote that imported vLLM once per test process (or per
# benchmark command a test runs), rather than importing it again: some 12 s less per start here.
# The processes vLLM starts itself (engine cores, parallel workers, `vllm serve`) start as ever.
os.environ.setdefault(ZYGOTE_ENV, "1")


@pytest.fixture(scope="session")
def etcd_server():
    if shutil.which("etcd") is None and not __import__("os").path.exists("/usr/bin/etcd"):
        pytest.fail("etcd is not installed; the README's test command installs it (apt-get install etcd-server)")
    server = LocalEtcd().start()
    yield server
    server.close()


@pytest.fixture
def cluster_factory(etcd_server):
    """Start ``LocalCluster``s on the session's etcd, each under a cluster name of its own."""
    started: list[LocalCluster] = []

    def make(nodes: int = 3, memory: int = 256 << 20, lease_ttl: int = 10, **kw) -> LocalCluster:
        cluster = LocalCluster(nodes=nodes, memory=memory, etcd=etcd_server.endpoint,
                               cluster=f"test-{next(_names)}", lease_ttl=lease_ttl, **kw)
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.close()
