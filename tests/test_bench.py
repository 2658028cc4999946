"""The benchmarks against the real thing: `kvring bench data-plane --quick` and `kvring bench miss
--quick` (a real cluster, real vLLM engines) run, verify and write their outputs; `bench e2e`'s
table and plot carry every load mode.

Timings are not asserted (benchmarks measure, tests check behaviour); the data-plane bench
compares every byte it read with what it wrote and stops on a mismatch.
"""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
from rich.console import Console

from kvring.bench_dataplane import run_data_plane_bench
from kvring.cachenode.hashing import DEFAULT_CHUNK_SIZE
from kvring.bench_e2e import MODES, _plot, _table


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


def _bench_miss_leftovers() -> tuple[set[str], list[int]]:
    """bench miss's temporary directories, and processes running from one (its vLLM instances)."""
    dirs = set(glob.glob(str(Path(tempfile.gettempdir()) / "kvring-bench-miss-*")))
    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any("kvring-bench-miss-" in arg for arg in p.info["cmdline"] or ()):
            procs.append(p.info["pid"])
    return dirs, procs


def test_bench_miss_quick_runs_both_engines_and_writes_json_and_png(tmp_path):
    out, plot = tmp_path / "miss.json", tmp_path / "miss.png"
    dirs_before, _ = _bench_miss_leftovers()
    proc = subprocess.run([sys.executable, "-P", "-m", "kvring.cli", "bench", "miss", "--quick",
                           "--json", str(out), "--plot", str(plot)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kvring bench miss" in proc.stdout and "hook share" in proc.stdout
    r = json.loads(out.read_text())
    assert len(r["runs"]) == r["repetitions"] == 2
    assert r["omp_bind"] == "same" and r["omp_cpus"]  # both engines compute on the same CPUs
    assert [run["first"] for run in r["runs"]] == ["no connector", "kvring"]  # the order alternates
    for run in r["runs"]:
        plain, kv = run["no connector"], run["kvring"]
        assert plain["counters"] is None  # no connector, no kvring counters
        assert plain["seconds"] > 0 and kv["seconds"] > 0 and plain["tokens_per_s"] > 0 and kv["tokens_per_s"] > 0
        c = kv["counters"]
        # Read from vLLM's metrics: one lookup per (new) prompt, every one a miss, chunks saved.  Saves
        # finish in the background: a batch's count may include the end of the batch before it.
        assert c["lookups"] == r["prompts"] and c["hit_tokens"] == 0
        assert c["queried_tokens"] == r["prompts"] * r["tokens"]
        assert 0 < c["saved_chunks"] <= 2 * r["prompts"] * r["tokens"] // DEFAULT_CHUNK_SIZE
        assert 0 < c["scheduler_hook_seconds"] and 0 < kv["hook_share"] < 1
        assert run["throughput_ratio"] > 0
    summ = r["summary"]
    for key in ("tokens_per_s", "seconds"):
        for engine in ("no connector", "kvring"):
            s = summ[engine][key]
            assert s["min"] <= s["median"] <= s["max"]
    assert 0 < summ["kvring"]["hook_share"]["median"] < 1
    assert {"lookups", "lookups_past_deadline", "hook_seconds", "saved_bytes"} <= set(summ["kvring"])
    assert plot.read_bytes()[:4] == b"\x89PNG"
    dirs_after, procs = _bench_miss_leftovers()
    assert dirs_after <= dirs_before and not procs  # nothing left in /tmp or running


def test_bench_e2e_table_and_plot_show_every_load_mode(tmp_path):
    assert MODES == ("layerwise", "bulk", "async")
    load = {"ttft": 0.1, "loaded_tokens": 768, "identical": True, "load_bytes": 9 << 20, "load_seconds": 0.01,
            "load_chunks": 3}
    results = {"model": {"layers": 2, "hidden": 256, "intermediate": 512},
               "rows": [{"tokens": 1024, "recompute_ttft": 1.0, "no_connector_ttft": 1.1, "store_ttft": 1.0,
                         "raw_zmq_seconds": 0.005, **{mode: dict(load) for mode in MODES}}]}
    console = Console(record=True, width=300)
    console.print(_table(results))
    text = console.export_text()
    assert all(f"B {mode}" in text for mode in MODES) and "768|768|768" in text
    _plot(results, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").read_bytes()[:4] == b"\x89PNG"


def test_slow_node_bench_reads_each_prompts_decision_from_the_counters_around_it():
    """The slow-node bench's bookkeeping on a run's output as vllm_run writes it (no engine here:
    the bench itself runs one; this checks which counters and results belong to which prompt)."""
    from kvring.bench_slow_node import SlowNodeSettings, _results

    s = SlowNodeSettings(prompts_per_phase=(1, 3, 1))
    n = 5
    computed = [{"tokens": [i], "ttft": 1.0, "cached": 0} for i in range(n)]
    recomputes = [{"tokens": [i], "ttft": 0.1 + i / 100, "cached": 0} for i in range(n)]
    decided = [("loaded", 896), ("abandoned", 0), ("refused", 0), ("lookup past deadline", 0), ("loaded", 896)]
    runs = [{"tokens": [i], "ttft": 0.05, "cached": cached} for i, (_, cached) in enumerate(decided)]
    counters, c = [], {"hit_tokens": 0, "loads_abandoned": 0, "loads_refused": 0, "lookups_past_deadline": 0}
    counters += [dict(c), dict(c)] + [dict(c) for _ in range(n)]  # warm-up, the batch, the recomputes
    for decision, cached in decided:
        key = {"loaded": "hit_tokens", "abandoned": "loads_abandoned", "refused": "loads_refused",
               "lookup past deadline": "lookups_past_deadline"}[decision]
        c[key] += cached or 1
        if decision == "abandoned":
            c["hit_tokens"] += 896  # an abandoned load was a hit first
        counters.append(dict(c))
    out = {"results": [{"tokens": [], "ttft": 0.1, "cached": 0}] + computed + recomputes + runs,
           "steps": [{"counters": x} for x in counters]}
    r = _results(s, out)
    assert [row["decision"] for row in r["rows"]] == [d for d, _ in decided]
    assert [row["phase"] for row in r["rows"]] == ["healthy", "slowed", "slowed", "slowed", "recovered"]
    assert [row["recompute_ttft"] for row in r["rows"]] == [x["ttft"] for x in recomputes]
    assert r["all_same_tokens"] and r["summary"]["slowed"]["decisions"] == {
        "abandoned": 1, "lookup past deadline": 1, "refused": 1}
