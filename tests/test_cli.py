"""The command line: help texts, `kvring up` lifecycle, `kvring ring`."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import typer
from polling import read_until

import kvring
from kvring.cli.main import app
from kvring.common.tls import verifying_context

KVRING = [sys.executable, "-P", "-m", "kvring.cli"]  # -P: see scripts/setup.sh


def _commands(command, path: tuple[str, ...] = ()):
    """(path, click command) of every command of the CLI, groups included."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(typer.main.get_command(app)))


def test_the_commands_are_all_there():
    assert {" ".join(p) for p in COMMANDS} == {
        "", "node", "up", "demo", "ring", "trace", "drain", "operator", "admin", "events", "bench", "bench data-plane",
        "bench e2e", "bench miss", "bench slow-node", "bench membership", "bench repair", "bench tls",
        "bench shapes", "bench gpu", "bench disk", "bench reads"}


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
    try:
        text = read_until(proc.stdout, "Press Ctrl-C")
        etcd = re.search(r"etcd (127\.0\.0\.1:\d+)", text).group(1)
        admins = re.findall(r"admin (https://127\.0\.0\.1:\d+)", text)  # TLS, the default
        assert len(admins) == 3 and f'"etcd": "{etcd}"' in text and '"kv_connector": "KVRingConnector"' in text
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4  # etcd and three nodes
        ca = re.search(r"curl --cacert (\S+)\)", text).group(1)
        probe = verifying_context(Path(ca).read_bytes())  # as a kubelet probe or Prometheus: the CA, no certificate
        with urllib.request.urlopen(admins[0] + "/healthz", timeout=5, context=probe) as r:
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


def _request(url: str, method: str = "GET", body: dict | None = None,
             headers: dict | None = None, context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else (b"" if method != "GET" else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_up_wires_the_node_token_into_its_nodes_its_admin_api_and_kvring_drain(tmp_path):
    """`kvring up` makes a node token per cluster (a 0600 file in its run directory) and gives it to
    its nodes and its admin API: a node refuses a flush or drain without it, `kvring drain` works
    given the file or the variable, and the admin API's flush reaches every node."""
    from kvring.cachenode.client import ClusterClient
    from kvring.common.chunk import ChunkItem
    from kvring.common.tls import ClusterCredentials

    proc = subprocess.Popen([*KVRING, "up", "--nodes", "2", "--memory", "64MiB"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200", "TMPDIR": str(tmp_path)})
    lines = []
    try:
        while "Press Ctrl-C" not in (line := proc.stdout.readline()):
            assert line, "kvring up exited early:\n" + "".join(lines)
            lines.append(line)
        text = "".join(lines)
        etcd = re.search(r"etcd (127\.0\.0\.1:\d+)", text).group(1)
        nodes = re.findall(r"admin (https://127\.0\.0\.1:\d+)/metrics", text)
        token_file = re.search(r"--node-token-file (\S+)", text).group(1)
        admin_api = re.search(r"Admin API: (http://127\.0\.0\.1:\d+)", text).group(1)
        admin_auth = {"Authorization": "Bearer " + re.search(r"'Authorization: Bearer (\S+)'", text).group(1)}
        credentials = re.search(r"credentials in (\S+)", text).group(1)
        assert len(nodes) == 2 and token_file.startswith(f"{tmp_path}/kvring-up-")
        assert os.stat(token_file).st_mode & 0o777 == 0o600
        token = Path(token_file).read_text().strip()
        assert len(token) >= 32

        keys = [os.urandom(16) for _ in range(20)]
        with ClusterClient(etcd, tls=ClusterCredentials.at(credentials)) as client:
            assert client.wait_for_nodes(2)
            data = bytes(64)
            assert client.put_many([ChunkItem.of(k, data, [2, 32], "uint8", 8, "kvring/v1/cli") for k in keys]) \
                == [1] * 20
            # A node refuses a flush without the token, or with another: nothing is deleted (over
            # TLS, with the cluster's client certificate, which its guarded endpoints also require).
            member = ClusterCredentials.at(credentials).client_context()
            for headers in ({}, {"Authorization": "Bearer " + "0" * 64}):
                for node in nodes:
                    status, answer = _request(f"{node}/v1/flush", "POST", {"namespace": "kvring/v1/cli"}, headers,
                                              context=member)
                    assert status == 401 and "node token" in answer["error"]
            assert client.lookup(keys) == [True] * 20

            # kvring drain: refused without the token; drains with the file; withdrawn with the
            # variable (the credentials as KVRING_TLS_DIR, as `kvring up` prints them).
            bare = {**{k: v for k, v in os.environ.items() if k != "KVRING_NODE_TOKEN"}, "KVRING_TLS_DIR": credentials}
            refused = subprocess.run([*KVRING, "drain", "--admin", nodes[0]], capture_output=True, text=True,
                                     timeout=60, env=bare)
            assert refused.returncode == 1 and "HTTP 401" in refused.stderr and "node token" in refused.stderr
            done = subprocess.run([*KVRING, "drain", "--admin", nodes[0], "--node-token-file", token_file,
                                   "--wait", "30"], capture_output=True, text=True, timeout=60, env=bare)
            assert done.returncode == 0, done.stdout + done.stderr
            assert f"{nodes[0]} drained" in done.stdout
            undo = subprocess.run([*KVRING, "drain", "--admin", nodes[0], "--cancel"], capture_output=True,
                                  text=True, timeout=60, env={**bare, "KVRING_NODE_TOKEN": token})
            assert undo.returncode == 0, undo.stderr
            assert client.wait_for_nodes(2, timeout=10, exact=True)

            # The admin API that `kvring up` started holds the node token: its flush reaches every node.
            status, answer = _request(f"{admin_api}/v1/namespaces/kvring/v1/cli", "DELETE", headers=admin_auth)
            assert status == 200 and answer["deleted"] == 20 and answer["failed"] == {}, answer
            assert not any(client.lookup(keys))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not os.path.exists(token_file)
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
