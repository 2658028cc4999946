"""`kvring bench e2e`: time to first token, loaded from a kvring cluster vs recomputed.

One run, one local 3-node cluster, five separate vLLM instances (each its own process, as
separate pods would be) on a random Llama big enough for prefill to matter on a CPU (by
default 6 layers, hidden 1024, GQA 8/4 heads of 128, MLP 11008: 12 KiB of KV per token):

- ``store``: computes each prompt once and saves its chunks (the first instance's cost);
- ``layerwise``, ``bulk`` and ``async``: a second instance in each load mode gets the same
  prompts ``repetitions`` times over and loads them every time (vLLM's own prefix caching off,
  so every hit comes from kvring; the figures are medians, with their range in the JSON); the
  ``async`` instance loads between steps while the request waits (its TTFT includes that
  wait); the layerwise instance then prefills each prompt again under a ``cache_salt`` of its
  own (nothing can load): the recompute baseline in the very same engine, which the speed-ups
  are against;
- ``no connector``: an instance without kvring prefills each prompt from scratch (shown too).

Every instance first runs a short warm-up prompt, so no figure includes engine start-up or
first-call compilation.  The connector appends per-step load statistics to a file
(``stats_path``); the bench turns them into the achieved load bandwidth and measures raw ZMQ, a
plain TCP socket (the loopback ceiling) and the bare TLS loop moving the same bytes, in the same
chunk sizes, layer by layer, over loopback: two rounds of each right after each load mode's
instance, so their medians interleave with kvring's loads (this machine's noise lands on both).
The bare TLS loop is measured from one server (one stream at the cipher's limit) and from as
many servers as the cluster has nodes, each read by a thread of its own: on a machine whose
cores the nodes share with vLLM, the latter is what the same bytes cost from three senders.

A second table says where each load's time went on the thread that loads (``ThreadClock``: on a
CPU, runnable without one, blocked on the nodes or a lock), with its CPU per byte beside the bare
TLS client's (1 server) for the same bytes: which part of a gap is kvring's own work and which is
the machine's cores being busy elsewhere; and each load's bandwidth over the bare TLS loop's median,
as the median and quartiles of the loads (how far a mode's ratio spreads on a noisy machine).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvring.bench.dataplane import ChunkSpec, PlainTcp, RawZmq
from kvring.bench.report import grouped_bars, quartile_spread, write_outputs
from kvring.bench.system import BenchError, Sharded
from kvring.common.tls import generate
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

MODES = ("layerwise", "bulk", "async")
NODES = 3  # cache nodes in the bench's cluster
REPETITIONS = 5  # loads of each prompt per load mode, by default


def _prompts(sizes: Sequence[int], seed: int = 7) -> list[list[int]]:
    """One random prompt per size; different first tokens, so no two share a chunk."""
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 30000, size=n).tolist() for n in sizes]


def _warmup(instance: str) -> dict:
    """A short first prompt; its own salt, so it neither loads nor leaves anything for others."""
    return {"tokens": list(range(100, 356)), "salt": f"warm-up-{instance}"}


BASELINES = {"raw_zmq": lambda credentials: RawZmq(), "plain_tcp": lambda credentials: PlainTcp(),
             "bare_tls": lambda credentials: PlainTcp(tls=credentials)}


class BaselineRun(NamedTuple):
    """One stream of a baseline: its wall seconds, and its reading threads' seconds on a CPU
    (``None`` where the kernel does not say)."""

    seconds: float
    cpu_seconds: float | None


def _baseline_times(make: Callable[[], RawZmq | PlainTcp], chunk_bytes: int, chunks: int, layers: int,
                    repeats: int = 2, servers: int = 1) -> list[BaselineRun]:
    """A baseline (raw ZMQ, plain TCP, the bare TLS loop) streaming ``chunks`` chunks of
    ``chunk_bytes``, layer by layer, ``repeats`` times; from ``servers`` servers at once, each
    holding every ``servers``-th chunk (as a cluster's nodes share a prompt's chunks) and read by
    a thread of its own (``Sharded``)."""
    spec = ChunkSpec("e2e", "bench", (layers, chunk_bytes // layers // 2))
    payloads = [np.random.default_rng(i).integers(0, 255, size=chunk_bytes, dtype=np.uint8) for i in range(chunks)]
    runs = []
    with Sharded(make, servers, spec, payloads, b"e2e-") as sharded:
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = sharded.stream()
            runs.append(BaselineRun(time.perf_counter() - t0, sharded.cpu_seconds))
            if got != chunk_bytes * chunks:
                raise BenchError(f"a baseline streamed {got} bytes of {chunk_bytes * chunks}")
    return runs


def _sample_baselines(samples: list[dict[str, list[BaselineRun]]], loads: list[dict], layers: int,
                      credentials, nodes: int) -> None:
    """One round of every baseline on the bytes of each prompt's load (``loads``, in prompt order),
    taken right after an instance ran: the baselines' samples interleave with kvring's loads.  The
    bare TLS loop runs twice: from one server (one stream at the cipher's limit) and from as many
    servers as the cluster has nodes (``bare_tls_nodes``: the same bytes, as many senders
    sharing this machine's cores as kvring's loads have)."""
    for per_prompt, load in zip(samples, loads):
        if load and load["bytes"]:
            chunk_bytes = load["bytes"] // load["chunks"]
            for name, make in BASELINES.items():
                per_prompt.setdefault(name, []).extend(
                    _baseline_times(partial(make, credentials), chunk_bytes, load["chunks"], layers))
            per_prompt.setdefault("bare_tls_nodes", []).extend(
                _baseline_times(partial(BASELINES["bare_tls"], credentials), chunk_bytes, load["chunks"], layers,
                                servers=nodes))


def run_bench_e2e(sizes: Sequence[int] = (1024, 4096, 8192), layers: int = 6, hidden: int = 1024,
                  intermediate: int = 11008, memory: int = 2 << 30, json_out: Path | None = None, plot: Path | None = None,
                  tls: bool = True, dtype: str = "bfloat16", repetitions: int = REPETITIONS) -> dict:
    """Time to first token loaded vs recomputed (see the README); ``tls``: the data plane as
    `kvring up` runs it (mutual TLS), or plain TCP; ``dtype``: the model's and its KV cache's;
    ``repetitions``: loads of each prompt per load mode (a load is a fraction of a second, and
    this machine's noise is a quarter of one)."""
    from kvring.engine.run import run_instance, write_tiny_llama

    console = Console(width=None if Console().is_terminal else 200)  # the table is 12 columns wide
    prompts = _prompts(sizes)
    max_len = max(8192, max(sizes) + 64)
    steps = ["model", "cluster", "store", *MODES, "no connector"]
    # The model, the instances' logs and every file vLLM and torch write: removed however the run ends.
    with run_directory("bench-e2e") as tmp, \
            Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                     TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("writing a random Llama (no download)", total=len(steps))
        model = str(write_tiny_llama(tmp / "model", layers=layers, hidden=hidden, heads=8, kv_heads=4,
                                     vocab=32000, head_dim=128, intermediate=intermediate))
        bar.advance(task)
        bar.update(task, description="starting etcd and 3 cache nodes")
        runs: dict[str, dict] = {}
        stats: dict[str, list[dict]] = {}
        credentials = generate(tmp / "bare-tls", "bench-e2e")
        samples: list[dict[str, list[BaselineRun]]] = [{} for _ in sizes]  # per prompt: baseline -> its runs
        with LocalCluster(nodes=NODES, memory=memory, cluster="bench-e2e", tls=tls) as cluster:
            bar.advance(task)
            base = {"model": model, "dtype": dtype, "max_tokens": 1, "max_model_len": max_len}
            for name in ("store", *MODES):
                bar.update(task, description=f"vLLM instance '{name}'")
                stats_path = tmp / f"{name}.loads.jsonl"
                conn = cluster.connector(stats_path=str(stats_path), load_mode="layerwise" if name == "store" else name)
                rounds = 1 if name == "store" else repetitions
                items = [_warmup(name), *({"tokens": p} for _ in range(rounds) for p in prompts)]
                if name == "layerwise":
                    items += [{"tokens": p, "salt": f"recompute-{i}"} for i, p in enumerate(prompts)]
                runs[name] = run_instance(tmp, name, {**base, "connector": conn, "prompts": items})
                stats[name] = [json.loads(line) for line in stats_path.read_text().splitlines()] \
                    if stats_path.exists() else []
                if name in MODES and len(stats[name]) != repetitions * len(sizes):
                    raise BenchError(f"the {name} instance recorded {len(stats[name])} loads, expected "
                                     f"{repetitions * len(sizes)} (one per prompt and repetition)")
                if name in MODES:
                    bar.update(task, description="raw ZMQ, plain TCP and the bare TLS loop, the same bytes")
                    _sample_baselines(samples, stats[name][:len(sizes)], layers, credentials, NODES)
                bar.advance(task)
        bar.update(task, description="vLLM instance without a connector")
        runs["plain"] = run_instance(tmp, "plain", {**base, "prompts": [_warmup("plain"),
                                                                        *({"tokens": p} for p in prompts)]})
        bar.advance(task)

        rows = _rows(sizes, repetitions, runs, stats, samples)

    results = {"model": {"layers": layers, "hidden": hidden, "intermediate": intermediate, "heads": 8,
                         "kv_heads": 4, "head_dim": 128, "dtype": dtype}, "tls": tls, "repetitions": repetitions,
               "rows": rows}
    console.print(_table(results))
    console.print(_time_table(results))
    write_outputs(console, results, json_out, plot, _plot)
    return results


def _rows(sizes: Sequence[int], repetitions: int, runs: dict[str, dict], stats: dict[str, list[dict]],
          samples: list[dict[str, list[BaselineRun]]]) -> list[dict]:
    """One row per prompt size: its recompute, store and no-connector times, each mode's loads
    (medians over ``repetitions``) and each baseline's samples.  ``runs``: each instance's
    ``run_instance`` output (a warm-up, then the prompts in order, repetition after
    repetition; the layerwise instance then recomputes each prompt under a salt); ``stats``: each
    mode's load statistics, one line per load in the same order; ``samples``: per prompt, each
    baseline's runs."""
    rows = []
    for i, n in enumerate(sizes):
        recompute = runs["layerwise"]["results"][1 + repetitions * len(sizes) + i]
        row = {"tokens": n, "recompute_ttft": recompute["ttft"], "recomputed_tokens": recompute["cached"],
               "no_connector_ttft": runs["plain"]["results"][i + 1]["ttft"],
               "store_ttft": runs["store"]["results"][i + 1]["ttft"]}
        for mode in MODES:
            # This prompt's repetitions: results after the warm-up, and the mode's load statistics
            # (one line per load, in order; the warm-up loads nothing).
            at = [r * len(sizes) + i for r in range(repetitions)]
            res = [runs[mode]["results"][1 + j] for j in at]
            loads = [stats[mode][j] for j in at]
            if any(x["bytes"] != loads[0]["bytes"] for x in loads):
                raise BenchError(f"{mode}: the loads of the {n}-token prompt moved different byte counts: "
                                 f"{[x['bytes'] for x in loads]}")
            row[mode] = {"ttft": statistics.median(x["ttft"] for x in res), "ttfts": [x["ttft"] for x in res],
                         "loaded_tokens": min(x["cached"] for x in res),
                         "identical": all(x["tokens"] == recompute["tokens"] for x in res),
                         "load_bytes": loads[0]["bytes"],
                         "load_seconds": statistics.median(x["seconds"] for x in loads),
                         "load_seconds_each": [x["seconds"] for x in loads],
                         "load_chunks": loads[0]["chunks"],
                         "copy_seconds": max(x.get("copy_seconds", 0.0) for x in loads),
                         "landed_bytes": min(x.get("landed_bytes", 0) for x in loads),
                         # the loading thread: seconds on a CPU, and runnable waiting for one
                         "thread_cpu_seconds": _median_known(x.get("thread_cpu_seconds") for x in loads),
                         "thread_runqueue_seconds": _median_known(x.get("thread_runqueue_seconds") for x in loads)}
        for name, runs_of in samples[i].items():
            row[f"{name}_seconds"] = statistics.median(x.seconds for x in runs_of)
            row[f"{name}_samples"] = len(runs_of)
            row[f"{name}_cpu_seconds"] = _median_known(x.cpu_seconds for x in runs_of)
        rows.append(row)
    return rows


def _median_known(values: Iterable[float | None]) -> float | None:
    """The median of the values measured (``None`` where none was: the kernel did not say)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _gbps(nbytes: int | None, seconds: float | None) -> float:
    return nbytes / seconds / 1e9 if nbytes and seconds else math.nan


def _table(results: dict) -> Table:
    m = results["model"]
    table = Table(title=f"kvring bench e2e: time to first token, {m['layers']}-layer hidden-{m['hidden']} "
                        f"Llama (MLP {m['intermediate']}, {m.get('dtype', 'bfloat16')}) on CPU, {NODES} nodes, "
                        f"{'mutual TLS' if results.get('tls') else 'plain TCP'}; B: median of "
                        f"{results.get('repetitions', 1)} loads per mode")
    for col in ("tokens", "recompute", "no connector", "A: compute+save", *(f"B {mode}" for mode in MODES),
                "loaded", "load GB/s lw|bulk|async", f"bare TLS GB/s 1|{NODES} servers",
                "load / bare TLS lw|bulk|async", "raw ZMQ GB/s", "plain TCP GB/s",
                "same tokens"):
        table.add_column(col, justify="right", overflow="fold")
    for r in results["rows"]:
        b = [r[mode] for mode in MODES]
        table.add_row(
            str(r["tokens"]), f"{r['recompute_ttft']:.2f} s", f"{r['no_connector_ttft']:.2f} s",
            f"{r['store_ttft']:.2f} s",
            *(f"{x['ttft']:.3f} s ({r['recompute_ttft'] / x['ttft']:.0f}x)" for x in b),
            "|".join(str(x["loaded_tokens"]) for x in b),
            "|".join(f"{_gbps(x['load_bytes'], x['load_seconds']):.2f}" for x in b),
            f"{_gbps(r['bulk']['load_bytes'], r.get('bare_tls_seconds')):.2f}|"
            f"{_gbps(r['bulk']['load_bytes'], r.get('bare_tls_nodes_seconds')):.2f}",
            "|".join(f"{r['bare_tls_seconds'] / x['load_seconds']:.2f}" if x["load_seconds"] and r.get("bare_tls_seconds")
                     else "-" for x in b),
            f"{_gbps(r['bulk']['load_bytes'], r.get('raw_zmq_seconds')):.2f}",
            f"{_gbps(r['bulk']['load_bytes'], r.get('plain_tcp_seconds')):.2f}",
            "yes" if all(x["identical"] for x in b) else "NO")
    return table


def _time_table(results: dict) -> Table:
    """Where each mode's load time went, on the thread that loads (``ThreadClock``): on a CPU,
    runnable but without one (the machine's cores busy elsewhere), and the rest blocked (on the
    nodes' bytes, or a lock); its CPU per byte beside the bare TLS client's for the same bytes; and
    the spread of the loads against the bare TLS loop (each load's bandwidth over the loop's median:
    the loop's samples are taken after the instance, not paired with its loads)."""
    table = Table(title="kvring bench e2e: where B's load time went, on the loading thread (medians; "
                        "blocked: waiting for the nodes' bytes or a lock), and each load over the bare TLS "
                        "loop's median")
    for col in ("tokens", "mode", "load", "on a CPU", "runnable, no CPU", "blocked", "CPU ns/byte",
                "bare TLS client (1 server): load | CPU ns/byte", "load / bare TLS, each load: median (quartiles)"):
        table.add_column(col, justify="right")
    for r in results["rows"]:
        bare_cpu, bare = r.get("bare_tls_cpu_seconds"), r.get("bare_tls_seconds")
        for mode in MODES:
            x = r[mode]
            cpu, waiting, nbytes = x.get("thread_cpu_seconds"), x.get("thread_runqueue_seconds"), x["load_bytes"]
            known = cpu is not None and waiting is not None
            each = x.get("load_seconds_each") or [x["load_seconds"]]
            table.add_row(str(r["tokens"]), mode, f"{x['load_seconds']:.3f} s",
                          f"{cpu:.3f} s" if known else "-", f"{waiting:.3f} s" if known else "-",
                          f"{max(0.0, x['load_seconds'] - cpu - waiting):.3f} s" if known else "-",
                          f"{cpu / nbytes * 1e9:.2f}" if known and nbytes else "-",
                          (f"{bare:.3f} s | " if bare else "- | ")
                          + (f"{bare_cpu / nbytes * 1e9:.2f}" if bare_cpu is not None and nbytes else "-"),
                          quartile_spread([bare / t for t in each if t], ".2f") if bare else "-")
    return table


def _plot(results: dict, path: Path) -> None:
    rows = results["rows"]
    grouped_bars(path, [f"{r['tokens']} tokens" for r in rows],
                 {"recompute": [r["recompute_ttft"] for r in rows],
                  **{f"kvring {mode}": [r[mode]["ttft"] for r in rows] for mode in MODES}},
                 "time to first token (s, log)", "vLLM (CPU): loaded from kvring vs recomputed", log=True)
