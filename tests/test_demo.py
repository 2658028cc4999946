"""`kvring demo` end to end: a local cluster, two real vLLM instances (CPU build) and a recompute."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def test_demo_second_instance_loads_instead_of_recomputing(tmp_path):
    """... and leaves nothing in TMPDIR: the model, the logs, etcd's data, vLLM's IPC sockets and
    rendezvous files and torch's inductor cache all lived in the run's directory (kvring.local.rundir)."""
    plot, out_json = tmp_path / "demo.png", tmp_path / "demo.json"
    # Short, unlike tmp_path: vLLM's IPC sockets go under it, and a socket path holds at most 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="kvring-test-demo-"))
    try:
        proc = subprocess.run([sys.executable, "-P", "-m", "kvring.cli", "demo", "--layers", "2", "--hidden", "256",
                               "--prefix-tokens", "768", "--suffix-tokens", "300", "--prompts", "2",
                               "--plot", str(plot), "--json", str(out_json)],
                              capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(scratch)})
        left = list(scratch.iterdir())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "B: loaded from kvring" in proc.stdout and "identical" in proc.stdout
    results = json.loads(out_json.read_text())
    assert results["tls"] is True and "mutual TLS" in proc.stdout  # as `kvring up` runs the data plane
    rows = results["rows"]
    # A computed both prompts (1068 tokens: 4 whole chunks), B loads the 4 whole chunks of each.
    assert rows[0]["loaded_by_a"] == 0
    assert [r["loaded_by_b"] for r in rows] == [1024, 1024]
    assert all(r["identical"] for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert left == []
