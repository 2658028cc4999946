"""A PNG of a Grafana dashboard's time-series panels, drawn with matplotlib from the series
Prometheus answered for each panel's queries (what Grafana would draw, without Grafana).

Each panel keeps its title, its targets' legends (``{{label}}`` filled in from each series'
labels), its unit (``fieldConfig.defaults.unit``) and its right-axis and dashed overrides;
``events`` marks moments of the workload behind the series with numbered vertical lines.

Importable as ``dashboard_plot`` from every test folder (like ``polling``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

# Grafana units -> (scale, suffix) choosers for the axis label.
_BINARY = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B")]


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels)


def _scale(unit: str, peak: float) -> tuple[float, str]:
    if unit in ("bytes", "Bps"):
        for size, name in _BINARY:
            if peak >= size:
                return size, name + ("/s" if unit == "Bps" else "")
        return 1, "B" + ("/s" if unit == "Bps" else "")
    return {"percentunit": (0.01, "%"), "s": (1, "s"), "ops": (1, "per second")}.get(unit, (1, ""))


def _overrides(panel: dict, ref: str, name: str) -> dict[str, object]:
    """The override properties that apply to target ``ref``'s series ``name``."""
    found: dict[str, object] = {}
    for override in panel["fieldConfig"].get("overrides", []):
        matcher = override["matcher"]
        if ((matcher["id"] == "byFrameRefID" and matcher["options"] == ref)
                or (matcher["id"] == "byRegexp" and re.fullmatch(matcher["options"], name))):
            found.update({p["id"]: p["value"] for p in override["properties"]})
    return found


def render(path: Path, panels: list[dict], series: dict[tuple[int, str], list[dict]], start: float,
           title: str, events: list[tuple[float, str]] = (), columns: int = 3) -> None:
    """Draw ``panels`` (Grafana panel dicts) to ``path``; ``series[(panel id, refId)]`` is the
    matrix Prometheus answered for that target; times are shown in seconds from ``start``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        right = None
        lines = []  # (axis, unit, xs, ys, name, dashed)
        for target in panel["targets"]:
            for s in series.get((panel["id"], target["refId"]), []):
                name = legend(target.get("legendFormat", ""), s["metric"])
                props = _overrides(panel, target["refId"], name)
                xs = [float(t) - start for t, _ in s["values"]]
                ys = [y if math.isfinite(y := float(v)) else math.nan for _, v in s["values"]]
                on_right = props.get("custom.axisPlacement") == "right"
                if on_right and right is None:
                    right = ax.twinx()
                lines.append((right if on_right else ax, props.get("unit", unit), xs, ys, name,
                              "custom.lineStyle" in props))
        colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)  # one cycle for both axes
        for axis in {id(a): a for a, *_ in lines}.values():
            mine = [ln for ln in lines if ln[0] is axis]
            peak = max((abs(y) for ln in mine for y in ln[3] if not math.isnan(y)), default=0.0)
            scale, label = _scale(mine[0][1], peak)
            for _, _, xs, ys, name, dashed in mine:
                axis.plot(xs, [y / scale for y in ys], linestyle="--" if dashed else "-", linewidth=1.3,
                          label=name, color=next(colors))
            axis.set_ylabel(label)
            if panel["fieldConfig"]["defaults"].get("min") == 0 or axis is right:
                axis.set_ylim(bottom=0)
        for n, (when, _) in enumerate(events, 1):
            ax.axvline(when - start, color="0.5", linewidth=0.8, linestyle=":")
            ax.annotate(str(n), xy=(when - start, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=7, color="0.35")
        handles, labels = [], []
        for axis in (ax, right):
            if axis is not None:
                h, lab = axis.get_legend_handles_labels()
                handles += h
                labels += lab
        if handles:
            ax.legend(handles, labels, fontsize=7, loc="upper left", ncol=2 if len(handles) > 4 else 1)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("seconds", fontsize=8)
        ax.grid(alpha=0.3)
    marks = "   ".join(f"{n}: {text}" for n, (_, text) in enumerate(events, 1))
    fig.suptitle(f"{title}\n{marks}" if marks else title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
