"""`kvring bench membership`: what following the membership costs etcd, per idle client.

One run: a local etcd of its own and ``nodes`` node processes.  First the nodes alone stay idle
for ``window`` seconds (their leases, their drain-key reads, their handoff clients: the
baseline); then ``clients`` ``ClusterClient``s (each with its own etcd connection, in this
process) start, and stay idle as long.  etcd's own counters (``grpc_server_msg_received_total``
on its ``/metrics``: every message a client sends, a unary request or a message on a stream,
by gRPC method) are read at the start and end of each window; the clients' share is the
second window's rate minus the baseline's, divided by ``clients``.  Last, one node joins and
the time until every client's ring has it is measured (the delay a change takes to reach the
clients).  Repeated ``repetitions`` times (the windows alternate); medians and spread reported.
"""

from __future__ import annotations

import re
import statistics
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvring.bench.report import grouped_bars, write_outputs
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

_RECEIVED = re.compile(r'^grpc_server_msg_received_total\{[^}]*grpc_method="([^"]+)"[^}]*\} ([0-9.e+]+)$', re.M)


@dataclass(frozen=True)
class MembershipSettings:
    clients: int = 50
    nodes: int = 20
    window: float = 20.0  # seconds each idle window lasts
    repetitions: int = 3


def etcd_messages(endpoint: str) -> Counter:
    """Messages etcd has received so far, by gRPC method (its Prometheus counters)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as r:
        text = r.read().decode()
    got: Counter = Counter()
    for method, value in _RECEIVED.findall(text):
        got[method] += float(value)
    return got


def _rate(endpoint: str, window: float) -> Counter:
    before = etcd_messages(endpoint)
    time.sleep(window)
    after = etcd_messages(endpoint)
    return Counter({m: (after[m] - before[m]) / window for m in after if after[m] != before[m]})


def run_bench_membership(settings: MembershipSettings, json_out: Path | None = None,
                         plot: Path | None = None) -> dict:
    from kvring.cachenode.client import ClusterClient

    console = Console()
    s = settings
    baseline: list[Counter] = []
    with_clients: list[Counter] = []
    join_s: list[float] = []
    with run_directory("bench-membership"), LocalCluster(nodes=s.nodes, memory=64 << 20, lease_ttl=10) as cluster, \
            Progress(console=console) as progress:
        task = progress.add_task(f"{s.nodes} nodes, {s.clients} clients", total=s.repetitions * 2)
        for _ in range(s.repetitions):
            baseline.append(_rate(cluster.etcd, s.window))
            progress.advance(task)
            clients = [ClusterClient(cluster.etcd, cluster=cluster.cluster) for _ in range(s.clients)]
            try:
                for c in clients:
                    c.wait_for_nodes(s.nodes, timeout=30)
                time.sleep(1.0)  # let their start-up reads pass
                with_clients.append(_rate(cluster.etcd, s.window))
                progress.advance(task)
                joined = cluster.add_node()  # returns once the node has registered
                started = time.monotonic()
                for c in clients:
                    c.wait_for_nodes(s.nodes + 1, timeout=30)
                join_s.append(time.monotonic() - started)
                joined.stop()
                cluster.nodes.remove(joined)
                for c in clients:
                    c.wait_for_nodes(s.nodes, timeout=30, exact=True)
            finally:
                for c in clients:
                    c.close()
    methods = sorted({m for c in baseline + with_clients for m in c})
    per_client = {m: [(w[m] - b[m]) / s.clients for w, b in zip(with_clients, baseline)] for m in methods}
    totals = [sum(w.values()) - sum(b.values()) for w, b in zip(with_clients, baseline)]
    results = {
        "settings": {"clients": s.clients, "nodes": s.nodes, "window_s": s.window, "repetitions": s.repetitions},
        "baseline_msgs_per_s": [sum(b.values()) for b in baseline],
        "with_clients_msgs_per_s": [sum(w.values()) for w in with_clients],
        "per_client_msgs_per_s": [t / s.clients for t in totals],
        "per_client_by_method": per_client,
        "join_seen_by_all_s": join_s,
    }
    table = Table(title=f"etcd messages per second: {s.nodes} nodes, {s.clients} idle clients "
                        f"(median of {s.repetitions} windows of {s.window:.0f}s, min-max)")
    for col in ("", "median", "min-max"):
        table.add_column(col, justify="right" if col else "left")

    def row(name: str, values: list[float], fmt: str = "{:.3f}") -> None:
        table.add_row(name, fmt.format(statistics.median(values)),
                      f"{fmt.format(min(values))}-{fmt.format(max(values))}")

    row("nodes alone (all)", results["baseline_msgs_per_s"], "{:.1f}")
    row("nodes + clients (all)", results["with_clients_msgs_per_s"], "{:.1f}")
    row("per idle client", results["per_client_msgs_per_s"])
    for m in methods:
        row(f"  per client: {m}", per_client[m])
    row("a join seen by every client (s)", join_s)
    console.print(table)

    def draw(res: dict, path: Path) -> None:
        names = list(res["per_client_by_method"]) or ["(none)"]
        values = [statistics.median(v) for v in res["per_client_by_method"].values()] or [0.0]
        grouped_bars(path, names, {"per idle client": values}, "etcd messages / s",
                     title=f"etcd load per idle client ({s.nodes} nodes, {s.clients} clients)")
    write_outputs(console, results, json_out, plot, draw)
    return results
