"""Data-plane benchmark: kvring PUT/GET throughput and LOOKUP latency against raw ZMQ and Redis.

Method
    Chunks are real KV-cache chunks of 256 tokens in bf16, layer-major
    ``[layers, K/V, tokens, kv_heads, head_dim]``: "large" is a Llama-3.1-8B chunk (32 MiB,
    1 MiB per layer), "small" a Qwen2.5-0.5B chunk (3 MiB, 128 KiB per layer).  A batch of
    keys (chosen so that their primaries spread evenly over the ring's nodes) holds distinct
    random bytes.  Each case runs ``iterations`` times; the figure is the batch's bytes over the
    median time, in GB/s (1e9 bytes).  Untimed setup (deleting the keys before a PUT, so that
    each PUT really stores) and checks (every GET result compared with the bytes put) happen
    outside the timed region, so no speed is reported for wrong or missing data.

    Cases: PUT through ``put_many``; whole-chunk ``get``; single-layer ``get(layers=(l, l+1))``;
    and ``iter_layers`` whose consumer only touches the zero-copy views (the connector's path).

    Baselines on the same bytes, in the same run: (a) raw ZMQ, a DEALER client and a ROUTER in a
    spawned process over loopback TCP that keeps PUT frames and answers GET with them, zero-copy
    both ways (``copy=False``) -- the local ceiling of the transport, with no checksums, routing or
    store; (b) Redis through redis-py against a throw-away ``redis-server`` (pipelined SET / GET /
    GETRANGE), skipped with a message when no ``redis-server`` is installed.  The ``iter_layers``
    row is compared with the whole-chunk baselines.  LOOKUP latency (p50/p99 of ``lookup`` of 32 and
    128 present keys) is shown next to a raw ZMQ request-reply round trip and pipelined Redis EXISTS.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvring.cachenode.client import ClusterClient
from kvring.local import LocalCluster, free_port

logger = logging.getLogger(__name__)

GB = 1e9
TOKENS = 256


@dataclass(frozen=True)
class ChunkSpec:
    name: str
    model: str
    shape: tuple[int, ...]  # [layers, K/V, tokens, kv_heads, head_dim] of bf16

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 2

    @property
    def layers(self) -> int:
        return self.shape[0]

    @property
    def layer_bytes(self) -> int:
        return self.nbytes // self.layers


SPECS = (ChunkSpec("large", "Llama-3.1-8B", (32, 2, TOKENS, 8, 128)),
         ChunkSpec("small", "Qwen2.5-0.5B", (24, 2, TOKENS, 2, 64)))
CASES = ("PUT", "GET whole", "GET 1 layer", "GET iter_layers")


class BenchError(RuntimeError):
    """A measurement returned wrong data; no figure is reported for it."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise BenchError(f"{what} returned wrong or missing data")


def _same(buf: Any, expected: np.ndarray) -> bool:
    return buf is not None and np.array_equal(np.frombuffer(buf, dtype=np.uint8), expected)


# ---- raw ZMQ baseline ------------------------------------------------------------------------

def _zmq_server(endpoint: str) -> None:
    """Child process: keep PUT payload frames, answer GET with byte ranges of them, zero-copy."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    store: dict[bytes, zmq.Frame] = {}
    while True:
        ident, op, *rest = sock.recv_multipart(copy=False)
        if op.bytes == b"get":
            lo, hi = struct.unpack("<QQ", rest[0].bytes)
            sock.send_multipart([ident, b"ok", *(store[k.bytes].buffer[lo:hi] for k in rest[1:])], copy=False)
            continue
        if op.bytes == b"put":
            store[rest[0].bytes] = rest[1]
        sock.send_multipart([ident, b"ok"])
        if op.bytes == b"stop":
            break
    sock.close(linger=1000)
    ctx.term()


class RawZmq:
    def __init__(self) -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        # A plain child interpreter (not multiprocessing): works whatever the caller's __main__ is.
        self.proc = subprocess.Popen([sys.executable, "-c", f"from {__name__} import _zmq_server; _zmq_server({endpoint!r})"],
                                     start_new_session=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.connect(endpoint)
        self.ping()  # the request waits in the DEALER's queue until the child has bound

    def ping(self) -> None:
        self.sock.send(b"ping")
        self.sock.recv()

    def put_many(self, items: Sequence[tuple[bytes, np.ndarray]]) -> None:
        for key, payload in items:
            self.sock.send_multipart([b"put", key, payload], copy=False)
        for _ in items:
            self.sock.recv()

    def get(self, keys: Sequence[bytes], lo: int, hi: int) -> list[memoryview]:
        self.sock.send_multipart([b"get", struct.pack("<QQ", lo, hi), *keys])
        return [f.buffer for f in self.sock.recv_multipart(copy=False)[1:]]

    def close(self) -> None:
        try:
            self.sock.send(b"stop")
            self.sock.recv()
        except zmq.ZMQError:
            pass
        self.sock.close(linger=0)
        self.ctx.term()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- Redis baseline --------------------------------------------------------------------------

class RedisServer:
    """A throw-away ``redis-server`` on a free loopback port, no persistence."""

    def __init__(self, binary: str) -> None:
        import redis

        self.dir = tempfile.mkdtemp(prefix="kvring-redis-")
        port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--proto-max-bulk-len", "1gb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- measuring -------------------------------------------------------------------------------

class Meter:
    """Runs timed repetitions and advances one progress bar."""

    def __init__(self, progress: Progress, total: int) -> None:
        self.progress = progress
        self.task = progress.add_task("starting", total=total)

    def gbps(self, label: str, n: int, nbytes: int, run: Callable[[], Any],
             check: Callable[[Any], None], setup: Callable[[], None] | None = None) -> float:
        self.progress.update(self.task, description=label)
        times = []
        for i in range(n + 1):  # the first repetition warms up (connections, allocator) untimed
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - t0)
            check(out)
            self.progress.advance(self.task)
        return nbytes / statistics.median(times[1:]) / GB

    def latency_ms(self, label: str, n: int, run: Callable[[], Any], check: Callable[[Any], None]) -> dict[str, float]:
        self.progress.update(self.task, description=label)
        times = []
        for _ in range(n + 1):
            t0 = time.perf_counter()
            out = run()
            times.append((time.perf_counter() - t0) * 1e3)
            check(out)
            self.progress.advance(self.task)
        return {"p50": float(np.percentile(times[1:], 50)), "p99": float(np.percentile(times[1:], 99))}


def _spread_keys(client: ClusterClient, prefix: str, n: int) -> list[bytes]:
    """``n`` keys whose primary owners are spread as evenly as possible over the ring."""
    nodes = client.ring.nodes
    per_node = math.ceil(n / len(nodes))
    counts = dict.fromkeys(nodes, 0)
    keys: list[bytes] = []
    j = 0
    while len(keys) < n:
        key = f"{prefix}{j}".encode()
        j += 1
        owner = client.owners(key)[0]
        if counts[owner] < per_node:
            counts[owner] += 1
            keys.append(key)
    return keys


def _bench_size(spec: ChunkSpec, client: ClusterClient, raw: RawZmq, rds: RedisServer | None, meter: Meter,
                iters: int, batch: int, prefix: str) -> list[dict[str, Any]]:
    rng = np.random.default_rng(len(spec.name))
    keys = _spread_keys(client, f"{prefix}/{spec.name}/", batch)
    payloads = [rng.integers(0, 256, spec.nbytes, dtype=np.uint8) for _ in keys]
    total, lb = spec.nbytes * batch, spec.layer_bytes
    tag = f"[{spec.name}]"
    items = [(k, p, spec.shape, "bfloat16", TOKENS) for k, p in zip(keys, payloads)]
    layer = iter(range(10**9))

    def chunks_ok(what: str, lo: int, hi: int) -> Callable[[Sequence[Any]], None]:
        return lambda got: _check(len(got) == batch and all(_same(g, p[lo:hi]) for g, p in zip(got, payloads)), what)

    def stream() -> tuple[int, list[Any]]:
        found: list[Any] = [None] * batch
        seen = touched = 0
        for lbatch in client.iter_layers(keys, found=found):
            for view in lbatch.views:
                touched ^= view[0]  # touch the bytes, copy nothing
                seen += view.nbytes
        return seen, found

    def one_layer() -> tuple[int, list[Any]]:
        i = next(layer) % spec.layers
        return i, client.get(keys, layers=(i, i + 1))

    def layer_ok(out: tuple[int, list[Any]]) -> None:
        i, got = out
        chunks_ok("kvring single-layer GET", i * lb, (i + 1) * lb)([c and c.data for c in got])

    row: dict[str, dict[str, float | None]] = {c: {"kvring": None, "zmq": None, "redis": None} for c in CASES}
    row["PUT"]["kvring"] = meter.gbps(f"{tag} kvring PUT", iters, total, lambda: client.put_many(items),
                                      lambda stored: _check(all(s >= 1 for s in stored), "kvring PUT"),
                                      setup=lambda: client.delete(keys))
    row["GET whole"]["kvring"] = meter.gbps(f"{tag} kvring GET", iters, total, lambda: client.get(keys),
                                            lambda got: chunks_ok("kvring GET", 0, spec.nbytes)([c and c.data for c in got]))
    row["GET 1 layer"]["kvring"] = meter.gbps(f"{tag} kvring GET 1 layer", iters, batch * lb, one_layer, layer_ok)
    for lbatch in client.iter_layers(keys):  # untimed content check of the streamed views
        for i, view in zip(lbatch.indices, lbatch.views):
            _check(_same(view, payloads[i][lbatch.layer * lb:(lbatch.layer + 1) * lb]), "kvring iter_layers")
    row["GET iter_layers"]["kvring"] = meter.gbps(
        f"{tag} kvring iter_layers", iters, total, stream,
        lambda out: _check(out[0] == total and all(m is not None for m in out[1]), "kvring iter_layers"))

    row["PUT"]["zmq"] = meter.gbps(f"{tag} raw ZMQ PUT", iters, total, lambda: raw.put_many(list(zip(keys, payloads))),
                                   lambda _: None)
    row["GET whole"]["zmq"] = meter.gbps(f"{tag} raw ZMQ GET", iters, total, lambda: raw.get(keys, 0, spec.nbytes),
                                         chunks_ok("raw ZMQ GET", 0, spec.nbytes))
    row["GET 1 layer"]["zmq"] = meter.gbps(f"{tag} raw ZMQ GET 1 layer", iters, batch * lb,
                                           lambda: raw.get(keys, 3 * lb, 4 * lb), chunks_ok("raw ZMQ GET 1 layer", 3 * lb, 4 * lb))
    if rds is not None:
        r = rds.client

        def redis_batch(op: Callable[[Any, bytes, np.ndarray], Any]) -> Callable[[], list[Any]]:
            def run() -> list[Any]:
                pipe = r.pipeline(transaction=False)
                for k, p in zip(keys, payloads):
                    op(pipe, k, p)
                return pipe.execute()
            return run

        row["PUT"]["redis"] = meter.gbps(f"{tag} Redis SET", iters, total,
                                         redis_batch(lambda pipe, k, p: pipe.set(k, memoryview(p))),
                                         lambda out: _check(all(out), "Redis SET"))
        row["GET whole"]["redis"] = meter.gbps(f"{tag} Redis GET", iters, total,
                                               redis_batch(lambda pipe, k, p: pipe.get(k)), chunks_ok("Redis GET", 0, spec.nbytes))
        row["GET 1 layer"]["redis"] = meter.gbps(f"{tag} Redis GETRANGE", iters, batch * lb,
                                                 redis_batch(lambda pipe, k, p: pipe.getrange(k, 3 * lb, 4 * lb - 1)),
                                                 chunks_ok("Redis GETRANGE", 3 * lb, 4 * lb))
    row["GET iter_layers"].update(zmq=row["GET whole"]["zmq"], redis=row["GET whole"]["redis"])
    client.delete(keys)
    if rds is not None:
        rds.client.delete(*keys)
    return [{"case": c, "size": spec.name, "model": spec.model, "shape": list(spec.shape), "batch": batch,
             "bytes": batch * (lb if c == "GET 1 layer" else spec.nbytes),
             **{f"{k}_gbps": v for k, v in row[c].items()}} for c in CASES]


def _bench_lookup(client: ClusterClient, raw: RawZmq, rds: RedisServer | None, meter: Meter, samples: int,
                  sizes: Sequence[int], prefix: str) -> list[dict[str, Any]]:
    keys = _spread_keys(client, f"{prefix}/lookup/", max(sizes))
    tiny = np.zeros(256, dtype=np.uint8)  # presence is metadata only: the chunk size does not matter
    _check(all(s >= 1 for s in client.put_many([(k, tiny, [1, 256], "uint8", TOKENS) for k in keys])), "kvring PUT")
    if rds is not None:
        rds.client.mset({k: b"x" for k in keys})
    out = []
    for n in sizes:
        sub = keys[:n]
        res: dict[str, Any] = {"keys": n}
        res["kvring"] = meter.latency_ms(f"kvring LOOKUP {n} keys", samples, lambda: client.lookup(sub),
                                         lambda hits: _check(all(hits), "kvring LOOKUP"))
        res["zmq_rtt"] = meter.latency_ms("raw ZMQ round trip", samples, raw.ping, lambda _: None)
        if rds is not None:
            def exists() -> list[Any]:
                pipe = rds.client.pipeline(transaction=False)
                for k in sub:
                    pipe.exists(k)
                return pipe.execute()
            res["redis"] = meter.latency_ms(f"Redis EXISTS {n} keys", samples, exists,
                                            lambda hits: _check(all(hits), "Redis EXISTS"))
        out.append(res)
    client.delete(keys)
    return out


# ---- report ----------------------------------------------------------------------------------

def _fmt(x: float | None, suffix: str = "") -> str:
    return "—" if x is None else f"{x:.2f}{suffix}"


def _print_tables(console: Console, results: dict[str, Any]) -> None:
    models = ", ".join(f"{s.name} = {s.model} {s.shape} bf16" for s in SPECS)
    t = Table(title="Throughput, GB/s (median)", caption=f"{models}; iter_layers vs whole-chunk baselines")
    for col in ("case", "size", "batch", "kvring", "raw ZMQ", "Redis", "vs ZMQ", "vs Redis"):
        t.add_column(col, justify="left" if col in ("case", "size", "batch") else "right", no_wrap=True)
    for r in results["throughput"]:
        kv, zq, rd = r["kvring_gbps"], r["zmq_gbps"], r["redis_gbps"]
        per = r["bytes"] / r["batch"] / 2**20
        t.add_row(r["case"], r["size"], f"{r['batch']}×{per:.3g} MiB", _fmt(kv), _fmt(zq),
                  _fmt(rd), _fmt(kv / zq if zq else None, "×"), _fmt(kv / rd if rd else None, "×"))
    console.print(t)
    lt = Table(title="LOOKUP latency, ms", caption="ZMQ: one small request-reply; Redis: pipelined EXISTS")
    for col in ("keys", "kvring p50", "kvring p99", "ZMQ RTT p50", "Redis p50", "Redis p99"):
        lt.add_column(col, justify="right")
    for r in results["lookup"]:
        rd = r.get("redis", {})
        lt.add_row(str(r["keys"]), _fmt(r["kvring"]["p50"]), _fmt(r["kvring"]["p99"]), _fmt(r["zmq_rtt"]["p50"]),
                   _fmt(rd.get("p50")), _fmt(rd.get("p99")))
    console.print(lt)
    if results["redis_skipped"]:
        console.print(f"[yellow]Redis baseline skipped: {results['redis_skipped']}[/]")


def _plot(path: Path, results: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["throughput"]
    fig, (ax, lx) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 1]})
    x = np.arange(len(rows))
    for j, (key, label) in enumerate((("kvring_gbps", "kvring"), ("zmq_gbps", "raw ZMQ"), ("redis_gbps", "Redis"))):
        ax.bar(x + (j - 1) * 0.27, [r[key] or 0.0 for r in rows], 0.27, label=label)
    ax.set_xticks(x, [f"{r['case']}\n{r['size']}" for r in rows], fontsize=8)
    ax.set_ylabel("GB/s (median)")
    ax.set_title("Throughput (iter_layers compared with whole-chunk baselines)")
    ax.legend()
    lk = results["lookup"]
    series = [("kvring", "p50"), ("kvring", "p99"), ("redis", "p50"), ("redis", "p99")]
    series = [s for s in series if all(s[0] in r for r in lk)]
    lxx = np.arange(len(lk))
    for j, (who, p) in enumerate(series):
        lx.bar(lxx + (j - (len(series) - 1) / 2) * 0.2, [r[who][p] for r in lk], 0.2, label=f"{who} {p}")
    lx.set_xticks(lxx, [f"{r['keys']} keys" for r in lk])
    lx.set_ylabel("ms")
    lx.set_title("LOOKUP latency")
    lx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_data_plane_bench(etcd: str | None, cluster: str, iterations: int, json_out: Path | None,
                         plot: Path | None, quick: bool) -> dict[str, Any]:
    """Measure, print the tables, write ``json_out`` / ``plot`` if given; returns the results."""
    console = Console()
    iters = max(1, min(iterations, 3) if quick else iterations)
    batch, samples, sizes = (4, 100, (32, 128)) if quick else (8, 400, (32, 128))
    redis_bin = shutil.which("redis-server")
    redis_skipped = None if redis_bin else "no redis-server on PATH (install redis-server to compare)"
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    local = None if etcd else LocalCluster(nodes=3, memory=2 << 30, cluster=cluster).start()
    client = raw = rds = None
    try:
        client = ClusterClient(etcd or local.etcd, cluster=cluster)
        if not client.wait_for_nodes(len(local.nodes) if local else 1, timeout=15):
            raise BenchError("the cluster has no nodes in its ring")
        raw = RawZmq()
        if redis_bin:
            rds = RedisServer(redis_bin)
        steps = (len(SPECS) * (iters + 1) * (4 + 3 + (3 if rds else 0))
                 + len(sizes) * (samples + 1) * (2 + (1 if rds else 0)))
        columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            meter = Meter(progress, steps)
            throughput = [r for spec in SPECS
                          for r in _bench_size(spec, client, raw, rds, meter, iters, batch, prefix)]
            lookup = _bench_lookup(client, raw, rds, meter, samples, sizes, prefix)
        results = {"config": {"nodes": len(client.ring), "replication": client.contract.replication,
                              "iterations": iters, "batch": batch, "lookup_samples": samples, "quick": quick,
                              "cluster": "local" if local else etcd},
                   "throughput": throughput, "lookup": lookup, "redis_skipped": redis_skipped}
    finally:
        for closable in (rds, raw, client, local):
            if closable is not None:
                closable.close()
    _print_tables(console, results)
    if json_out is not None:
        json_out.write_text(json.dumps(results, indent=2))
        console.print(f"results written to {json_out}")
    if plot is not None:
        _plot(plot, results)
        console.print(f"plot written to {plot}")
    return results
