"""`kvring trace`: replay of a real Mooncake trace against a real 3-node cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvring.bench.trace import IdealLRU, prefix_hits, request_keys, run_trace
from kvring.bench.tracefile import TraceRequest

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "conversation_trace.jsonl"


def test_ideal_lru_counts_prefix_hits_only():
    lru = IdealLRU(capacity=4)
    assert lru.request([b"a", b"b", b"c"]) == 0
    assert lru.request([b"a", b"b", b"x"]) == 2
    assert lru.request([b"z", b"a", b"b"]) == 0  # not a prefix hit
    assert prefix_hits([True, True, False, True]) == 2


def test_shared_hash_ids_give_shared_key_prefixes():
    a = request_keys(TraceRequest(timestamp=0, hash_ids=[1, 2, 3], input_length=1536), "ns")
    b = request_keys(TraceRequest(timestamp=0, hash_ids=[1, 2, 9], input_length=1536), "ns")
    assert a[:2] == b[:2] and a[2] != b[2]


@pytest.mark.skipif(not TRACE.exists(), reason="shared/traces is not beside this checkout")
def test_trace_replay_tracks_the_ideal_lru(cluster_factory, tmp_path):
    cluster = cluster_factory(nodes=3, memory=8 << 20)
    out = tmp_path / "trace.json"
    plot = tmp_path / "trace.png"
    r = run_trace(TRACE, nodes=3, memory=8 << 20, etcd=cluster.etcd, cluster=cluster.cluster, limit=600,
                  block_bytes=64 << 10, json_out=out, plot=plot)
    assert r["requests"] == 600 and r["hit_blocks"] > 0
    assert r["capacity_blocks"] < r["distinct_blocks"]  # eviction is exercised
    assert r["ratio_to_ideal"] >= 0.9
    assert r["put_failed"] == 0 and r["get_lost"] == 0 and r["get_corrupt"] == 0
    assert r["bytes_max_mean"] <= 1.2
    assert json.loads(out.read_text())["hit_rate"] == pytest.approx(r["hit_rate"])
    assert plot.read_bytes()[:4] == b"\x89PNG"
