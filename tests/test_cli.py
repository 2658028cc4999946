"""The command line: help texts, `kvring up` lifecycle, `kvring ring`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import typer

import kvring
from kvring.cli.main import app

KVRING = [sys.executable, "-P", "-m", "kvring.cli"]  # -P: see scripts/setup.sh


def _commands(command, path: tuple[str, ...] = ()):
    """(path, click command) of every command of the CLI, groups included."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(typer.main.get_command(app)))


def test_the_commands_are_all_there():
    assert {" ".join(p) for p in COMMANDS} == {
        "", "node", "up", "demo", "ring", "trace", "drain", "operator", "admin", "bench", "bench data-plane",
        "bench e2e", "bench miss", "bench slow-node", "bench membership", "bench repair", "bench tls"}


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "kvring")
def test_every_command_has_help_and_every_option_a_help_text_printed_whole(path):
    """Every option has a help text, and ``--help`` prints all of it (rich markup once ate
    "[default: ...]" out of --max-chunk-bytes' text; -v had none)."""
    out = subprocess.run([*KVRING, *path, "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    assert "Usage: kvring" in out.stdout and "--help" in out.stdout
    squeezed = re.sub(r"\s+", "", out.stdout)  # the help wraps lines, and breaks words at hyphens
    options = [p for p in COMMANDS[path].params if p.param_type_name == "option" and not getattr(p, "hidden", False)]
    for option in options:
        assert option.help, f"{option.opts} has no help text"
        assert re.sub(r"\s+", "", option.help) in squeezed, (option.opts, out.stdout)
        assert option.opts[0] in out.stdout


def test_version():
    out = subprocess.run([*KVRING, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"kvring {kvring.__version__}\n"


def test_bad_size_is_a_clear_error():
    out = subprocess.run([*KVRING, "up", "--memory", "lots"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "4GiB" in out.stdout + out.stderr


def test_up_serves_ring_and_stops_cleanly_on_sigterm():
    proc = subprocess.Popen([*KVRING, "up", "--nodes", "3", "--memory", "64MiB"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "kvring up exited early:\n" + "".join(lines)
            lines.append(line)
            if "Press Ctrl-C" in line:
                break
        text = "".join(lines)
        etcd = re.search(r"etcd (127\.0\.0\.1:\d+)", text).group(1)
        admins = re.findall(r"admin (http://127\.0\.0\.1:\d+)", text)
        assert len(admins) == 3 and f'"etcd": "{etcd}"' in text and '"kv_connector": "KVRingConnector"' in text
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4  # etcd and three nodes
        with urllib.request.urlopen(admins[0] + "/healthz", timeout=5) as r:
            assert r.status == 200
        ring = subprocess.run([*KVRING, "ring", "--etcd", etcd, "--key", "00ff"], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert ring.returncode == 0, ring.stderr
        assert all(f"node-{i}" in ring.stdout for i in range(3)) and "epoch" in ring.stdout
        assert re.search(r"key 00ff: owners node-\d", ring.stdout)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "stopped." in proc.stdout.read()
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"stray processes after kvring up stopped: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_up_demo_workload_reads_back_identical_and_leaves_no_file(tmp_path):
    """`kvring up --demo` runs in a run directory (kvring.local.rundir, as the demo and the benchmarks
    do): etcd's data and the credentials live there, and nothing is left in TMPDIR after."""
    out = subprocess.run([*KVRING, "up", "--nodes", "2", "--memory", "64MiB", "--demo"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200", "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all chunks read back byte-identical" in out.stdout
    assert "4 chunks" in out.stdout  # the second prompt found the shared system prompt's 4 chunks
    assert f"{tmp_path}/kvring-up-" in out.stdout  # where the credentials were
    assert list(tmp_path.iterdir()) == []


def test_node_http_endpoints(cluster_factory):
    cluster = cluster_factory(nodes=1, memory=16 << 20)
    admin = cluster.nodes[0].admin_addr
    with urllib.request.urlopen(admin + "/healthz", timeout=5) as r:
        assert r.read() == b"ok\n"
    with urllib.request.urlopen(admin + "/readyz", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(admin + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    for name in ("kvring_node_bytes_used", "kvring_node_capacity_bytes 1.6777216e+07", "kvring_node_chunks",
                 'kvring_node_hits_total{op="lookup"}', 'kvring_node_misses_total{op="get"}', "kvring_node_evictions_total",
                 'kvring_node_errors_total{kind="bad_header"}', "kvring_node_op_seconds_bucket"):
        assert name in metrics, name
    with urllib.request.urlopen(admin + "/stats", timeout=5) as r:
        stats = json.loads(r.read())
    assert stats["node_id"] == "node-0" and stats["capacity"] == 16 << 20 and stats["registered"]


def test_ring_of_a_cluster_that_does_not_exist_says_so_in_one_line(etcd_server):
    out = subprocess.run([*KVRING, "ring", "--etcd", etcd_server.endpoint, "--cluster", "no-such-cluster"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"kvring: error: cluster 'no-such-cluster' has no contract in etcd at {etcd_server.endpoint} after 0s: none of its "
        "nodes has started (start them first, e.g. `kvring up`), or the cluster name is wrong"]
