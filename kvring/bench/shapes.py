"""`kvring bench shapes`: what the cluster stores per token, and what loading it saves, for each
model shape the connector serves.

One run, one local 3-node cluster, three small random models of the same hidden size and layer
count (by default hidden 1024, 6 layers, float32, vocabulary 2048, MLP ``2 * hidden``):

- ``llama``: a plain Llama, 8 attention heads and 4 KV heads of 128 (the e2e bench's GQA shape):
  K and V of each KV head, ``2 * 4 * 128 = 1024`` values per token and layer;
- ``mla``: a DeepSeek-V2 with multi-head latent attention (8 heads; vLLM's CPU MLA backend,
  block size 16): one compressed latent per token and layer, ``kv_lora_rank`` 512 + rope 64 =
  576 values, whatever the head count, stored as one part that every rank shares;
- ``hybrid``: a Gemma-3-like model, 8 heads and 4 KV heads of 128 (the Llama's KV shape), five
  sliding-window layers (a window of 512 tokens) to one full-attention layer, served with
  vLLM's hybrid KV-cache manager on (block size 32; the connector loads it asynchronously);
- ``recurrent``: a Qwen3-Next, gated-delta-net layers (linear attention: one recurrent state per
  request) alternating with full-attention ones (8 heads, 2 KV heads of 64), in vLLM's
  ``align`` mode with its prefix caching on (vLLM hands states over at block boundaries only
  there), bfloat16 (vLLM's CPU gated delta net takes no other), ``--block-size 256`` (what vLLM
  picks for it, and the chunk size; given, as the connector asks, so that vLLM's scheduler ends
  prefill steps on those blocks): a load fetches every chunk's attention KV and one state, the one after the
  last chunk of the hit, so its ``fetched / token`` falls with the prompt's length.  Its hit ends
  where vLLM handed a state over, the last chunk boundary before the prompt's last token.  B
  resets vLLM's own prefix cache after each load, so each load asks kvring again.

So the MLA model stores fewer bytes per token than the Llama: 576 values per token and layer
against 1024 (0.56x).  That is a property of these shapes, not of MLA alone: the latent's 576 are
fixed, so a GQA model with 2 KV heads of 128 (512 values) would store less than MLA, and one with
8 (MHA, 2048) 3.6x more.  The hybrid stores what the Llama stores per token (each of its
prompts is prefilled in one step, so every chunk's window parts are saved whole), but a load
fetches its sliding layers only for the chunks holding the last window before the load's end:
the ``fetched / token`` column (the bytes B's load of a prompt fetched, over the same tokens
as ``stored / token``) shows it.

The models have 6 layers, not fewer: Gemma 3's configuration makes every sixth layer a
full-attention one, so with fewer than 6 the hybrid would have none; the other two have as
many layers so the bytes per token compare.

Per model, instance A computes each prompt once and stores its chunks; the bench then sums
``meta.nbytes`` over every part key of each prompt the cluster holds (``stored``), and divides
by the tokens of the prompt's whole chunks (the partial last chunk is never stored).  Instance
B starts with A (its engine start and a short warm-up prompt overlap A's work) and waits until
A has exited and the stored bytes are counted; then, the only engine running, for each prompt,
``repetitions`` times, interleaved:
a recompute (the prompt under a ``cache_salt`` of its own, which no chunk matches) and a load
(the prompt as A ran it; vLLM's own prefix caching off, admission off, so every hit comes from
kvring).  It reports B's time to first token loaded and recomputed (medians over the
repetitions, with their range), the speed-up (recompute median over load median), the tokens B
loaded, and whether every loaded output equals the recompute's (greedy, 8 tokens; it must).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvring.bench.e2e import _warmup
from kvring.bench.e2e_tp import _stored_bytes
from kvring.bench.report import machine, spread, summary, write_outputs
from kvring.cachenode.client import ClusterClient
from kvring.connector.parts import STATE
from kvring.engine.run import decision_between
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

SHAPES = ("llama", "mla", "hybrid", "recurrent")
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 128  # the Llama's and the hybrid's attention
WINDOW = 512  # the hybrid's sliding window, in tokens
VOCAB = 2048
STEP_TIMEOUT_S = 1800  # the longest wait for one instance's step (a start, or B's measured prompts)
# What each engine needs beyond the common spec (the MLA and hybrid ones as their tests run them).
ENGINE = {"llama": {}, "mla": {"block_size": 16}, "hybrid": {"block_size": 32},
          "recurrent": {"dtype": "bfloat16", "prefix_caching": True, "mamba_cache_mode": "align", "block_size": 256}}


def _write_model(shape: str, path: Path, layers: int, hidden: int) -> str:
    from kvring.engine.run import write_tiny_deepseek, write_tiny_gemma3, write_tiny_llama, write_tiny_qwen3_next

    if shape == "llama":
        return str(write_tiny_llama(path, layers=layers, hidden=hidden, heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB,
                                    head_dim=HEAD_DIM))
    if shape == "mla":
        return str(write_tiny_deepseek(path, layers=layers, hidden=hidden, heads=HEADS, vocab=VOCAB))
    if shape == "recurrent":
        return str(write_tiny_qwen3_next(path, layers=layers, hidden=hidden, heads=HEADS, kv_heads=2, vocab=VOCAB))
    return str(write_tiny_gemma3(path, layers=layers, window=WINDOW, hidden=hidden, heads=HEADS, kv_heads=KV_HEADS,
                                 head_dim=HEAD_DIM, vocab=VOCAB))


def _prompts(sizes: Sequence[int], seed: int = 11) -> list[list[int]]:
    """One random prompt per size, in the models' vocabulary; no two share a chunk."""
    rng = np.random.default_rng(seed)
    return [rng.integers(10, VOCAB, size=n).tolist() for n in sizes]


def _b_items(prompts: list[list[int]], repetitions: int, ready: Path, go: Path, local_cache: bool) -> list[dict]:
    """B's prompts: a warm-up, then (once A is done: ``go``) per prompt and repetition a recompute
    and a load (and, where vLLM's own prefix caching is on, a reset of it after the load)."""
    items = [_warmup("B"), {"touch": str(ready)}, {"wait_for": str(go), "timeout": STEP_TIMEOUT_S}]
    for j, p in enumerate(prompts):
        for r in range(repetitions):
            items += [{"tokens": p, "salt": f"recompute-{j}-{r}"}, {"tokens": p}]
            if local_cache:
                items.append({"reset_local_cache": True})
    return items


def _loaded_bytes(steps: list[dict], i: int) -> float:
    """Bytes the connector loaded during generate call ``i`` (its counters are cumulative)."""
    return steps[i]["counters"].get("loaded_bytes", 0.0) - steps[i - 1]["counters"].get("loaded_bytes", 0.0)


def _rows(a: dict, b: dict, stored: list[int], sizes: Sequence[int], repetitions: int) -> list[dict]:
    """Per prompt: what the cluster stores for it, and B's repetitions of it (recompute, load)."""
    chunk = a["layout"]["chunk_size"]
    rows = []
    for j, tokens in enumerate(sizes):
        whole = len(a["keys"][j]) * chunk
        reps = []
        for r in range(repetitions):
            i = 1 + 2 * (j * repetitions + r)  # the recompute's result (and generate call); the load's is i + 1
            recompute, loaded = b["results"][i], b["results"][i + 1]
            reps.append({"recompute_ttft": recompute["ttft"], "ttft": loaded["ttft"], "loaded_tokens": loaded["cached"],
                         "recompute_cached": recompute["cached"], "fetched_bytes": _loaded_bytes(b["steps"], i + 1),
                         "decision": decision_between(b["steps"][i]["counters"], b["steps"][i + 1]["counters"]),
                         "identical": loaded["tokens"] == recompute["tokens"]})
        loaded_tokens = min(x["loaded_tokens"] for x in reps)  # vLLM computes the last block whatever it loaded
        fetched = summary([x["fetched_bytes"] for x in reps])
        rows.append({"tokens": tokens, "whole_chunk_tokens": whole, "stored_bytes": stored[j],
                     "stored_bytes_per_token": stored[j] / whole if whole else math.nan,
                     "loaded_tokens": loaded_tokens, "fetched_bytes": fetched,
                     "fetched_bytes_per_token": fetched["median"] / whole if whole else math.nan,
                     "ttft": summary([x["ttft"] for x in reps]),
                     "recompute_ttft": summary([x["recompute_ttft"] for x in reps]),
                     "identical": all(x["identical"] for x in reps), "repetitions": reps})
        rows[-1]["speedup"] = rows[-1]["recompute_ttft"]["median"] / rows[-1]["ttft"]["median"]
    return rows


def _shape(layout: dict) -> dict:
    """The model facts a layout holds (how the connector sees the model)."""
    return {"layers": layout["num_layers"], "kv_heads": layout["num_kv_heads"], "head_size": layout["head_size"],
            "latent": layout["latent"], "windows": list(layout["windows"]), "kv_dtype": layout["kv_dtype"]}


def run_bench_shapes(sizes: Sequence[int] = (2048, 4096), layers: int = 6, hidden: int = 1024,
                     repetitions: int = 3, memory: int = 2 << 30, json_out: Path | None = None,
                     plot: Path | None = None, console: Console | None = None) -> dict:
    from kvring.engine.run import run_instance, start_instance

    console = console or Console(width=None if Console().is_terminal else 220)
    prompts = _prompts(sizes)
    shapes: dict[str, dict] = {}
    with run_directory("bench-shapes") as tmp, \
            Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                     TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("starting etcd and 3 cache nodes", total=1 + 3 * len(SHAPES))
        with LocalCluster(nodes=3, memory=memory, cluster="bench-shapes") as cluster, \
                ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
            bar.advance(task)
            # Every load runs and is measured to its end: no admission, and no deadline derived from
            # these tiny models' recompute (0.1 s, so a first async load's connections and a busy
            # machine's stall would have it abandoned and measure a recompute instead).
            conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_admission": False,
                    "lookup_deadline_ms": 10_000, "load_deadline_ms": 10_000}
            for shape in SHAPES:
                bar.update(task, description=f"{shape}: writing a random model (no download)")
                model = _write_model(shape, tmp / shape, layers, hidden)
                base = {"model": model, "dtype": "float32", "max_tokens": 8, "max_model_len": max(sizes) + 64,
                        "connector": conn, **ENGINE[shape]}
                bar.advance(task)
                bar.update(task, description=f"{shape}: vLLM instance A computes and stores {len(sizes)} prompts")
                ready, go = tmp / f"{shape}-B-ready", tmp / f"{shape}-B-go"
                b_items = _b_items(prompts, repetitions, ready, go, bool(base.get("prefix_caching")))
                b_instance = start_instance(tmp, f"{shape}-B", {**base, "prompts": b_items})
                try:
                    # (a model with recurrent state in this process: only there is its layout known,
                    # which the stored bytes are counted by)
                    a = run_instance(tmp, f"{shape}-A", {**base, "prompts": [{"tokens": p} for p in prompts],
                                                         "in_process": shape == "recurrent"})
                    stored = [_stored_bytes(client, a, j) for j in range(len(sizes))]
                    bar.advance(task)
                    bar.update(task, description=f"{shape}: vLLM instance B recomputes and loads, {repetitions}x each")
                    b_instance.wait_file(ready, STEP_TIMEOUT_S)
                    go.touch()
                    b = b_instance.result(timeout=STEP_TIMEOUT_S)
                finally:
                    b_instance.stop()
                bar.advance(task)
                shapes[shape] = {**_shape(a["layout"]), "rows": _rows(a, b, stored, sizes, repetitions)}
    results = {"model": {"layers": layers, "hidden": hidden, "heads": HEADS, "vocab": VOCAB, "dtype": "float32",
                         "window": WINDOW},
               "repetitions": repetitions, "machine": machine(), "shapes": shapes}
    console.print(_table(results))
    write_outputs(console, results, json_out, plot, _plot)
    return results


def _attention(s: dict) -> str:
    if s["latent"]:
        return f"MLA latent {s['head_size']}"
    if STATE in s["windows"]:
        states = s["windows"].count(STATE)
        return f"{states} x recurrent state + {len(s['windows']) - states} full"
    if s["windows"]:
        sliding = sum(1 for w in s["windows"] if w)
        return f"{sliding} x window {max(s['windows'])} + {len(s['windows']) - sliding} full"
    return "full"


def _table(results: dict) -> Table:
    m = results["model"]
    table = Table(title=f"kvring bench shapes: {m['layers']}-layer hidden-{m['hidden']} random models "
                        f"({m['dtype']}) on CPU, 3 nodes")
    for col in ("shape", "layers / KV heads / head size", "attention", "tokens", "stored", "stored / token",
                "B loaded", "fetched / token", "B TTFT", "recompute TTFT", "speed-up", "B = recompute"):
        table.add_column(col, justify="right")
    for name, s in results["shapes"].items():
        for r in s["rows"]:
            table.add_row(name, f"{s['layers']} / {s['kv_heads']} / {s['head_size']}", _attention(s), str(r["tokens"]),
                          f"{r['stored_bytes'] / 2**20:.1f} MiB", f"{r['stored_bytes_per_token'] / 2**10:.1f} KiB",
                          str(r["loaded_tokens"]), f"{r['fetched_bytes_per_token'] / 2**10:.1f} KiB",
                          spread(r["ttft"], ".3f") + " s", spread(r["recompute_ttft"], ".3f") + " s",
                          f"{r['speedup']:.1f}x", "yes" if r["identical"] else "NO")
    table.caption = (f"on {results['machine']}; TTFT: median (min-max) of {results['repetitions']} repetitions; "
                     "per token: bytes held for the prompt (fetched: by B's load of it, median) over its whole "
                     "chunks' tokens")
    return table


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["shapes"])
    sizes = [r["tokens"] for r in results["shapes"][names[0]]["rows"]]
    x = np.arange(len(names))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(x - 0.2, [results["shapes"][n]["rows"][-1]["stored_bytes_per_token"] / 2**10 for n in names], 0.4,
             label="stored")
    left.bar(x + 0.2, [results["shapes"][n]["rows"][-1]["fetched_bytes_per_token"] / 2**10 for n in names], 0.4,
             label="fetched by a load")
    left.set_xticks(x, names)
    left.set_ylabel(f"KiB per token ({sizes[-1]}-token prompt)")
    left.legend()
    groups = [f"{n}\n{t}" for n in names for t in sizes]
    g = np.arange(len(groups))
    right.bar(g - 0.2, [r["recompute_ttft"]["median"] for n in names for r in results["shapes"][n]["rows"]], 0.4,
              label="recompute")
    right.bar(g + 0.2, [r["ttft"]["median"] for n in names for r in results["shapes"][n]["rows"]], 0.4,
              label="loaded from kvring")
    right.set_yscale("log")
    right.set_xticks(g, groups)
    right.set_ylabel("time to first token (s, log)")
    right.legend()
    m = results["model"]
    fig.suptitle(f"vLLM (CPU), {m['layers']}-layer hidden-{m['hidden']} models: bytes per token and TTFT")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
