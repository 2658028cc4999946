"""Writing a benchmark's or replay's results: JSON and a PNG plot, for every command alike."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

from rich.console import Console


def write_outputs(console: Console, results: dict, json_out: Path | None, plot: Path | None,
                  draw: Callable[[dict, Path], None]) -> None:
    """Write ``results`` as JSON to ``json_out`` and ``draw`` them to ``plot`` (each if given)."""
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(results, indent=2))
        console.print(f"results written to {json_out}")
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)
        draw(results, plot)
        console.print(f"plot written to {plot}")


def grouped_bars(path: Path, groups: list[str], series: dict[str, list[float]], ylabel: str,
                 title: str | None = None, log: bool = False) -> None:
    """A PNG of one bar per series in each group (e.g. recompute vs loaded, per prompt)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(groups))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(7, 4))
    for j, (label, values) in enumerate(series.items()):
        ax.bar(x + (j - (len(series) - 1) / 2) * width, values, width, label=label)
    if log:
        ax.set_yscale("log")
    ax.set_xticks(x, groups)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> str:
    """This machine in one line, for a benchmark's report: CPU model, cores, memory."""
    import os

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = " ".join(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory = 0.0
    return f"{model}, {os.cpu_count()} cores, {memory:.0f} GiB"


def summary(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements (what a table shows as ``spread``)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread(s: dict[str, float], fmt: str) -> str:
    """A ``summary`` as "median (min-max)", each in format ``fmt``."""
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def quartile_spread(values: list[float], fmt: str) -> str:
    """Repeated measurements as "median (lower quartile-upper quartile)", each in format ``fmt``
    (``inclusive`` quartiles: within the values; a single value is all three); "-" for none."""
    if not values:
        return "-"
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{q2:{fmt}} ({q1:{fmt}}-{q3:{fmt}})"
