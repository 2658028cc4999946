"""vLLM with kvring starts and serves while the cluster is down, and uses it once it is up
(``connector/attach.py``): the real engine, real etcd started late on the address the connector
was given, real node processes."""

from __future__ import annotations

import time

import numpy as np
from placement import wait_saved

from kvring.cachenode.client import ClusterClient
from kvring.engine.run import layout_of, start_instance, write_tiny_llama
from kvring.local.cluster import LocalCluster, LocalEtcd

CHUNK = 256


def test_vllm_serves_while_the_cluster_is_down_and_loads_from_it_once_it_is_up(tmp_path):
    model = str(write_tiny_llama(tmp_path / "tiny-llama"))
    prompt = np.random.default_rng(31).integers(10, 2000, size=1100).tolist()  # 4 whole chunks
    etcd = LocalEtcd()  # its port chosen, nothing listening yet
    conn = {"etcd": etcd.endpoint, "cluster": "down", "attach_wait_ms": 1000, "load_admission": False}
    instance = start_instance(tmp_path, "down", {"model": model, "connector": conn, "prompts": [
        {"tokens": prompt},  # 0: no cluster: computed, its saves dropped
        {"touch": str(tmp_path / "served")}, {"wait_for": str(tmp_path / "up"), "timeout": 300},
        {"tokens": prompt},  # 1: the cluster reached: computed, saved
        {"tokens": prompt},  # 2: (a save of 1 may still be under way: computed again, or loaded)
        {"touch": str(tmp_path / "computed")}, {"wait_for": str(tmp_path / "saved"), "timeout": 300},
        {"tokens": prompt},  # 3: loaded
    ]})
    try:
        # vLLM started (each connector role waited its 1 s for the cluster) and served the prompt.
        instance.wait_file(tmp_path / "served", 600)
        etcd.start()
        with LocalCluster(nodes=2, memory=256 << 20, etcd=etcd.endpoint, cluster="down") as cluster:
            time.sleep(6)  # the engine's clients ask etcd again at most every 2 s: they reach it meanwhile
            (tmp_path / "up").touch()
            instance.wait_file(tmp_path / "computed", 600)
            with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
                wait_saved(client, layout_of({"model": model}, client.contract.chunk_size), [prompt])
            (tmp_path / "saved").touch()
            out = instance.result(timeout=600)
    finally:
        instance.stop()
        etcd.close()
    down, reached, _, loaded = out["results"]
    steps = out["steps"]
    assert down["cached"] == 0 and steps[0]["counters"].get("saved_parts", 0) == 0
    assert steps[-1]["counters"]["failed_saves"] > 0  # the first prompt's: dropped, not an error
    assert reached["cached"] == 0 and steps[1]["counters"]["saved_parts"] > 0
    assert loaded["cached"] == 4 * CHUNK
    # A load equals the recompute: the same greedy tokens as without the cluster.
    assert loaded["tokens"] == reached["tokens"] == down["tokens"]
