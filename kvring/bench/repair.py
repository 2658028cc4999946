"""`kvring bench repair`: how fast a cluster restores its copies after a node comes back empty,
and what that costs the reads it serves meanwhile.

One run: a local etcd and ``nodes`` node processes with ``replication`` 2, filled with
``chunks`` chunks of ``chunk_bytes``.  A reader thread reads random chunks the whole time
(whole GETs of 8; the client checks every layer's checksum, and the reader compares a 5 %
sample byte for byte with what was written).  Each repetition SIGKILLs one node (in turn), restarts it
empty under its id on the same ports, and measures the time from its return until every chunk
has 2 copies again (polled through the nodes' key listings), the bytes the survivors' repair
passes copied (their ``/stats``) and so the rate they moved them at, and the reader's
throughput and p99 latency in the seconds before the kill and while the copies were restored.
Run once per ``--repair-rate`` given (the nodes' rate limit; 0 means none).  Medians and
spread over the repetitions.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvring.bench.report import grouped_bars, write_outputs
from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract
from kvring.common.units import format_size
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

RESTORE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RepairSettings:
    nodes: int = 3
    chunks: int = 1500
    chunk_bytes: int = 256 << 10
    repetitions: int = 3
    rates: tuple[int, ...] = (64 << 20, 0)  # bytes/s per node; 0: no limit


@dataclass
class ReadLog:
    """What the reader saw: (monotonic time, seconds, bytes) per batch, and any wrong byte."""

    samples: list[tuple[float, float, int]] = field(default_factory=list)
    misses: int = 0
    wrong: int = 0
    errors: int = 0

    def window(self, start: float, end: float) -> tuple[float, float]:
        """MiB/s and p99 ms of the batches that ended in ``[start, end)``."""
        got = [(s, b) for t, s, b in self.samples if start <= t < end]
        if not got or end <= start:
            return 0.0, 0.0
        mib_s = sum(b for _, b in got) / (1 << 20) / (end - start)
        p99 = float(np.percentile([s for s, _ in got], 99)) * 1e3
        return mib_s, p99


def _payload(i: int, size: int) -> bytes:
    return np.random.default_rng(i).bytes(size)


def _key(i: int) -> bytes:
    return b"repair-bench-%012d" % i


def _reader(client, s: RepairSettings, log: ReadLog, stop: threading.Event) -> None:
    rng = random.Random(1)
    while not stop.is_set():
        picks = rng.sample(range(s.chunks), 8)
        started = time.perf_counter()
        try:
            chunks = client.get([_key(i) for i in picks])
        except Exception:
            log.errors += 1
            time.sleep(0.05)
            continue
        took = time.perf_counter() - started
        nbytes = 0
        for i, c in zip(picks, chunks):
            if c is None:
                log.misses += 1
            else:
                nbytes += c.data.nbytes
                if rng.random() < 0.05 and bytes(c.data) != _payload(i, s.chunk_bytes):  # a sample, checked whole
                    log.wrong += 1
        log.samples.append((time.monotonic(), took, nbytes))


def _one_rate(s: RepairSettings, rate: int, progress: Progress) -> list[dict]:
    from kvring.cachenode.client import ClusterClient

    memory = max(256 << 20, int(s.chunks * s.chunk_bytes * 2 / s.nodes * 1.6))
    runs = []
    with LocalCluster(nodes=s.nodes, memory=memory, lease_ttl=3, contract=Contract(replication=2),
                      node_args=["--repair-rate", str(rate)]) as cluster, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0, failure_backoff=1.0) as client, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster, timeout=2.0, failure_backoff=1.0) as reading:
        client.wait_for_nodes(s.nodes)
        ids = [n.node_id for n in cluster.nodes]
        task = progress.add_task(f"repair rate {format_size(rate) + '/s' if rate else 'unlimited'}: filling",
                                 total=s.repetitions)
        for start in range(0, s.chunks, 32):
            items = [ChunkItem.of(_key(i), _payload(i, s.chunk_bytes), (1, s.chunk_bytes), "uint8", 256)
                     for i in range(start, min(s.chunks, start + 32))]
            client.put_many(items)
        log, stop = ReadLog(), threading.Event()
        thread = threading.Thread(target=_reader, args=(reading, s, log, stop), daemon=True)
        thread.start()
        try:
            for rep in range(s.repetitions):
                progress.update(task, description=f"repair rate {format_size(rate) + '/s' if rate else 'unlimited'}")
                index = rep % s.nodes
                survivors = [n for n in ids if n != ids[index]]
                stats = client.stats()
                copied_before = sum(stats[n]["repair"]["copied_bytes_total"] for n in survivors)
                time.sleep(2.0)
                killed = time.monotonic()
                cluster.restart_empty(index, timeout=60)
                back = time.monotonic()
                deadline = back + RESTORE_TIMEOUT_S
                while time.monotonic() < deadline:
                    c = client.copies(ids)
                    if len(c) == s.chunks and all(n >= 2 for n in c.values()):
                        break
                    time.sleep(0.1)
                restored = time.monotonic()
                stats = client.stats()
                copied = sum(stats[n]["repair"]["copied_bytes_total"] for n in survivors) - copied_before
                before_mib, before_p99 = log.window(killed - 2.0, killed)
                during_mib, during_p99 = log.window(back, restored)
                runs.append({"rate": rate, "restore_s": restored - back, "restart_s": back - killed,
                             "copied_mib": copied / (1 << 20),
                             "moved_mib_s": copied / (1 << 20) / max(restored - back, 1e-9),
                             "read_mib_s_before": before_mib, "read_p99_ms_before": before_p99,
                             "read_mib_s_during": during_mib, "read_p99_ms_during": during_p99})
                progress.advance(task)
        finally:
            stop.set()
            thread.join(10)
        for run in runs:
            run.update(reader_misses=log.misses, reader_wrong=log.wrong, reader_errors=log.errors)
    return runs


def run_bench_repair(settings: RepairSettings, json_out: Path | None = None, plot: Path | None = None) -> dict:
    console = Console(width=150)
    s = settings
    by_rate: dict[str, list[dict]] = {}
    with run_directory("bench-repair"), Progress(console=console) as progress:
        for rate in s.rates:
            by_rate[format_size(rate) + "/s" if rate else "unlimited"] = _one_rate(s, rate, progress)
    results = {"settings": {"nodes": s.nodes, "chunks": s.chunks, "chunk_bytes": s.chunk_bytes,
                            "replication": 2, "repetitions": s.repetitions, "rates": list(s.rates)},
               "runs": by_rate}
    table = Table(title=f"{s.chunks} chunks of {format_size(s.chunk_bytes)}, replication 2, {s.nodes} nodes: "
                        f"one node SIGKILLed and restarted empty (median of {s.repetitions}, min-max)")
    for col in ("repair rate", "2 copies again (s)", "copied (MiB)", "moved (MiB/s)", "reads before (MiB/s)",
                "reads during (MiB/s)", "read p99 before/during (ms)", "misses / wrong"):
        table.add_column(col, justify="right")

    def cell(runs: list[dict], key: str, fmt: str = "{:.1f}") -> str:
        values = [r[key] for r in runs]
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    for name, runs in by_rate.items():
        p99 = f"{statistics.median(r['read_p99_ms_before'] for r in runs):.1f} / " \
              f"{statistics.median(r['read_p99_ms_during'] for r in runs):.1f}"
        table.add_row(name, cell(runs, "restore_s", "{:.2f}"), cell(runs, "copied_mib", "{:.0f}"),
                      cell(runs, "moved_mib_s"), cell(runs, "read_mib_s_before", "{:.0f}"),
                      cell(runs, "read_mib_s_during", "{:.0f}"), p99,
                      f"{runs[-1]['reader_misses']} / {runs[-1]['reader_wrong']}")
    console.print(table)

    def draw(res: dict, path: Path) -> None:
        names = list(res["runs"])
        grouped_bars(path, names, {
            "restore MiB/s": [statistics.median(r["moved_mib_s"] for r in runs) for runs in res["runs"].values()],
            "reads before MiB/s": [statistics.median(r["read_mib_s_before"] for r in runs)
                                   for runs in res["runs"].values()],
            "reads during MiB/s": [statistics.median(r["read_mib_s_during"] for r in runs)
                                   for runs in res["runs"].values()],
        }, "MiB/s", title="Restoring copies after a node came back empty, while serving reads")
    write_outputs(console, results, json_out, plot, draw)
    return results
