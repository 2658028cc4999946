"""`kvring bench disk`: what the node's disk tier does, measured with real nodes and real files.

Four parts, in one run, everything under the run's temporary directory (removed at the end,
also on Ctrl-C), which is also where the disk directories live:

1. ``throughput`` (``disk_io.py``): the tier's PUT and GET-from-disk GB/s through a node whose
   memory is small, beside the device's own sequential write and read speed (direct I/O, a
   file in the same filesystem), device and tier rounds interleaved; medians and spread.
2. ``rebuild`` (``disk_restart.py``): index rebuild and spawn-to-READY-to-first-hit of a node
   restarted cold on 10k, 100k and 1M chunks (small ones, so that 1M fits and fills quickly).
3. ``trace`` (``disk_trace.py``): a trace replay's hit rate with memory only and with memory +
   disk, at the same memory per node: a small disk evicting first in, first out and with second
   chances, and a large disk.
4. ``ttft`` (``disk_ttft.py``): the demo's set-up with real vLLM engines: B's time to first token
   when its chunks come from disk (every node restarted), from memory, and recomputed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvring.bench.report import machine, spread, summary, write_outputs
from kvring.common.units import format_size
from kvring.local.cluster import LocalCluster, LocalEtcd
from kvring.local.rundir import run_directory

PARTS = ("throughput", "rebuild", "trace", "ttft")
REBUILD_SIZES = (10_000, 100_000, 1_000_000)
_CHECKOUT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"


def default_trace() -> Path | None:
    """The Mooncake conversation trace beside this checkout (``shared/traces``), if it is there."""
    return _CHECKOUT_TRACE if _CHECKOUT_TRACE.exists() else None


@dataclass(frozen=True)
class DiskBenchSettings:
    parts: tuple[str, ...] = PARTS
    # throughput
    repetitions: int = 5
    device_bytes: int = 1 << 30
    tier_bytes: int = 1 << 30
    chunk_bytes: int = 4 << 20
    layers: int = 32
    batch: int = 8  # chunks per PUT and per GET
    # rebuild
    rebuild_sizes: tuple[int, ...] = REBUILD_SIZES
    max_chunks: int | None = None
    rebuild_payload: int = 1024
    restarts: int = 3
    # trace
    trace: Path | None = field(default_factory=default_trace)
    trace_limit: int | None = 2000
    trace_memory: int = 16 << 20
    trace_small_disk: int = 128 << 20  # per node: smaller than the default replay's blocks (eviction matters)
    trace_disk: int = 1 << 30
    trace_block_bytes: int = 64 << 10
    # ttft
    tokens: int = 4096
    model_layers: int = 6
    hidden: int = 1024
    ttft_memory: int = 2 << 30
    ttft_disk: int = 2 << 30
    ttft_repetitions: int = 3

    def __post_init__(self) -> None:
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown or not self.parts:
            raise ValueError(f"parts must be some of {', '.join(PARTS)}, got {', '.join(self.parts) or 'none'}")
        if self.chunk_bytes % self.layers or self.chunk_bytes < self.layers:
            raise ValueError(f"--chunk-bytes must be a multiple of {self.layers} layers")
        if "throughput" in self.parts and self.tier_bytes < 4 * self.node_memory:
            raise ValueError(f"--tier-bytes must be at least 4 times the node's memory ({self.node_memory >> 20} MiB "
                             "with these chunks), so that the GETs find the chunks on disk only")
        if self.rebuild_payload % 4 or self.rebuild_payload < 16:
            raise ValueError("the rebuild's payload must be a multiple of 4 bytes, at least 16")
        if "trace" in self.parts and self.trace is None:
            raise ValueError("no trace found beside this checkout (shared/traces/conversation_trace.jsonl): pass "
                             "--trace FILE, or leave the trace part out with --parts")
        if self.tokens < 300:
            raise ValueError("--tokens must be at least 300 (one whole chunk and more)")

    @property
    def chunk_counts(self) -> list[int]:
        cap = self.max_chunks or max(self.rebuild_sizes)
        return sorted({min(n, cap) for n in self.rebuild_sizes})

    @property
    def node_memory(self) -> int:
        """The tier node's memory: two batches of chunks (a GET's promotions fit), at least 16 MiB."""
        return max(16 << 20, 2 * self.batch * self.chunk_bytes)

    @property
    def tier_chunks(self) -> int:
        return self.tier_bytes // self.chunk_bytes


def filesystem_of(path: Path) -> dict[str, str]:
    """The device and type of the filesystem ``path`` is on (from /proc/self/mountinfo)."""
    dev = os.stat(path).st_dev
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                fields = line.split()
                if fields[2] == wanted:
                    after = fields[fields.index("-") + 1:]
                    return {"device": after[1], "type": after[0], "mount": fields[4]}
    except (OSError, ValueError, IndexError):
        pass
    return {"device": "unknown", "type": "unknown", "mount": "?"}


def _describe(fs: dict[str, str]) -> str:
    name = os.path.basename(fs["device"])
    kind = " (a virtio virtual disk)" if name.startswith("vd") else ""
    return f"{fs['device']}{kind}, {fs['type']}"


class _Bar:
    """One progress bar over the whole run, a task per step."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task = None

    def step(self, description: str, total: int | None = None) -> Callable[[int], None]:
        """Close the step before (its bar full) and start one; returns its ``advance``."""
        if self.task is not None:
            done = self.progress.tasks[self.task].total or 1
            self.progress.update(self.task, total=done, completed=done)
        self.task = task = self.progress.add_task(description, total=total)
        return lambda n: self.progress.advance(task, n)


def _throughput(etcd: str, tmp: Path, s: DiskBenchSettings, bar: _Bar) -> dict:
    from kvring.bench.disk_io import device_round, tier_round
    from kvring.cachenode.client import ClusterClient

    root = tmp / "throughput"
    capacity = max(3 * s.tier_chunks * s.chunk_bytes, 256 << 20)
    queue = s.tier_chunks * s.chunk_bytes + (64 << 20)
    runs: dict[str, list[float]] = {k: [] for k in ("device write", "device read", "PUT", "PUT to disk",
                                                     "GET from disk")}
    direct, from_disk, skipped = [], [], []
    with LocalCluster(nodes=1, memory=s.node_memory, etcd=etcd, cluster="bench-disk-throughput", disk=capacity,
                      disk_root=str(root), node_args=["--disk-write-queue", str(queue)]) as cluster, \
            ClusterClient(etcd, cluster="bench-disk-throughput", timeout=30.0) as client:
        if not client.wait_for_nodes(1, timeout=20):
            raise RuntimeError("the node did not join the ring")
        client.reserve_buffers(min(256 << 20, s.batch * s.chunk_bytes))
        node = cluster.nodes[0]
        advance = bar.step(f"device and tier, interleaved: {s.repetitions} rounds of {format_size(s.tier_bytes)}",
                           2 * s.repetitions)
        for rep in range(s.repetitions):
            order = ("device", "tier") if rep % 2 == 0 else ("tier", "device")
            for what in order:
                if what == "device":
                    d = device_round(root, s.device_bytes)
                    runs["device write"].append(d.write_gbps)
                    runs["device read"].append(d.read_gbps)
                    direct.append(d.direct)
                else:
                    t = tier_round(client, node.node_id, node.disk_dir, f"tier-{rep}", s.tier_chunks, s.chunk_bytes,
                                   s.layers, s.batch)
                    runs["PUT"].append(t.put_gbps)
                    runs["PUT to disk"].append(t.put_disk_gbps)
                    runs["GET from disk"].append(t.get_gbps)
                    from_disk.append(t.from_disk)
                    skipped.append(t.write_skipped)
                advance(1)
    shutil.rmtree(root, ignore_errors=True)  # gigabytes of segments: gone before the next part
    return {"gbps": {k: summary(v) for k, v in runs.items()}, "runs": runs, "direct_io": all(direct),
            "chunks_per_round": s.tier_chunks, "chunks_read_from_disk": from_disk, "write_skipped": skipped,
            "node_memory": s.node_memory}


def _rebuild(etcd: str, tmp: Path, s: DiskBenchSettings, bar: _Bar) -> list[dict]:
    from kvring.bench.disk_restart import measure

    rows = []
    for n in s.chunk_counts:
        rounds = measure(etcd, tmp / f"rebuild-{n}", n, s.rebuild_payload, s.restarts, s.node_memory,
                         lambda desc, total: bar.step(desc, total))
        rows.append({"chunks": n, "payload_bytes": s.rebuild_payload, "segments": rounds[0].segments,
                     "rebuild_s": summary([r.rebuild_s for r in rounds]),
                     "ready_s": summary([r.ready_s for r in rounds]),
                     "first_hit_s": summary([r.first_hit_s for r in rounds]),
                     "runs": [asdict(r) for r in rounds]})
    return rows


def run_bench_disk(settings: DiskBenchSettings, json_out: Path | None = None, plot: Path | None = None,
                   console: Console | None = None) -> dict:
    s = settings
    console = console or Console(width=None if Console().is_terminal else 160)
    results: dict = {"machine": machine(), "settings": {k: (str(v) if isinstance(v, Path) else v)
                                                        for k, v in asdict(s).items()}}
    with run_directory("bench-disk") as tmp, \
            Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     console=console) as progress:
        bar = _Bar(progress)
        results["filesystem"] = filesystem_of(tmp)
        etcd = None
        try:
            if {"throughput", "rebuild", "trace"} & set(s.parts):
                bar.step("starting etcd")
                etcd = LocalEtcd().start()
            if "throughput" in s.parts:
                results["throughput"] = _throughput(etcd.endpoint, tmp, s, bar)
            if "rebuild" in s.parts:
                results["rebuild"] = _rebuild(etcd.endpoint, tmp, s, bar)
            if "trace" in s.parts:
                from kvring.bench.disk_trace import replay_all, trace_clusters

                bar.step("trace replays")
                results["trace"] = replay_all(etcd.endpoint, s.trace, s.trace_limit, s.trace_memory,
                                              trace_clusters(s.trace_small_disk, s.trace_disk), s.trace_block_bytes,
                                              console)
        finally:
            if etcd is not None:
                etcd.close()
        if "ttft" in s.parts:
            from kvring.bench.disk_ttft import measure_ttft

            results["ttft"] = measure_ttft(tmp, s.tokens, s.model_layers, s.hidden, s.ttft_memory, s.ttft_disk,
                                           s.ttft_repetitions, lambda desc: bar.step(desc))
        bar.step("done", 1)(1)
    for table in tables(results):
        console.print(table)
    write_outputs(console, results, json_out, plot, _plot)
    return results


def tables(r: dict) -> list[Table]:
    out = []
    fs = _describe(r["filesystem"])
    if "throughput" in r:
        t = r["throughput"]
        g = t["gbps"]
        how = "O_DIRECT" if t["direct_io"] else "buffered + fdatasync + FADV_DONTNEED (O_DIRECT refused)"
        reps = len(t["runs"]["PUT"])
        table = Table(title=f"disk tier vs the device: GB/s, median of {reps} interleaved rounds (min-max)",
                      caption=f"on {r['machine']}; disk {fs}.  Tier: 1 node, {format_size(t['node_memory'])} memory, "
                              f"{t['chunks_per_round']} chunks of {format_size(r['settings']['chunk_bytes'])} a "
                              f"round; GET from disk: {min(t['chunks_read_from_disk'])}-"
                              f"{max(t['chunks_read_from_disk'])} chunks read from disk a round, page cache dropped "
                              f"first; write-skipped {sum(t['write_skipped'])}")
        for col in ("what", "how", "GB/s", "of the device"):
            table.add_column(col, justify="left" if col in ("what", "how") else "right")
        table.add_row("device sequential write", how, spread(g["device write"], ".2f"), "")
        table.add_row("device sequential read", how, spread(g["device read"], ".2f"), "")
        for op, how_tier, ref in (("PUT", "acknowledged (memory, queued for the disk)", "device write"),
                                  ("PUT to disk", "until written and fdatasync'ed", "device write"),
                                  ("GET from disk", "read, checksummed, promoted", "device read")):
            table.add_row(f"tier {op}", how_tier, spread(g[op], ".2f"),
                          f"{g[op]['median'] / g[ref]['median']:.0%}")
        out.append(table)
    if "rebuild" in r:
        payload = r["rebuild"][0]["payload_bytes"] if r["rebuild"] else 0
        reps = len(r["rebuild"][0]["runs"]) if r["rebuild"] else 0
        table = Table(title=f"warm restart: index rebuild and restart to first hit, median of {reps} cold restarts "
                            "(min-max), seconds",
                      caption=f"chunks of {payload} B payload (small, so 1M fits this disk and fills in a minute); "
                              f"segment files dropped from the page cache before each start; disk {fs}")
        for col in ("chunks", "segments", "rebuild (node's /stats)", "spawn -> READY", "spawn -> first hit"):
            table.add_column(col, justify="right")
        for row in r["rebuild"]:
            table.add_row(f"{row['chunks']:,}", str(row["segments"]), spread(row["rebuild_s"], ".3f"),
                          spread(row["ready_s"], ".2f"), spread(row["first_hit_s"], ".2f"))
        out.append(table)
    if "trace" in r:
        tr = r["trace"]
        table = Table(title=f"trace replay ({Path(tr['trace']).name}, {tr['requests']:,} requests): hit rate at "
                            f"{format_size(tr['memory_per_node'])} memory per node",
                      caption=f"3 nodes; blocks of {format_size(tr['block_bytes'])}; {tr['distinct_blocks']:,} distinct "
                              f"of {tr['blocks_requested']:,} blocks requested; ideal LRU: one LRU of the cluster's "
                              f"memory, or disk (which holds what memory does), in blocks; bound: every repeated "
                              f"block hits = {tr['compulsory_bound_hit_rate']:.3f}")
        for col in ("cluster", "disk per node", "hit rate", "ideal LRU, same size", "chunks on disk", "read from disk",
                    "carried forward", "lost / corrupt reads", "failed puts", "replay"):
            table.add_column(col, justify="right")
        for name, x in tr["systems"].items():
            table.add_row(name, format_size(x["disk_per_node"]) if x["disk_per_node"] else "-", f"{x['hit_rate']:.3f}",
                          f"{x['ideal_lru_hit_rate']:.3f}", f"{x['disk_chunks']:,}", f"{x['disk_reads']:,}",
                          f"{x['disk_carried']:,}", f"{x['get_lost']} / {x['get_corrupt']}", str(x["put_failed"]),
                          f"{x['wall_s']:.1f} s")
        out.append(table)
    if "ttft" in r:
        x = r["ttft"]
        table = Table(title=f"time to first token of B, {x['tokens']} tokens, {x['layers']}-layer hidden-{x['hidden']} "
                            f"Llama ({x['dtype']}) on CPU, 3 nodes with a disk tier: median of {x['repetitions']} "
                            "rounds (min-max)",
                      caption=f"from disk: every node restarted (SIGTERM: memory empty, disk kept; "
                              f"{'/'.join(map(str, x['chunks_in_memory_after_restart']))} chunks in memory after the "
                              "restarts), segment files dropped from the page cache; same tokens: "
                              f"{x['max_tokens']} greedy tokens vs the recompute's, every round")
        for col in ("B from", "TTFT", "recompute / B", "loaded tokens", "chunks read from disk",
                    "same tokens as recompute"):
            table.add_column(col, justify="right")
        rec = x["recompute_ttft"]["median"]
        for what in ("memory", "disk"):
            t = x[f"{what}_ttft"]
            table.add_row(what, spread(t, ".3f") + " s", f"{rec / t['median']:.1f}x",
                          "/".join(str(rd[what]["loaded_tokens"]) for rd in x["rounds"]),
                          "/".join(map(str, x["chunks_read_from_disk"][what])),
                          "yes" if x["identical"][f"B from {what}"] else "NO")
        table.add_row("recompute", spread(x["recompute_ttft"], ".3f") + " s", "", "0", "", "")
        table.add_row("(A: compute + save)", f"{x['a_ttft']:.3f} s", "", "0", "",
                      "yes" if x["identical"]["A"] else "NO")
        out.append(table)
    return out


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in PARTS if p in r]
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 4.2), squeeze=False)
    for ax, part in zip(axes[0], parts):
        if part == "throughput":
            g = r["throughput"]["gbps"]
            names = list(g)
            med = [g[n]["median"] for n in names]
            err = [[m - g[n]["min"] for n, m in zip(names, med)], [g[n]["max"] - m for n, m in zip(names, med)]]
            ax.bar(range(len(names)), med, yerr=err, capsize=3,
                   color=["tab:gray", "tab:gray", "tab:blue", "tab:blue", "tab:orange"])
            ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
            ax.set(ylabel="GB/s", title="disk tier vs device (median, min-max)")
        elif part == "rebuild":
            rows = r["rebuild"]
            x = [row["chunks"] for row in rows]
            for key, label in (("rebuild_s", "index rebuild"), ("ready_s", "spawn -> READY"),
                               ("first_hit_s", "spawn -> first hit")):
                ax.plot(x, [row[key]["median"] for row in rows], "o-", label=label)
            ax.set(xscale="log", xlabel="chunks on disk", ylabel="seconds", title="warm restart (cold page cache)")
            ax.legend()
        elif part == "trace":
            systems = r["trace"]["systems"]
            names = list(systems)
            labels = [n.replace(", ", ",\n") for n in names]
            ax.bar(labels, [systems[n]["hit_rate"] for n in names], color="tab:orange", label="kvring")
            ax.plot(labels, [systems[n]["ideal_lru_hit_rate"] for n in names], "o", c="tab:blue",
                    label="ideal LRU, same size")
            ax.axhline(r["trace"]["compulsory_bound_hit_rate"], ls="--", c="k", label="every repeat hits")
            ax.tick_params(axis="x", labelsize=7)
            ax.set(ylabel="block hit rate", title=f"trace replay, {format_size(r['trace']['memory_per_node'])} "
                                                  "memory per node")
            ax.legend(fontsize=8)
        else:
            x = r["ttft"]
            names = ["recompute", "B from memory", "B from disk"]
            stats = [x["recompute_ttft"], x["memory_ttft"], x["disk_ttft"]]
            med = [t["median"] for t in stats]
            ax.bar(names, med, yerr=[[m - t["min"] for m, t in zip(med, stats)], [t["max"] - m for m, t in zip(med, stats)]],
                   capsize=3, color=["tab:gray", "tab:blue", "tab:orange"])
            ax.set(ylabel="time to first token (s)", title=f"vLLM (CPU), {x['tokens']} tokens")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"kvring bench disk: {r['machine']}; {_describe(r['filesystem'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
