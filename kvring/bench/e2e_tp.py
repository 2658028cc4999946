"""`kvring bench e2e --tp N`: the same prompts under tensor parallelism N against TP 1.

One local 3-node cluster, three vLLM instances (each its own process; the TP N ones with N
workers, one CPU each) on the e2e bench's random Llama (4 KV heads, so TP 2 and 4 split them),
run in float32 by default: on CPUs without AVX-512 (BF16) vLLM's CPU build computes bfloat16
some 20-100x slower than float32 (this project's AVX2 machine: a bfloat16 matmul at 0.9 GFLOP/s
against 89 for float32), which would bury the load in the recompute it replaces.

- ``store TP N``: computes each prompt once; each rank saves the parts of its KV heads;
- ``TP 1`` and ``TP N``: load every prompt from what TP N stored (layerwise; vLLM's own prefix
  caching off), ``repetitions`` times over, then recompute it under a ``cache_salt`` of their own
  in the same engine: the baseline each speed-up is against, and a second copy of the prompt's
  chunks, stored by that TP size.

Per prompt it reports the bytes the cluster holds for it as stored by TP 1 and by TP N (equal:
each KV head is stored once, whatever the TP size), and for each TP size the time to first
token loaded and recomputed, the tokens loaded, whether the output equals the recompute's, and
the load bandwidth: bytes loaded by all workers of the instance over the slowest worker's load
time (the workers load their own heads in parallel), next to a plain TCP socket moving one
worker's bytes in the same part sizes over loopback in the same run, measured once per
repetition.  Loaded figures are medians over the repetitions, with their range.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvring.bench.dataplane import PlainTcp
from kvring.bench.e2e import _baseline_times, _gbps, _prompts, _warmup
from kvring.bench.report import grouped_bars, spread, summary, write_outputs
from kvring.cachenode.client import ClusterClient
from kvring.connector.parts import ChunkPart
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 128


def _plain_tcp_gbps(load: dict, layers: int) -> float:
    """A plain TCP socket's GB/s moving one worker's share of ``load``'s parts, in the same part
    sizes, layer by layer: the loopback ceiling for the bytes each worker loads."""
    part = load["bytes"] // load["parts"]
    parts = max(1, load["bytes"] // load["workers"] // part)
    return _gbps(part * parts, _baseline_times(PlainTcp, part, parts, layers, repeats=1)[0].seconds)


def _loads(stats_path: Path) -> list[dict]:
    """The instance's loads, in order, each summed over its workers: bytes and parts of all of
    them, seconds of the slowest (a worker appends one line per load: ``heads``, ``layers``)."""
    if not stats_path.exists():
        return []
    per_worker: dict[str, list[dict]] = defaultdict(list)
    for line in stats_path.read_text().splitlines():
        entry = json.loads(line)
        per_worker[f"{entry['heads']}/{entry['layers']}"].append(entry)
    loads = []
    for entries in zip(*per_worker.values()):
        loads.append({"bytes": sum(e["bytes"] for e in entries), "parts": sum(e["parts"] for e in entries),
                      "seconds": max(e["seconds"] for e in entries), "workers": len(entries),
                      "failed_blocks": sum(e["failed_blocks"] for e in entries)})
    return loads


def _stored_bytes(client: ClusterClient, out: dict, item: int) -> int:
    """Bytes the cluster holds for prompt item ``item`` of an instance's run (every part of it)."""
    parts = [ChunkPart(*p) for p in out["parts"]]
    keys = [p.key(bytes.fromhex(k)) for k in out["keys"][item] for p in parts]
    return sum(c.meta.nbytes for c in client.get(keys) if c is not None)


def run_bench_e2e_tp(tp: int, sizes: Sequence[int] = (1024, 4096), layers: int = 6, hidden: int = 1024,
                     intermediate: int = 11008, memory: int = 2 << 30, dtype: str = "float32",
                     repetitions: int = 3, json_out: Path | None = None, plot: Path | None = None,
                     tls: bool = True) -> dict:
    from kvring.engine.run import run_instance, write_tiny_llama

    console = Console(width=None if Console().is_terminal else 200)
    prompts = _prompts(sizes)
    n = len(sizes)
    names = {f"store TP {tp}": tp, "TP 1": 1, f"TP {tp}": tp}
    with run_directory("bench-e2e-tp") as tmp, \
            Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                     TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("writing a random Llama (no download)", total=2 + len(names) + 1)
        model = str(write_tiny_llama(tmp / "model", layers=layers, hidden=hidden, heads=HEADS, kv_heads=KV_HEADS,
                                     vocab=32000, head_dim=HEAD_DIM, intermediate=intermediate))
        bar.advance(task)
        bar.update(task, description="starting etcd and 3 cache nodes")
        runs: dict[str, dict] = {}
        loads: dict[str, list[dict]] = {}
        stored: dict[str, list[int]] = {}
        with LocalCluster(nodes=3, memory=memory, cluster="bench-e2e-tp", tls=tls) as cluster:
            bar.advance(task)
            base = {"model": model, "dtype": dtype, "max_tokens": 1, "max_model_len": max(8192, max(sizes) + 64)}
            for i, (name, size) in enumerate(names.items()):
                bar.update(task, description=f"vLLM instance '{name}' ({size} worker{'s' if size > 1 else ''})")
                stats_path = tmp / f"i{i}.loads.jsonl"
                conn = cluster.connector(stats_path=str(stats_path))
                items = [_warmup(f"i{i}"), *({"tokens": p} for _ in range(repetitions if i else 1) for p in prompts)]
                if i:
                    items += [{"tokens": p, "salt": f"recompute-{i}-{j}"} for j, p in enumerate(prompts)]
                runs[name] = run_instance(tmp, f"i{i}", {**base, "tensor_parallel_size": size, "connector": conn,
                                                         "prompts": items})
                loads[name] = _loads(stats_path)
                bar.advance(task)
            recomputed = 1 + repetitions * n  # the first recompute's item in a loading instance's run
            with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls) as client:
                stored = {t: [_stored_bytes(client, runs[name], recomputed + j) for j in range(n)]
                          for name, t in (("TP 1", 1), (f"TP {tp}", tp))}
                stored_first = [_stored_bytes(client, runs[f"store TP {tp}"], 1 + j) for j in range(n)]
        bar.update(task, description="plain TCP, one worker's bytes in the same part sizes")
        rows = []
        for j, tokens in enumerate(sizes):
            row = {"tokens": tokens, "stored_bytes": {"1": stored[1][j], str(tp): stored[tp][j]},
                   "stored_bytes_first": stored_first[j]}
            for name, t in (("TP 1", 1), (f"TP {tp}", tp)):
                res = runs[name]["results"]
                recompute = res[recomputed + j]
                reps = []
                for r in range(repetitions):
                    loaded = res[1 + r * n + j]
                    load = loads[name][r * n + j] if r * n + j < len(loads[name]) else None
                    rep = {"ttft": loaded["ttft"], "loaded_tokens": loaded["cached"],
                           "identical": loaded["tokens"] == recompute["tokens"], "load": load,
                           "gbps": _gbps(load and load["bytes"], load and load["seconds"])}
                    if load and load["parts"]:
                        rep["plain_tcp_gbps"] = _plain_tcp_gbps(load, layers)
                    reps.append(rep)
                row[str(t)] = {"recompute_ttft": recompute["ttft"], "repetitions": reps,
                               "loaded_tokens": reps[0]["loaded_tokens"],
                               "identical": all(x["identical"] for x in reps),
                               **{key: summary([x.get(key, math.nan) for x in reps])
                                  for key in ("ttft", "gbps", "plain_tcp_gbps")}}
            rows.append(row)
        bar.advance(task)
    results = {"tp": tp, "model": {"layers": layers, "hidden": hidden, "intermediate": intermediate, "heads": HEADS,
                                   "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": dtype}, "tls": tls,
               "rows": rows}
    console.print(_table(results))
    write_outputs(console, results, json_out, plot, _plot)
    return results


def _table(results: dict) -> Table:
    m, tp = results["model"], results["tp"]
    table = Table(title=f"kvring bench e2e --tp {tp}: {m['layers']}-layer hidden-{m['hidden']} Llama "
                        f"({m['kv_heads']} KV heads, {m.get('dtype', 'float32')}) on CPU, 3 nodes, chunks stored "
                        f"by TP {tp}, {'mutual TLS' if results.get('tls') else 'plain TCP'}")
    for col in ("tokens", "stored by TP 1", f"stored by TP {tp}", "TP", "loaded", "B TTFT", "recompute TTFT",
                "speed-up", "load GB/s", "plain TCP GB/s (1 worker)", "B = recompute"):
        table.add_column(col, justify="right")
    for r in results["rows"]:
        for t in ("1", str(tp)):
            x = r[t]
            table.add_row(str(r["tokens"]), f"{r['stored_bytes']['1'] / 2**20:.1f} MiB",
                          f"{r['stored_bytes'][str(tp)] / 2**20:.1f} MiB", t, str(x["loaded_tokens"]),
                          spread(x["ttft"], ".3f") + " s", f"{x['recompute_ttft']:.3f} s",
                          f"{x['recompute_ttft'] / x['ttft']['median']:.1f}x", spread(x["gbps"], ".2f"),
                          spread(x["plain_tcp_gbps"], ".2f"), "yes" if x["identical"] else "NO")
    table.caption = "loaded figures: median (min-max) of the repetitions"
    return table


def _plot(results: dict, path: Path) -> None:
    rows, tp = results["rows"], str(results["tp"])
    grouped_bars(path, [f"{r['tokens']} tokens" for r in rows],
                 {"TP 1 recompute": [r["1"]["recompute_ttft"] for r in rows],
                  "TP 1 loaded": [r["1"]["ttft"]["median"] for r in rows],
                  f"TP {tp} recompute": [r[tp]["recompute_ttft"] for r in rows],
                  f"TP {tp} loaded": [r[tp]["ttft"]["median"] for r in rows]},
                 "time to first token (s, log)", f"vLLM (CPU): TP 1 vs TP {tp}, chunks stored by TP {tp}", log=True)
