"""The benchmarks against the real thing: `kvring bench data-plane --quick` and `kvring bench miss
--quick` (real clusters, real peers, real vLLM engines) run, verify and write their outputs;
`bench e2e`'s table and plot carry every load mode.

Timings are not asserted (benchmarks measure, tests check behaviour); the data-plane bench
compares every byte it read with what it wrote and stops on a mismatch (tested by corrupting a
read), and leaves out a peer that cannot run here with the reason (tested by hiding Mooncake).
"""

from __future__ import annotations

import glob
import io
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import psutil
import pytest
from rich.console import Console

from kvring.bench.dataplane import CASES, BenchError, ChunkSpec, DataPlaneSettings, PlainTcp, run_data_plane_bench
from kvring.bench.e2e import BASELINES, MODES, BaselineRun, _baseline_times, _plot, _rows, _table, _time_table
from kvring.bench.tls import paired_ratio
from kvring.common.hashing import DEFAULT_CHUNK_SIZE
from kvring.common.tls import generate


def _leftovers() -> tuple[set[int], set[str]]:
    """This process's children and the benchmarks' temporary directories."""
    tmp = Path(tempfile.gettempdir())
    dirs = {str(p) for pattern in ("kvring-redis-*", "kvring-mooncake-*", "kvring-etcd-*") for p in tmp.glob(pattern)}
    return {p.pid for p in psutil.Process().children(recursive=True)}, dirs


def test_data_plane_quick_measures_every_system_and_case_and_reports_a_missing_peer(monkeypatch, tmp_path):
    """Local 1- and 3-node clusters and every peer; Mooncake made unimportable, as where it is not
    installed: the run goes on without it and says why."""
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    procs_before, dirs_before = _leftovers()
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    console = Console(record=True, width=240)
    r = run_data_plane_bench(DataPlaneSettings.quick_run(), out, plot, console=console)

    expected = {"kvring-1", "kvring-3", "tcp", "zmq"} | ({"redis"} if shutil.which("redis-server") else set())
    assert set(r["systems"]) == expected
    assert "cannot import mooncake.store" in r["skipped"]["mooncake"]
    assert "pip install mooncake-transfer-engine-non-cuda" in r["skipped"]["mooncake"]
    text = console.export_text()
    assert text.count("mooncake: left out") == 1 and "kvring 3 nodes / TCP" in text

    sizes = [c["size"] for c in r["config"]["chunks"]]
    assert sizes == ["4MiB", "384KiB", "32KiB"]  # 32-token chunks of the three models
    assert [(row["size"], row["case"]) for row in r["throughput"]] == [
        (size, case) for size in sizes for case in CASES]
    reps = r["config"]["repetitions"]
    for row in r["throughput"]:
        assert set(row["results"]) == expected and set(row["vs_tcp"]) == {"kvring-1", "kvring-3"}
        for res in row["results"].values():
            assert 0 < res["min"] <= res["gbps"] <= res["max"] and len(res["runs"]) == reps
            assert res["checked"] == reps + 1  # every call's result passed its check, warm-up included
    assert [row["keys"] for row in r["lookup"]] == [32, 128]
    for row in r["lookup"]:
        assert set(row["results"]) == expected
        assert all(0 < res["p50"] <= res["p99"] for res in row["results"].values())
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert plot.read_bytes()[:4] == b"\x89PNG"
    procs_after, dirs_after = _leftovers()
    assert procs_after <= procs_before and dirs_after <= dirs_before  # every server stopped, nothing left


def test_data_plane_tcp_baseline_returns_exactly_the_bytes_put():
    spec = ChunkSpec("test", "test", (4, 2, 8, 1, 16))  # 4 layers of 512 bytes
    payloads = [np.random.default_rng(i).integers(0, 256, spec.nbytes, dtype=np.uint8) for i in range(3)]
    keys = [b"a", b"bb", b"ccc"]
    tcp = PlainTcp()
    try:
        tcp.attach(spec, payloads)
        assert tcp.put(keys, payloads, spec)
        whole = tcp.get(keys, spec, None)
        assert [bytes(g) for g in whole] == [p.tobytes() for p in payloads]
        tcp.scrub()  # the reused receive buffer is overwritten: what was read before is gone
        assert bytes(whole[0]) == bytes(spec.nbytes)
        layer = tcp.get([keys[2], b"missing"], spec, (1, 2))
        assert bytes(layer[0]) == payloads[2][512:1024].tobytes() and layer[1] is None
        stream = tcp.stream(keys, spec)
        assert [[bytes(v) for v in by_key] for by_key in stream] == [
            [p[i * 512:(i + 1) * 512].tobytes() for p in payloads] for i in range(4)]
        assert tcp.exists([b"a", b"missing", b"ccc"]) == [True, False, True]
        tcp.clear([b"a"])
        assert tcp.exists(keys) == [False, True, True]
    finally:
        tcp.close()
    assert tcp.proc.poll() is not None


class _CutMidReply(PlainTcp):
    """The bare TLS loop, whose stream is cut after its first layer's reply, as a signal
    unwinding a run cuts it: the rest of the reply is still on its way."""

    def _slices(self, offset):
        if offset:
            raise KeyboardInterrupt
        return super()._slices(offset)


def test_a_baseline_cut_mid_reply_closes_at_once(tmp_path):
    """A bare-loop client stopped mid-reply (SIGHUP during `kvring bench tls`) used to send its
    server a stop request on the half-read connection and wait up to its 60 s timeout for an
    answer that never came; now it closes at once and its server is gone."""
    spec = ChunkSpec("test", "test", (4, 2, 8, 1, 4096))  # 4 layers of 128 KiB
    payloads = [np.random.default_rng(i).integers(0, 256, spec.nbytes, dtype=np.uint8) for i in range(4)]
    keys = [b"k%d" % i for i in range(4)]
    tcp = _CutMidReply(tls=generate(tmp_path / "tls", "bench-tls"))
    try:
        tcp.attach(spec, payloads)
        assert tcp.put(keys, payloads, spec) and not tcp.in_flight
        with pytest.raises(KeyboardInterrupt):
            tcp.stream(keys, spec)
        assert tcp.in_flight
    finally:
        t0 = time.monotonic()
        tcp.close()
        closed_in = time.monotonic() - t0
    assert tcp.proc.poll() is not None and closed_in < 10


def test_data_plane_stops_on_wrong_bytes(cluster_factory, monkeypatch, tmp_path):
    cluster = cluster_factory(nodes=1, memory=64 << 20)
    real_get = PlainTcp.get

    def flip_a_byte(self, keys, spec, layers):
        got = real_get(self, keys, spec, layers)
        bad = bytearray(got[0])
        bad[-1] ^= 0xFF
        return [bytes(bad), *got[1:]]

    monkeypatch.setattr(PlainTcp, "get", flip_a_byte)
    settings = DataPlaneSettings.quick_run(etcd=cluster.etcd, cluster=cluster.cluster, peers=("tcp",))
    with pytest.raises(BenchError, match="plain TCP GET whole 4MiB: wrong or missing data"):
        run_data_plane_bench(settings, tmp_path / "bench.json", console=Console(file=io.StringIO()))
    assert not (tmp_path / "bench.json").exists()  # no figures for wrong data


def test_data_plane_includes_mooncake_where_it_is_installed(cluster_factory, tmp_path):
    pytest.importorskip("mooncake.store", reason="Mooncake is optional: pip install mooncake-transfer-engine-non-cuda")
    cluster = cluster_factory(nodes=1, memory=64 << 20)
    settings = DataPlaneSettings.quick_run(etcd=cluster.etcd, cluster=cluster.cluster, peers=("tcp", "mooncake"),
                                           lookup_samples=5)
    r = run_data_plane_bench(settings, console=Console(file=io.StringIO()))
    assert r["skipped"] == {} and set(r["systems"]) == {"kvring-1", "tcp", "mooncake"}
    for row in r["throughput"]:
        assert row["results"]["mooncake"]["checked"] == settings.repetitions + 1
    assert all(row["results"]["mooncake"]["p50"] > 0 for row in r["lookup"])
    assert not list(Path(tempfile.gettempdir()).glob("kvring-mooncake-*"))


@pytest.mark.parametrize("bad, message", [
    ({"nodes": (0, 3)}, "distinct node counts of at least 1"),
    ({"nodes": (3, 3)}, "distinct node counts of at least 1"),
    ({"peers": ("tcp", "memcached")}, "unknown peers ['memcached']"),
    ({"batch": 0}, "batch must be at least 1"),
    ({"lookup_keys": ()}, "lookup_keys"),
])
def test_data_plane_settings_name_what_to_fix(bad, message):
    with pytest.raises(ValueError) as exc:
        DataPlaneSettings(**bad)
    assert message in str(exc.value)


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
        # Read from vLLM's metrics: one lookup per (new) prompt, every one a miss, chunks saved (one
        # part per KV head).  Saves finish in the background: a batch's count may include the end
        # of the batch before it.
        assert c["lookups"] == r["prompts"] and c["hit_tokens"] == 0
        assert c["queried_tokens"] == r["prompts"] * r["tokens"]
        assert 0 < c["saved_parts"] <= 2 * r["prompts"] * r["tokens"] // DEFAULT_CHUNK_SIZE * r["model"]["kv_heads"]
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
    load = {"ttft": 0.1, "loaded_tokens": 768, "identical": True, "load_bytes": 10 ** 7, "load_seconds": 0.01,
            "load_chunks": 3, "thread_cpu_seconds": 0.006, "thread_runqueue_seconds": 0.001}
    results = {"model": {"layers": 2, "hidden": 256, "intermediate": 512}, "tls": True,
               "rows": [{"tokens": 1024, "recompute_ttft": 1.0, "no_connector_ttft": 1.1, "store_ttft": 1.0,
                         "raw_zmq_seconds": 0.005, "bare_tls_seconds": 0.02, "bare_tls_nodes_seconds": 0.01,
                         "bare_tls_cpu_seconds": 0.012,
                         **{mode: dict(load) for mode in MODES}}]}
    results["rows"][0]["async"].update(thread_cpu_seconds=None, thread_runqueue_seconds=None)  # not Linux
    results["rows"][0]["bulk"]["load_seconds_each"] = [0.04, 0.01, 0.005, 0.02]  # 0.5, 2, 4 and 1x the bare loop
    console = Console(record=True, width=300)
    console.print(_table(results))
    text = console.export_text()
    assert all(f"B {mode}" in text for mode in MODES) and "768|768|768" in text
    assert "mutual TLS" in text and "bare TLS GB/s 1|3 servers" in text
    assert "0.50|1.00" in text  # 10 MB in 20 ms from one server, in 10 ms from three
    assert "load / bare TLS" in text and "2.00|2.00|2.00" in text  # each mode's 10 ms load against 20 ms
    # Where the load's 10 ms went: 6 on a CPU (0.60 ns a byte), 1 runnable, 3 blocked; the bare
    # client spent 12 ms of CPU (1.20 ns a byte) in its 20.
    console = Console(record=True, width=300)
    console.print(_time_table(results))
    rows = [line.split("│")[1:-1] for line in console.export_text().splitlines() if line.count("│") > 2]
    cells = {r[1].strip(): [c.strip() for c in r] for r in rows if r[1].strip() in MODES}
    # Each load over the bare loop's median: one load (2x) where only the median was recorded;
    # bulk's four loads, 0.5-4x, as their median and inclusive quartiles.
    for mode, spread in (("layerwise", "2.00 (2.00-2.00)"), ("bulk", "1.50 (0.88-2.50)")):
        assert cells[mode][2:] == ["0.010 s", "0.006 s", "0.001 s", "0.003 s", "0.60", "0.020 s | 1.20", spread]
    assert cells["async"][2:] == ["0.010 s", "-", "-", "-", "-", "0.020 s | 1.20", "2.00 (2.00-2.00)"]
    _plot(results, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_e2e_rows_take_each_prompts_repetitions_and_baselines_from_what_the_run_recorded():
    """``_rows`` (what ``bench e2e`` makes of its instances' outputs, load statistics and baseline
    samples; a full run needs vLLM instances for minutes): each prompt's own repetitions in
    each mode, medians of their times, the recompute it compares tokens with, and each
    baseline's median; loads of one prompt that moved different bytes stop the bench."""
    sizes, reps = (1024, 2048), 3

    def result(ttft: float, cached: int, tokens: list[int]) -> dict:
        return {"ttft": ttft, "cached": cached, "tokens": tokens}

    recompute = [[1, 2], [3, 4]]  # each prompt's greedy tokens when recomputed
    runs = {"store": {"results": [result(9.0, 0, [])] + [result(2.0 + i, 0, recompute[i]) for i in range(2)]},
            "plain": {"results": [result(9.0, 0, [])] + [result(1.5 + i, 0, recompute[i]) for i in range(2)]}}
    stats = {}
    for m, mode in enumerate(MODES):
        # warm-up, then repetition r of prompt i at 1 + r * 2 + i; the layerwise instance then recomputes
        results = [result(9.0, 0, [])] + [result(0.1 * (r + 1) + i + m, 768 * (i + 1), recompute[i])
                                          for r in range(reps) for i in range(2)]
        if mode == "layerwise":
            results += [result(5.0 + i, 0, recompute[i]) for i in range(2)]
        runs[mode] = {"results": results}
        stats[mode] = [{"bytes": 1000 * (i + 1), "chunks": 3 * (i + 1), "seconds": 0.01 * (r + 1) + i,
                        "landed_bytes": 1000 * (i + 1), "thread_cpu_seconds": None if mode == "async" else 0.005 * (r + 1),
                        "thread_runqueue_seconds": None if mode == "async" else 0.001}
                       for r in range(reps) for i in range(2)]
    runs["bulk"]["results"][1 + 2 * 2 + 1]["tokens"] = [3, 5]  # bulk's last repetition of prompt 1 drifted
    samples = [{"bare_tls": [BaselineRun(0.02 * (i + 1) + k, 0.01 + k) for k in (0, 1, 2)],
                "plain_tcp": [BaselineRun(0.01 * (i + 1), None)]} for i in range(2)]
    rows = _rows(sizes, reps, runs, stats, samples)

    assert [r["tokens"] for r in rows] == [1024, 2048]
    assert [r["recompute_ttft"] for r in rows] == [5.0, 6.0] and [r["store_ttft"] for r in rows] == [2.0, 3.0]
    assert [r["no_connector_ttft"] for r in rows] == [1.5, 2.5]
    for i, row in enumerate(rows):
        for m, mode in enumerate(MODES):
            load = row[mode]
            assert load["ttfts"] == pytest.approx([0.1 * (r + 1) + i + m for r in range(reps)])
            assert load["ttft"] == pytest.approx(0.2 + i + m) and load["loaded_tokens"] == 768 * (i + 1)
            assert load["identical"] is not (mode == "bulk" and i == 1)
            assert load["load_bytes"] == 1000 * (i + 1) and load["load_chunks"] == 3 * (i + 1)
            assert load["load_seconds_each"] == pytest.approx([0.01 * (r + 1) + i for r in range(reps)])
            assert load["load_seconds"] == pytest.approx(0.02 + i)
            assert load["thread_cpu_seconds"] == (None if mode == "async" else pytest.approx(0.01))
        assert row["bare_tls_seconds"] == pytest.approx(0.02 * (i + 1) + 1) and row["bare_tls_samples"] == 3
        assert row["bare_tls_cpu_seconds"] == pytest.approx(1.01)
        assert row["plain_tcp_seconds"] == pytest.approx(0.01 * (i + 1)) and row["plain_tcp_cpu_seconds"] is None
    results = {"model": {"layers": 2, "hidden": 256, "intermediate": 512}, "tls": True, "rows": rows}
    for table in (_table(results), _time_table(results)):  # both tables take the rows as they are
        Console(record=True, width=300).print(table)

    stats["bulk"][2]["bytes"] += 1  # a repetition of prompt 0 moved another byte count
    with pytest.raises(BenchError, match="bulk: the loads of the 1024-token prompt moved different byte counts"):
        _rows(sizes, reps, runs, stats, samples)


def test_bench_e2e_bare_tls_baseline_streams_every_byte_from_one_server_and_from_three(tmp_path):
    """The bare TLS loop from three servers at once streams each server's share of the chunks,
    and all of them; one from which a server's share never came back is an error, not a figure."""
    credentials = generate(tmp_path / "tls", "bench-e2e")
    for servers in (1, 3):
        runs = _baseline_times(partial(BASELINES["bare_tls"], credentials), 96 << 10, 7, 6, repeats=2,
                               servers=servers)
        # Each stream's wall seconds, and its reading threads' CPU seconds (decrypting takes some).
        assert len(runs) == 2 and all(0 < x.cpu_seconds and 0 < x.seconds for x in runs)
    with pytest.raises(BenchError, match="streamed"):
        _baseline_times(partial(_Short, tls=credentials), 96 << 10, 7, 6, repeats=1, servers=3)


class _Short(PlainTcp):
    """The bare TLS loop, but a stream that leaves out its last layer."""

    def stream(self, keys, spec):
        return super().stream(keys, spec)[:-1]


def test_bench_reads_loads_every_byte_into_the_cache_on_every_read_path_and_reports_them(tmp_path):
    """A real run (3 TLS nodes, the bare TLS loop from 1 and 3 servers): every system's rounds,
    GB/s, CPU per byte and paired ratios in the JSON and a plot; the cache is checked byte for
    byte after every kvring round (received into it, or copied), and a wrong byte there stops
    the bench."""
    from kvring.bench.reads import SYSTEMS, ReadsSettings, _PagedCache, run_bench_reads

    s = ReadsSettings(tokens=512, repetitions=2)
    out = run_bench_reads(s, json_out=tmp_path / "reads.json", plot=tmp_path / "reads.png")
    assert json.loads((tmp_path / "reads.json").read_text())["gbps"].keys() == set(SYSTEMS)
    assert all(len(out["gbps"][n]) == 2 and all(g > 0 for g in out["gbps"][n]) for n in SYSTEMS)
    assert all(len(out["cpu_ns_per_byte"][n]) == 2 for n in SYSTEMS)
    assert set(out["ratios"]) == {"kvring-1", "kvring-n", "kvring-copy"} and (tmp_path / "reads.png").stat().st_size > 0
    assert out["settings"]["bytes"] == 512 * 4 * 256 * 4 * 6  # tokens, heads, channels, float32, layers
    # Received straight into the cache on the caller's thread; copied from buffers on the others.
    assert out["landed_share"] == {"kvring-1": 1.0, "kvring-n": 0.0, "kvring-copy": 0.0}

    cache = _PagedCache(s)
    parts = [np.random.default_rng(i).standard_normal((s.layers, s.chunk, s.channels), dtype=np.float32)
             for i in range(s.chunks * s.heads)]
    for i, part in enumerate(parts):  # what a load writes: each part's layers at its chunk's blocks and head
        for layer in range(s.layers):
            cache.copies.load(cache.heads[layer][i % s.heads], cache.runs[i // s.heads], part[layer].tobytes(), 0)
    cache.check(parts)  # right: passes, and clears the cache
    with pytest.raises(BenchError, match="does not hold the stored bytes"):
        cache.check(parts)


def test_bench_tls_ratios_pair_each_round_with_itself():
    """A ratio of medians pairs one system's fast rounds with the other's slow ones (here 1.8 over
    1.0); the ratios of the rounds themselves are 0.9, 1.8, 1.8, 0.9 and 0.9: median 0.9."""
    tls, bare = [0.9, 1.8, 1.8, 1.8, 1.8], [1.0, 1.0, 1.0, 2.0, 2.0]
    assert paired_ratio(tls, bare) == {"median": 0.9, "min": 0.9, "max": 1.8}
    with pytest.raises(ValueError):
        paired_ratio(tls, bare[:-1])  # rounds are pairs: one left over is a bug, not a figure


def test_slow_node_bench_reads_each_prompts_decision_from_the_counters_around_it():
    """The slow-node bench's bookkeeping on a run's output as vllm_run writes it (no engine here:
    the bench itself runs one; this checks which counters and results belong to which prompt)."""
    from kvring.bench.slow_node import SlowNodeSettings, _results

    s = SlowNodeSettings(prompts_per_phase=(1, 3, 1))
    n = 5
    computed = [{"tokens": [i], "ttft": 1.0, "cached": 0} for i in range(n)]
    recomputes = [{"tokens": [i], "ttft": 0.1 + i / 100, "cached": 0} for i in range(n)]
    decided = [("loaded", 896), ("abandoned", 0), ("refused (node_failing)", 0), ("lookup past deadline", 0),
               ("loaded", 896)]
    runs = [{"tokens": [i], "ttft": 0.05, "cached": cached} for i, (_, cached) in enumerate(decided)]
    counters, c = [], {"hit_tokens": 0, "loads_abandoned": 0, "loads_refused": 0, "loads_refused:node_failing": 0,
                       "lookups_past_deadline": 0}
    counters += [dict(c), dict(c)] + [dict(c) for _ in range(n)]  # warm-up, the batch, the recomputes
    for decision, cached in decided:
        key = {"loaded": "hit_tokens", "abandoned": "loads_abandoned", "refused (node_failing)": "loads_refused",
               "lookup past deadline": "lookups_past_deadline"}[decision]
        c[key] += cached or 1
        if decision.startswith("refused"):
            c["loads_refused:node_failing"] += 1  # the reason's own series (connector_counters)
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
        "abandoned": 1, "lookup past deadline": 1, "refused (node_failing)": 1}


def test_bench_e2e_tp_sums_its_workers_loads_and_shows_both_tp_sizes(tmp_path):
    """Each TP worker appends its own line per load: a load is all workers' bytes over the slowest
    worker's time."""
    import json

    from kvring.bench.e2e_tp import _loads, _plain_tcp_gbps
    from kvring.bench.e2e_tp import _plot as tp_plot
    from kvring.bench.e2e_tp import _table as tp_table

    stats = tmp_path / "loads.jsonl"
    lines = [{"heads": [0, 1], "layers": [0, 6], "bytes": 100, "parts": 8, "seconds": 0.2, "failed_blocks": 0},
             {"heads": [2, 3], "layers": [0, 6], "bytes": 100, "parts": 8, "seconds": 0.3, "failed_blocks": 2},
             {"heads": [0, 1], "layers": [0, 6], "bytes": 50, "parts": 4, "seconds": 0.1, "failed_blocks": 0},
             {"heads": [2, 3], "layers": [0, 6], "bytes": 50, "parts": 4, "seconds": 0.05, "failed_blocks": 0}]
    stats.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _loads(stats) == [{"bytes": 200, "parts": 16, "seconds": 0.3, "workers": 2, "failed_blocks": 2},
                             {"bytes": 100, "parts": 8, "seconds": 0.1, "workers": 2, "failed_blocks": 0}]
    spread = {"median": 0.05, "min": 0.04, "max": 0.07}
    entry = {"recompute_ttft": 0.5, "loaded_tokens": 896, "identical": True, "ttft": spread,
             "gbps": {"median": 0.67, "min": 0.5, "max": 0.7}, "plain_tcp_gbps": {"median": 2, "min": 1, "max": 3}}
    results = {"tp": 2, "model": {"layers": 6, "hidden": 1024, "kv_heads": 4, "dtype": "float32"},
               "rows": [{"tokens": 1024, "stored_bytes": {"1": 12 << 20, "2": 12 << 20}, "1": dict(entry),
                         "2": dict(entry)}]}
    console = Console(record=True, width=300)
    console.print(tp_table(results))
    text = console.export_text()
    assert "stored by TP 2" in text and text.count("12.0 MiB") == 4 and text.count("896") == 2
    assert text.count("0.050 (0.040-0.070) s") == 2 and text.count("0.67 (0.50-0.70)") == 2 and "10.0x" in text
    tp_plot(results, tmp_path / "tp.png")
    assert (tmp_path / "tp.png").read_bytes()[:4] == b"\x89PNG"
    # The plain TCP ceiling beside each load: one worker's share of its parts, over a real socket.
    part = 6 * 2 * 8192  # 6 layers of 16 KiB
    assert 0 < _plain_tcp_gbps({"bytes": 8 * part, "parts": 8, "workers": 2}, 6) < 1000


@pytest.mark.timeout(800)  # eight vLLM engine starts
def test_bench_shapes_stores_and_loads_a_llama_an_mla_model_a_hybrid_and_one_with_state(tmp_path):
    """One run of `kvring bench shapes` on small models: each shape's stored bytes per token is
    what its KV layout says (MLA: one 576-value latent per token and layer, below the Llama's
    K and V of 4 heads of 128; the hybrid stores what the Llama does; the model with recurrent
    state its attention layers' KV and one state), and B's load of each equals its recompute."""
    out, plot = tmp_path / "shapes.json", tmp_path / "shapes.png"
    before = set(glob.glob(str(Path(tempfile.gettempdir()) / "kvring-bench-shapes-*")))
    proc = subprocess.run([sys.executable, "-P", "-m", "kvring.cli", "bench", "shapes", "--tokens", "600",
                           "--repetitions", "1", "--hidden", "256", "--memory", "256MiB", "--json", str(out),
                           "--plot", str(plot)], capture_output=True, text=True, timeout=760)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kvring bench shapes" in proc.stdout
    r = json.loads(out.read_text())
    shapes = r["shapes"]
    assert list(shapes) == ["llama", "mla", "hybrid", "recurrent"]
    layers, floats = r["model"]["layers"], 4
    assert (shapes["mla"]["latent"], shapes["mla"]["kv_heads"], shapes["mla"]["head_size"]) == (True, 1, 576)
    assert shapes["hybrid"]["windows"] == [512] * 5 + [0] and shapes["llama"]["windows"] == []
    per_token = {name: s["rows"][0]["stored_bytes_per_token"] for name, s in shapes.items()}
    assert per_token["llama"] == layers * 4 * 2 * 128 * floats
    assert per_token["mla"] == layers * 576 * floats < per_token["llama"]
    assert per_token["hybrid"] == per_token["llama"]
    # Qwen3-Next: 3 gated-delta-net layers, each state a conv state of 3 x 512 bfloat16 and a
    # recurrent one of 4 x 64 x 64 float32, and 3 full-attention layers of 2 KV heads of 64 (bfloat16).
    assert shapes["recurrent"]["windows"] == [-1, 0] * (layers // 2)
    state = 3 * 512 * 2 + 4 * 64 * 64 * 4
    stored = {name: 512 * per_token[name] for name in ("llama", "mla", "hybrid")}
    stored["recurrent"] = 512 * (layers // 2) * 2 * 2 * 64 * 2 + (layers // 2) * state
    for name, s in shapes.items():
        (row,) = s["rows"]
        assert row["whole_chunk_tokens"] == 512 and row["stored_bytes"] == stored[name], name
        assert row["loaded_tokens"] > 0 and row["identical"], (name, row["repetitions"])
        # A load fetches every part of the prompt (the hybrid's window, 512, covers its 2 chunks).
        assert row["fetched_bytes"]["median"] == row["stored_bytes"], name
        for rep in row["repetitions"]:
            assert rep["recompute_cached"] == 0 and rep["loaded_tokens"] > 0 and rep["identical"], name
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert set(glob.glob(str(Path(tempfile.gettempdir()) / "kvring-bench-shapes-*"))) <= before  # nothing left


def _bench_disk_leftovers() -> tuple[set[str], list[int]]:
    """bench disk's temporary directories, and processes running from one (its nodes, etcd, vLLM)."""
    dirs = set(glob.glob(str(Path(tempfile.gettempdir()) / "kvring-bench-disk-*")))
    procs = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
             if any("kvring-bench-disk-" in arg for arg in p.info["cmdline"] or ())]
    return dirs, procs


def _conversation_trace(path: Path, requests: int, sessions: int = 60, seed: int = 1) -> Path:
    """A Mooncake-format trace of conversations (each turn's prompt is the session's last prompt
    plus two new 512-token blocks), so that a turn hits if its session's blocks are still held:
    what the shared traces look like, written here so the test needs no file beside the checkout."""
    rng = random.Random(seed)
    history: list[list[int]] = [[] for _ in range(sessions)]
    next_id = 0
    with open(path, "w") as f:
        for i in range(requests):
            ids = history[rng.randrange(sessions)]
            ids += [next_id, next_id + 1]
            next_id += 2
            f.write(json.dumps({"timestamp": i * 10, "input_length": len(ids) * 512, "output_length": 16,
                                "hash_ids": list(ids)}) + "\n")
    return path


def test_bench_disk_measures_the_tier_the_restarts_and_the_trace_and_writes_json_and_png(tmp_path):
    """`kvring bench disk` without its vLLM part, at small sizes: every GET of a tier round is read
    from disk (none skipped by the disk), each cold restart finds every chunk written, the disk
    raises the trace's hit rate at the same memory, and nothing is left behind."""
    out, plot = tmp_path / "disk.json", tmp_path / "disk.png"
    trace = _conversation_trace(tmp_path / "trace.jsonl", requests=600)
    dirs_before, _ = _bench_disk_leftovers()
    proc = subprocess.run([sys.executable, "-P", "-m", "kvring.cli", "bench", "disk",
                           "--parts", "throughput,rebuild,trace", "--repetitions", "2", "--tier-bytes", "64MiB",
                           "--chunk-bytes", "1MiB", "--max-chunks", "20000", "--restarts", "2", "--limit", "600",
                           "--trace", str(trace), "--memory", "8MiB", "--small-disk", "24MiB", "--json", str(out),
                           "--plot", str(plot)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for title in ("disk tier vs the device", "warm restart", "trace replay"):
        assert title in proc.stdout
    r = json.loads(out.read_text())
    t = r["throughput"]
    assert set(t["gbps"]) == {"device write", "device read", "PUT", "PUT to disk", "GET from disk"}
    for name, s in t["gbps"].items():
        assert 0 < s["min"] <= s["median"] <= s["max"] and len(t["runs"][name]) == 2, name
    assert t["chunks_per_round"] == 64 and t["chunks_read_from_disk"] == [64, 64] and t["write_skipped"] == [0, 0]
    assert isinstance(t["direct_io"], bool)
    assert [row["chunks"] for row in r["rebuild"]] == [10_000, 20_000]  # 10k, 100k, 1M capped at 20k
    for row in r["rebuild"]:
        assert len(row["runs"]) == 2 and all(run["chunks"] == row["chunks"] for run in row["runs"])
        assert 0 < row["rebuild_s"]["median"] and row["ready_s"]["median"] <= row["first_hit_s"]["median"]
    tr = r["trace"]
    memory, disk = tr["systems"]["memory only"], tr["systems"]["large disk"]
    fifo, second = tr["systems"]["small disk, fifo"], tr["systems"]["small disk, second chance"]
    assert tr["requests"] == 600 and memory["memory_capacity_blocks"] == disk["memory_capacity_blocks"]
    assert memory["disk_chunks"] == 0 and disk["disk_chunks"] > 0 and disk["disk_reads"] > 0
    assert disk["hit_rate"] > memory["hit_rate"]  # memory alone misses what the disk keeps
    assert disk["hit_rate"] <= tr["compulsory_bound_hit_rate"]
    assert (fifo["disk_per_node"], fifo["eviction"], second["eviction"]) == (24 << 20, "fifo", "second-chance")
    assert fifo["disk_evicted"] > 0 and fifo["disk_carried"] == 0 and second["disk_carried"] > 0
    assert memory["ideal_lru_hit_rate"] <= fifo["ideal_lru_hit_rate"] <= disk["ideal_lru_hit_rate"]
    # The replay's LOOKUPs lease what they find, as the connector's do: a chunk found on disk is
    # read ahead and held for its GET, even where its segment is evicted first (a disk that cycles
    # every few requests): nothing a LOOKUP found is lost, and nothing comes back wrong.
    for name, x in tr["systems"].items():
        assert x["get_corrupt"] == x["put_failed"] == x["get_lost"] == 0, (name, x)
    assert fifo["prefetched"] > 0 and second["prefetched"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    dirs_after, procs = _bench_disk_leftovers()
    assert dirs_after <= dirs_before and not procs  # nothing left in /tmp or running


def test_bench_disk_ttft_loads_from_disk_after_every_node_restarted(tmp_path):
    """The vLLM part on a tiny model (two engine starts: some 75 s on a 2-core machine, over this
    file's budget for a smoke test, kept because nothing else runs vLLM against nodes serving from
    disk): after the restarts the nodes' memory is empty, B loads the whole prompt from disk and its
    greedy tokens equal the recompute's."""
    from kvring.bench.disk import DiskBenchSettings, run_bench_disk

    out, plot = tmp_path / "ttft.json", tmp_path / "ttft.png"
    console = Console(record=True, width=200)
    r = run_bench_disk(DiskBenchSettings(parts=("ttft",), tokens=600, model_layers=2, hidden=256,
                                         ttft_memory=256 << 20, ttft_disk=256 << 20, ttft_repetitions=1),
                       out, plot, console=console)
    x = r["ttft"]
    (rd,) = x["rounds"]
    assert x["chunks_in_memory_after_restart"] == [0]
    assert rd["memory"]["loaded_tokens"] == rd["disk"]["loaded_tokens"] == 512  # the prompt's 2 whole chunks
    assert rd["recompute"]["loaded_tokens"] == 0
    assert x["chunks_read_from_disk"]["disk"][0] > 0
    assert all(x["identical"].values()) and all(v["identical"] for v in rd.values())
    assert "time to first token of B" in console.export_text()
    assert json.loads(out.read_text())["ttft"]["identical"] == x["identical"]
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("bad, message", [
    ({"parts": ("throughput", "speed")}, "parts must be some of"),
    ({"parts": ("throughput",), "tier_bytes": 32 << 20}, "--tier-bytes must be at least 4 times"),
    ({"parts": ("trace",), "trace": None}, "pass --trace FILE"),
])
def test_bench_disk_settings_name_what_to_fix(bad, message):
    from kvring.bench.disk import DiskBenchSettings

    with pytest.raises(ValueError, match=message):
        DiskBenchSettings(**bad)
