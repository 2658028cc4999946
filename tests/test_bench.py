"""`kvring bench data-plane --quick` against a real cluster: runs, verifies, writes its outputs.

Timings are not asserted (benchmarks measure, tests check behaviour); the bench itself
compares every byte it read with what it wrote and stops on a mismatch.
"""

from __future__ import annotations

import json
import shutil

from kvring.bench_dataplane import run_data_plane_bench


def test_quick_bench_measures_every_case_and_writes_json_and_png(cluster_factory, tmp_path):
    cluster = cluster_factory(nodes=3, memory=512 << 20)
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    r = run_data_plane_bench(etcd=cluster.etcd, cluster=cluster.cluster, iterations=2, json_out=out, plot=plot,
                             quick=True)
    cases = {(row["case"], row["size"]) for row in r["throughput"]}
    for size in ("large", "small"):
        for case in ("PUT", "GET whole", "GET 1 layer", "GET stream"):
            assert (case, size) in cases
    for row in r["throughput"]:
        assert row["kvring_gbps"] > 0 and row["zmq_gbps"] > 0
        if shutil.which("redis-server"):
            assert row["redis_gbps"] > 0
    assert {row["keys"] for row in r["lookup"]} == {32, 128}
    assert all(0 < row["kvring"]["p50"] <= row["kvring"]["p99"] for row in r["lookup"])
    assert json.loads(out.read_text())["throughput"] == r["throughput"]
    assert plot.read_bytes()[:4] == b"\x89PNG"
