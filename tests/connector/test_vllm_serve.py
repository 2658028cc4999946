"""KVRingConnector behind vLLM's OpenAI-compatible server, configured exactly as ``kvring up`` says.

Two ``vllm serve`` processes (``kvring.engine.serve``) on a random tiny Llama, a real 3-node cluster
on the session's etcd: server A computes prompts given as token ids over ``/v1/completions``;
server B loads them from the cluster and answers the same tokens as A and as its own recompute
under another ``cache_salt``, which loads nothing.  B's ``/metrics`` shows the loads in vLLM's
external-prefix-cache counters and in the connector's own series.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from kvring.cachenode.client import ClusterClient
from kvring.common.contract import transfer_config
from kvring.engine.serve import VLLMServer

CHUNK = 256  # the cluster's default chunk size
BLOCK = 128  # the CPU backend's block size for this model

# vLLM's counters for the connector's prefix cache (vllm/v1/metrics/loggers.py), in tokens.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
# The connector's own series (KVRingConnector's Prometheus metrics, through vLLM's /metrics).
KVRING_HIT_TOKENS = "vllm:kvring_hit_tokens_total"
KVRING_LOOKUPS = "vllm:kvring_lookups_total"


@pytest.fixture(scope="module")
def model():
    from kvring.engine.run import write_tiny_llama

    root = tempfile.mkdtemp(prefix="kvring-serve-model-")
    try:
        yield str(write_tiny_llama(Path(root) / "tiny-llama"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _stored_keys(etcd: str, cluster: str) -> set[bytes]:
    with ClusterClient(etcd, cluster=cluster) as client:
        return {k for n in client.members for k in client.list_keys(n)}


def _wait_stored(etcd: str, cluster: str, count: int, server: VLLMServer, timeout: float = 20.0) -> None:
    """Saves run in the background after the forward: wait until the cluster holds ``count`` chunk
    parts (one per KV head)."""
    deadline = time.monotonic() + timeout
    while (n := len(_stored_keys(etcd, cluster))) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert n == count, f"the cluster holds {n} chunk parts, expected {count}\n{server.log_tail()}"


def test_second_server_loads_what_the_first_computed(cluster_factory, model):
    rng = np.random.default_rng(7)
    p1 = rng.integers(10, 2000, size=1100).tolist()  # 4 whole chunks + 76 tokens
    p2 = p1[:600] + rng.integers(10, 2000, size=500).tolist()  # shares chunks 0-1 with p1
    prompts = [p1, p2]

    cluster = cluster_factory(nodes=3)
    config = transfer_config(cluster.etcd, cluster.cluster)
    a = VLLMServer(model, config, name="A")
    b = VLLMServer(model, config, name="B")
    try:
        # Both start at once (a start is most of the test's time); B is sent nothing until A is done.
        a.start(wait=False)
        b.start(wait=False)
        a.wait_ready()
        b.wait_ready()

        # A computes both prompts; each is saved (its whole chunks, 2 KV heads each) before the next is sent.
        out_a = []
        for prompt, stored in zip(prompts, (4 * 2, 6 * 2)):
            out_a.append(a.complete(prompt))
            _wait_stored(cluster.etcd, cluster.cluster, stored, a)
        assert all(len(o["tokens"]) == 8 for o in out_a), out_a

        # B loads them: every whole chunk, up to the last block boundary before the last token.
        out_b = [b.complete(p) for p in prompts]
        before = b.metrics()
        # B recomputes them under a salt of its own: nothing to load.
        out_ref = [b.complete(p, cache_salt=f"recompute-{i}") for i, p in enumerate(prompts)]
        after = b.metrics()

        logs = f"\n{a.log_tail(3000)}\n{b.log_tail(3000)}"
        for i in range(len(prompts)):
            assert out_b[i]["tokens"] == out_a[i]["tokens"], f"prompt {i}: B {out_b[i]} != A {out_a[i]}{logs}"
            assert out_b[i]["tokens"] == out_ref[i]["tokens"], f"prompt {i}: B != recompute{logs}"
        expected = min(4 * CHUNK, (len(p1) - 1) // BLOCK * BLOCK)  # 1024
        assert [o["cached"] for o in out_b] == [expected, expected], logs
        assert [o["cached"] for o in out_ref] == [0, 0], logs
        assert after.get(EXTERNAL_HITS) == before.get(EXTERNAL_HITS), (
            f"{EXTERNAL_HITS} rose from {before.get(EXTERNAL_HITS)} to {after.get(EXTERNAL_HITS)} "
            f"during the salted recomputes{logs}")

        # vLLM's own counters of the connector's prefix cache on B: queried all 4 prompts, hit 2.
        hits, queries = after.get(EXTERNAL_HITS), after.get(EXTERNAL_QUERIES)
        assert hits == 2 * expected and queries == 2 * (len(p1) + len(p2)), (
            f"{EXTERNAL_HITS} = {hits}, {EXTERNAL_QUERIES} = {queries}{logs}")

        # vLLM reports where the hits came from: the connector's source (fetched from other machines).
        by_source = re.search(r'vllm:prompt_tokens_cached_by_source_total\{[^}]*source="p2p"[^}]*\} (\S+)',
                              b.metrics_text())
        assert by_source and float(by_source.group(1)) == 2 * expected, logs

        # The connector's own series.
        kvring_series = {k: v for k, v in after.items() if "kvring" in k}
        assert after.get(KVRING_HIT_TOKENS, 0) > 0 and after.get(KVRING_LOOKUPS, 0) > 0, (
            f"B's /metrics lacks the connector's series {KVRING_HIT_TOKENS} > 0 and {KVRING_LOOKUPS} > 0; "
            f"kvring series found: {kvring_series}")
    finally:
        a.terminate()
        b.terminate()
        a.stop()
        b.stop()
