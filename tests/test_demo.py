"""`kvring demo` end to end: a local cluster, two real vLLM instances (CPU build) and a recompute."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_second_instance_loads_instead_of_recomputing(tmp_path):
    plot, out_json = tmp_path / "demo.png", tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-P", "-m", "kvring.cli", "demo", "--layers", "2", "--hidden", "256",
                           "--prefix-tokens", "768", "--suffix-tokens", "300", "--prompts", "2",
                           "--plot", str(plot), "--json", str(out_json)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "B: loaded from kvring" in proc.stdout and "identical" in proc.stdout
    rows = json.loads(out_json.read_text())["rows"]
    # A computed both prompts (1068 tokens: 4 whole chunks), B loads the 4 whole chunks of each.
    assert rows[0]["loaded_by_a"] == 0
    assert [r["loaded_by_b"] for r in rows] == [1024, 1024]
    assert all(r["identical"] for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
