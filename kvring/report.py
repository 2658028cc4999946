"""Writing a benchmark's or replay's results: JSON and a PNG plot, for every command alike."""

from __future__ import annotations

import json
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
