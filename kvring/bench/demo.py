"""`kvring demo`: two separate vLLM instances share prefixes through a local kvring cluster.

Instance A computes a workload of long prompts with shared prefixes and saves their chunks;
instance B, another process with vLLM's own prefix caching off, gets the same prompts and
loads them from the cluster; a third instance recomputes every prompt (each under a salt of
its own, so nothing can be loaded).  The table compares time to first token, checks that B's
greedy tokens are identical to A's, and shows for how many tokens they agree with the full
recomputation.

The model runs in float32 by default (``--dtype``): a random model's logits are full of near
ties, and in bfloat16 the different shapes of the same computation (A prefills a prompt's suffix
in one pass, B computes only its last block after loading the rest) round differently enough to
flip some of them after a few tokens; in float32 that rounding stays far below the gaps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvring.bench.report import grouped_bars, machine, write_outputs
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

MAX_TOKENS = 16  # greedy tokens each instance generates per prompt
COLUMNS = ("prompt", "tokens", "A: cached from kvring", "B: loaded from kvring", "B TTFT", "recompute TTFT",
           "speed-up", "B = A", "B = recompute")  # the table the demo prints (the README's first screen shows one)


def workload(prefix_tokens: int, suffix_tokens: int, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts sharing a ``prefix_tokens`` system prompt, each with its own suffix."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(10, 30000, size=prefix_tokens).tolist()
    return [prefix + rng.integers(10, 30000, size=suffix_tokens).tolist() for _ in range(count)]


def run_demo(layers: int = 6, hidden: int = 1024, prefix_tokens: int = 3072, suffix_tokens: int = 1024,
             prompts: int = 3, mode: str = "layerwise", plot: Path | None = None,
             json_out: Path | None = None, dtype: str = "float32", tls: bool = True) -> dict:
    """A computes the workload and saves it, B loads it, C recomputes it; ``tls``: the data plane
    as `kvring up` runs it (mutual TLS), or plain TCP."""
    console = Console(width=None if Console().is_terminal else 160)
    items = workload(prefix_tokens, suffix_tokens, prompts)
    # The model, the instances' logs and every file vLLM and torch write: removed however the run ends.
    with run_directory("demo") as tmp, \
            Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("writing a random Llama model (no download) ...")
        from kvring.engine.run import run_instance, write_tiny_llama
        model = str(write_tiny_llama(tmp / "model", layers=layers, hidden=hidden, heads=8, kv_heads=4,
                                     vocab=32000, head_dim=128))
        bar.update(task, description="starting etcd and 3 cache nodes ...")
        with LocalCluster(nodes=3, memory=2 << 30, cluster="demo", tls=tls) as cluster:
            conn = cluster.connector(load_mode=mode)
            spec = {"model": model, "connector": conn, "max_tokens": MAX_TOKENS, "dtype": dtype,
                    "max_model_len": max(8192, prefix_tokens + suffix_tokens + 64)}
            bar.update(task, description="instance A: computing the workload, saving to kvring ...")
            a = run_instance(tmp, "A", {**spec, "prompts": [{"tokens": p} for p in items]})
            bar.update(task, description="instance B: same prompts, loading from kvring ...")
            b = run_instance(tmp, "B", {**spec, "prompts": [{"tokens": p} for p in items]})
            bar.update(task, description="instance C: recomputing every prompt ...")
            c = run_instance(tmp, "C", {**spec, "prompts": [{"tokens": p, "salt": f"recompute-{i}"}
                                                          for i, p in enumerate(items)]})
    rows = []
    for i, p in enumerate(items):
        ra, rb, rc = a["results"][i], b["results"][i], c["results"][i]
        rows.append({"prompt": i, "tokens": len(p), "loaded_by_a": ra["cached"], "loaded_by_b": rb["cached"], "ttft_a": ra["ttft"],
                     "ttft_b": rb["ttft"], "ttft_recompute": rc["ttft"],
                     "identical": ra["tokens"] == rb["tokens"],
                     "same_as_recompute": next((k for k, (x, y) in enumerate(zip(rb["tokens"], rc["tokens"])) if x != y),
                                               len(rb["tokens"]))})
    title = (f"kvring demo: {layers}-layer hidden-{hidden} Llama ({dtype}) on CPU, {mode} loads, "
             f"{'mutual TLS' if tls else 'plain TCP'}")
    table = Table(title=title, caption=f"on {machine()}; B = recompute: how many of B's {MAX_TOKENS} greedy tokens "
                                       "match a recomputing instance's")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for r, ra in zip(rows, a["results"]):
        speed = r["ttft_recompute"] / r["ttft_b"] if r["ttft_b"] else float("nan")
        same = r["same_as_recompute"]
        table.add_row(str(r["prompt"]), str(r["tokens"]), str(ra["cached"]), str(r["loaded_by_b"]),
                      f"{r['ttft_b']:.2f} s", f"{r['ttft_recompute']:.2f} s", f"{speed:.1f}x",
                      "identical" if r["identical"] else "DIFFER",
                      f"all {MAX_TOKENS} tokens" if same == MAX_TOKENS else f"first {same} of {MAX_TOKENS}")
    console.print(table)
    results = {"layers": layers, "hidden": hidden, "mode": mode, "dtype": dtype, "tls": tls, "title": title,
               "machine": machine(), "rows": rows}
    write_outputs(console, results, json_out, plot, _plot)
    return results


def _plot(results: dict, path: Path) -> None:
    rows = results["rows"]
    grouped_bars(path, [f"prompt {r['prompt']}\n{r['tokens']} tokens" for r in rows],
                 {"recompute": [r["ttft_recompute"] for r in rows],
                  "loaded from kvring": [r["ttft_b"] for r in rows]}, "time to first token (s)",
                 title=f"{results['title']}\n{results['machine']}")
