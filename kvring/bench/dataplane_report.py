"""The tables and the plot of ``kvring bench data-plane``, drawn from its results dict (the JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvring.common.units import format_size

STREAM_HOW = {"kvring": "kvring iter_layers", "tcp": "plain TCP one message a layer", "zmq": "raw ZMQ one message a layer",
              "redis": "Redis one GETRANGE a layer and key", "mooncake": "Mooncake one ranged read a layer in a get session"}
LOOKUP_HOW = {"kvring": "kvring lookup", "tcp": "plain TCP one request", "zmq": "raw ZMQ one request",
              "redis": "Redis pipelined EXISTS", "mooncake": "Mooncake batch_is_exist"}


def _how(notes: dict[str, str], systems: dict[str, str]) -> str:
    """The notes of the systems measured (kvring's once, whatever its node counts)."""
    kinds = dict.fromkeys(key.split("-")[0] for key in systems)
    return "; ".join(notes[k] for k in kinds if k in notes)


def _ratio_columns(systems: dict[str, str]) -> list[str]:
    return [k for k in systems if k.startswith("kvring")] if "tcp" in systems else []


def throughput_table(results: dict[str, Any]) -> Table:
    cfg, systems = results["config"], results["systems"]
    ratios = _ratio_columns(systems)
    chunks = "\n".join(f"{c['size']}: {c['model']} {c['shape']} bf16, {c['shape'][0]} layers of "
                       f"{format_size(c['layer_bytes'])}" for c in cfg["chunks"])
    table = Table(title=f"Throughput, GB/s: median of {cfg['repetitions']} repetitions (min–max below), "
                        f"{cfg['batch']} chunks a request",
                  caption=f"{chunks}\nGET stream: every layer delivered layer by layer ({_how(STREAM_HOW, systems)})" + ("\nkvring / TCP: kvring's median over plain TCP's "
                                                        "(the loopback ceiling)" if ratios else ""))
    table.add_column("case", no_wrap=True)
    table.add_column("size", no_wrap=True)
    for label in systems.values():
        table.add_column(label, justify="right")
    for key in ratios:
        table.add_column(f"{systems[key]} / TCP", justify="right")
    rows = results["throughput"]
    for i, r in enumerate(rows):
        cells = [r["case"], r["size"]]
        for key in systems:
            x = r["results"][key]
            cells.append(f"{x['gbps']:.2f}\n[dim]{x['min']:.2f}–{x['max']:.2f}[/]")
        cells += [f"{r['vs_tcp'][key]:.2f}×" for key in ratios]
        table.add_row(*cells, end_section=i + 1 < len(rows) and rows[i + 1]["size"] != r["size"])
    return table


def lookup_table(results: dict[str, Any]) -> Table:
    cfg, systems = results["config"], results["systems"]
    ratios = _ratio_columns(systems)
    table = Table(title=f"Existence check of present keys in one call, ms: p50 / p99 of {cfg['lookup_samples']} "
                        "samples",
                  caption=_how(LOOKUP_HOW, systems) + ("\nkvring / TCP: kvring's p50 over plain TCP's" if ratios else ""))
    table.add_column("keys", justify="right")
    for label in systems.values():
        table.add_column(label, justify="right")
    for key in ratios:
        table.add_column(f"{systems[key]} / TCP", justify="right")
    for r in results["lookup"]:
        table.add_row(str(r["keys"]), *(f"{r['results'][k]['p50']:.3f} / {r['results'][k]['p99']:.3f}" for k in systems),
                      *(f"{r['vs_tcp'][k]:.1f}×" for k in ratios))
    return table


def print_tables(console: Console, results: dict[str, Any]) -> None:
    console.print(throughput_table(results))
    console.print(lookup_table(results))


def plot(results: dict[str, Any], path: Path) -> None:
    """One panel of throughput per chunk size (bars: medians, whiskers: min–max), one of latency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    systems = results["systems"]
    sizes = [c["size"] for c in results["config"]["chunks"]]
    colors = {key: plt.get_cmap("tab10")(j) for j, key in enumerate(systems)}
    width = 0.8 / len(systems)
    cols = 2
    nrows = (len(sizes) + 1 + cols - 1) // cols
    fig, grid = plt.subplots(nrows, cols, figsize=(7 * cols, 4.6 * nrows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(sizes) + 1:]:
        ax.set_visible(False)
    for ax, size in zip(axes, sizes):
        rows = [r for r in results["throughput"] if r["size"] == size]
        x = np.arange(len(rows))
        for j, (key, label) in enumerate(systems.items()):
            res = [r["results"][key] for r in rows]
            med = np.array([v["gbps"] for v in res])
            err = [med - [v["min"] for v in res], [v["max"] for v in res] - med]
            ax.bar(x + (j - (len(systems) - 1) / 2) * width, med, width, yerr=err, capsize=2, label=label,
                   color=colors[key])
        ax.set_xticks(x, [r["case"] for r in rows], fontsize=8)
        ax.set(title=f"{size} chunks ({rows[0]['model']})", ylabel="GB/s (median, min–max)")
    ax = axes[len(sizes)]
    rows = results["lookup"]
    x = np.arange(len(rows))
    for j, (key, label) in enumerate(systems.items()):
        pos = x + (j - (len(systems) - 1) / 2) * width
        ax.bar(pos, [r["results"][key]["p50"] for r in rows], width, label=label, color=colors[key])
        ax.scatter(pos, [r["results"][key]["p99"] for r in rows], marker="_", color="black", zorder=3)
    ax.set_xticks(x, [f"{r['keys']} keys" for r in rows])
    ax.set(title="existence check", ylabel="ms (bars p50, ticks p99)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"kvring bench data-plane: {results['config']['batch']} chunks a request, "
                 f"{results['config']['repetitions']} repetitions interleaved")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
