"""A new user's first contact with the command line, through the real CLI (subprocesses, real etcd,
real nodes): every mistake ends in one line on stderr and a non-zero exit, never a traceback;
``kvring up`` stops at once when etcd cannot be reached; SIGHUP (the terminal closed), SIGTERM
and Ctrl-C stop every child and remove every temporary file of ``kvring up`` and of a benchmark;
the admin's ``/docs`` needs no CDN.  (``--version`` and the help texts: ``test_cli.py``.)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from kvring.local.cluster import free_port

KVRING = [sys.executable, "-P", "-m", "kvring.cli"]  # -P: see scripts/setup.sh
TRACE = '{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]}\n'


def kvring_run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*KVRING, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def assert_one_clear_error(out: subprocess.CompletedProcess, *expected: str) -> str:
    """A non-zero exit, at most three lines on stderr, no traceback, and ``expected`` in the message."""
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 3, out.stderr
    assert lines[-1].startswith("kvring: error: "), out.stderr
    for text in expected:
        assert text in out.stderr, (text, out.stderr)
    return out.stderr


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """What a new user might hand ``kvring trace`` by mistake."""
    (tmp_path / "garbage.jsonl").write_text("this is not JSON\n")
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "fields.jsonl").write_text('{"time": 0, "prompt": [1, 2]}\n')
    (tmp_path / "types.jsonl").write_text(TRACE + '{"timestamp": 1, "input_length": "long", "hash_ids": []}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "a-directory").mkdir()
    return tmp_path


@pytest.mark.parametrize("args, expected", [
    (["trace", "garbage.jsonl"], ["garbage.jsonl, line 1 is not a JSON object", '"hash_ids"']),
    (["trace", "binary.jsonl"], ["binary.jsonl is a binary file, not a trace", "one JSON object per line"]),
    (["trace", "fields.jsonl"], ["fields.jsonl, line 1", "missing required field `timestamp`"]),
    (["trace", "types.jsonl"], ["types.jsonl, line 2", "$.input_length"]),
    (["trace", "empty.jsonl"], ["empty.jsonl holds no requests"]),
    (["trace", "a-directory"], ["a-directory", "is a directory", "kvring trace --help"]),
    (["trace", "no-such-file.jsonl"], ["no-such-file.jsonl", "does not exist"]),
    (["trace", "empty.jsonl", "--limit", "0"], ["--limit"]),
])
def test_a_file_that_is_not_a_trace_is_one_line(files, args, expected):
    assert_one_clear_error(kvring_run(*args, cwd=files), *expected)


@pytest.mark.parametrize("args, expected", [
    (["up", "--memory", "0"], ["--memory", "must be positive", "kvring up --help"]),
    (["up", "--memory", "lots"], ["--memory", "4GiB"]),
    (["up", "--nodes", "0"], ["--nodes"]),
    (["up", "--admin-port", "70000"], ["--admin-port", "65535"]),
    (["up", "--bogus"], ["No such option: --bogus"]),
    (["bogus"], ["No such command 'bogus'"]),
    (["ring", "--etcd", "garbage"], ["--etcd", "'garbage' is not host:port"]),
    (["ring", "--etcd", "127.0.0.1:2379", "--tls-dir", "/no/such/dir"], ["--tls-dir", "/no/such/dir", "does not exist"]),
    (["node", "--node-id", "n", "--etcd", "127.0.0.1:2379", "--memory", "0"], ["--memory", "must be positive"]),
    (["node", "--node-id", "n", "--etcd", "127.0.0.1:2379", "--data-port", "99999"], ["--data-port", "65535"]),
    (["node", "--node-id", "n", "--etcd", "127.0.0.1:2379", "--chunk-size", "0"], ["--chunk-size"]),
    (["node", "--node-id", "n", "--etcd", "127.0.0.1:2379", "--policy", "biggest"], ["eviction policy 'biggest'"]),
    (["node", "--node-id", "n/1", "--etcd", "127.0.0.1:2379"], ["node id 'n/1'"]),
    (["node", "--node-id", "n", "--etcd", "127.0.0.1:2379", "--disk-dir", "/tmp/x", "--disk-capacity", "1GiB",
      "--disk-eviction", "lru"], ["--disk-eviction must be one of second-chance, fifo"]),
    (["node", "--node-id", "n", "--etcd", "nohost"], ["--etcd", "'nohost' is not host:port"]),
    (["node", "--node-id", "n", "--etcd", "127.0.0.1:2379", "--tls-dir", "/no/such/dir"], ["--tls-dir"]),
    (["node", "--etcd", "127.0.0.1:2379"], ["Missing option '--node-id'"]),
    (["admin", "--etcd", "garbage"], ["--etcd", "'garbage' is not host:port"]),
    (["admin", "--etcd", "127.0.0.1:2379", "--port", "99999"], ["--port", "65535"]),
    (["drain"], ["give either --admin URL"]),
    (["drain", "--etcd", "127.0.0.1:2379"], ["--etcd needs --node"]),
    (["demo", "--layers", "0"], ["--layers"]),
    (["demo", "--mode", "fastest"], ["--mode", "layerwise or bulk"]),
    (["bench", "data-plane", "--nodes", "one"], ["--nodes", "comma-separated"]),
    (["bench", "data-plane", "--peers", "memcached"], ["unknown peers ['memcached']"]),
    (["bench", "e2e", "--tokens", "100"], ["--tokens", "at least 300 tokens"]),
    (["bench", "e2e", "--memory", "0"], ["--memory", "must be positive"]),
    (["bench", "e2e", "--tp", "3"], ["--tp", "4 KV heads, which 3 ranks cannot split"]),
    (["bench", "miss", "--omp-bind", "all"], ["--omp-bind"]),
    (["bench", "repair", "--chunk-bytes", "lots"], ["--chunk-bytes", "4GiB"]),
    (["bench", "slow-node", "--stop-ms", "0"], ["--stop-ms"]),
    (["bench", "tls", "--repetitions", "0"], ["--repetitions"]),
    (["bench", "membership", "--clients", "0"], ["--clients"]),
])
def test_a_bad_flag_is_one_line(args, expected):
    out = kvring_run(*args)
    assert_one_clear_error(out, *expected)
    assert out.returncode == 2  # a usage mistake


@pytest.mark.parametrize("command", [["ring"], ["up"], ["trace", "TRACE"], ["bench", "data-plane"],
                                     ["drain", "--node", "node-0"]])
def test_an_etcd_that_cannot_be_reached_is_one_line_naming_it(command, tmp_path):
    (tmp_path / "trace.jsonl").write_text(TRACE)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    args = [str(tmp_path / "trace.jsonl") if a == "TRACE" else a for a in command]
    started = time.monotonic()
    out = kvring_run(*args, "--etcd", dead)
    assert time.monotonic() - started < 30
    assert_one_clear_error(out, f"cannot reach etcd at {dead} (connection refused)", "--etcd")
    assert out.returncode == 1


def test_a_node_that_cannot_be_reached_for_a_drain_is_one_line():
    assert_one_clear_error(kvring_run("drain", "--admin", "not-a-url"), "--admin must be an http(s) URL")
    dead = f"http://127.0.0.1:{free_port()}"
    assert_one_clear_error(kvring_run("drain", "--admin", dead), f"cannot reach the node's admin port at {dead}")


@pytest.mark.parametrize("command, flag", [(["node", "--node-id", "n", "--etcd", "127.0.0.1:2379"], "--data-port"),
                                           (["node", "--node-id", "n", "--etcd", "127.0.0.1:2379"], "--admin-port"),
                                           (["admin", "--etcd", "127.0.0.1:2379"], "--port"),
                                           (["up", "--nodes", "1"], "--admin-port")])
def test_a_port_in_use_is_one_line(command, flag):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = kvring_run(*command, flag, str(port))
    assert_one_clear_error(out, f"cannot serve on 127.0.0.1:{port}", "in use", f"choose another {flag}")


def test_an_address_not_of_this_machine_is_one_line():
    assert_one_clear_error(kvring_run("admin", "--etcd", "127.0.0.1:2379", "--host", "192.0.2.1"),
                           "192.0.2.1 is not an address of this machine; check --host")


def test_the_operator_without_kubernetes_credentials_is_one_line(tmp_path):
    """Outside a cluster and without a usable kubeconfig, `kvring operator` stops at once (kopf would
    retry every minute, each time with a traceback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    out = subprocess.run([*KVRING, "operator"], capture_output=True, text=True, timeout=60,
                         env={**env, "KUBECONFIG": str(tmp_path / "no-such-kubeconfig")})
    assert_one_clear_error(out, "no Kubernetes credentials", "no-such-kubeconfig", "KUBECONFIG")


def test_an_unknown_host_is_one_line_naming_it():
    out = kvring_run("ring", "--etcd", "no-such-host.invalid:2379")
    assert_one_clear_error(out, "cannot reach etcd at no-such-host.invalid:2379 (unknown host name)")


def test_up_without_etcd_stops_at_once_and_leaves_nothing(tmp_path):
    """`kvring up --etcd` with nothing at that address: one line naming etcd within seconds, not
    "the cluster is up" and a wait forever; no node, no admin, no temporary file."""
    dead = f"127.0.0.1:{free_port()}"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    started = time.monotonic()
    out = kvring_run("up", "--etcd", dead, "--nodes", "2", "--memory", "64MiB", env={"TMPDIR": str(scratch)},
                     timeout=30)
    assert time.monotonic() - started < 30
    assert_one_clear_error(out, f"cannot reach etcd at {dead}")
    assert "is up" not in out.stdout
    assert list(scratch.iterdir()) == []
    started_with_it = [p.info for p in psutil.process_iter(["pid", "cmdline"]) if dead in " ".join(p.info["cmdline"] or [])]
    assert started_with_it == []


def test_verbose_shows_the_traceback_of_an_error(files):
    out = kvring_run("-v", "trace", "garbage.jsonl", cwd=files)
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "TraceFileError" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("kvring: error: garbage.jsonl, line 1")


def _up(tmp: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """``kvring up`` in a session of its own (as a terminal's job is), TMPDIR at ``tmp``; returns once it is up."""
    proc = subprocess.Popen([*KVRING, "up", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True)
    lines = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "kvring up exited early:\n" + "".join(lines) + proc.stderr.read()
        lines.append(line)
        if "Press Ctrl-C" in line:
            return proc, "".join(lines)
    proc.kill()
    raise AssertionError("kvring up did not come up:\n" + "".join(lines))


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_up_stopped_by_a_signal_leaves_no_process_and_no_file(sig, tmp_path):
    """Closing the terminal (SIGHUP) stops `kvring up` as Ctrl-C and SIGTERM do: etcd, the nodes and the
    admin API are stopped (their pids are gone) and etcd's data and the credentials are removed."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc, text = _up(scratch, "--nodes", "2", "--memory", "64MiB")
    children: list[psutil.Process] = []
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        names = sorted(c.name() for c in children)
        assert "etcd" in names and len(children) >= 4, names  # etcd, two nodes, the admin API
        assert [p.name for p in scratch.iterdir()][0].startswith("kvring-up-")
        assert str(scratch) in text  # the credentials printed for vLLM live in the run's directory
        proc.send_signal(sig)
        assert proc.wait(30) == 0
        assert proc.stdout.read().strip().endswith("stopped.")
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"still running after {sig.name}: {alive}"
        assert list(scratch.iterdir()) == []
    finally:
        _kill_what_is_left(proc, children)
        proc.stdout.close()
        proc.stderr.close()


def test_a_benchmark_stopped_by_sighup_leaves_no_process_and_no_file(tmp_path):
    """The same run directory and signal handling serve the benchmarks: `kvring bench tls` (etcd, a plain
    node and a TLS node with generated credentials) stopped mid-run by SIGHUP."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([*KVRING, "bench", "tls", "--repetitions", "1000"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(scratch)},
                            start_new_session=True)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while len(children) < 3 and time.monotonic() < deadline:  # etcd and both nodes
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
            children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3
        time.sleep(2)  # into the measurement
        children = psutil.Process(proc.pid).children(recursive=True)
        run_dirs = list(scratch.iterdir())
        assert [d.name[:len("kvring-bench-tls-")] for d in run_dirs] == ["kvring-bench-tls-"]
        assert any(p.name.startswith("kvring-tls-") for p in run_dirs[0].iterdir())  # the generated credentials
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(30) == 128 + signal.SIGHUP
        assert proc.stderr.read().strip().splitlines()[-1] == "kvring: stopped by SIGHUP"
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"still running after SIGHUP: {alive}"
        assert list(scratch.iterdir()) == []
    finally:
        _kill_what_is_left(proc, children)
        proc.stderr.close()


def _kill_what_is_left(proc: subprocess.Popen, children: list[psutil.Process]) -> None:
    """After a failed stop: the run and the children it started in sessions of their own, killed and
    reaped, so that no process outlives the test that failed."""
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_admin_docs_load_nothing_from_another_host(etcd_server):
    """A real `kvring admin`: /docs and /redoc reference scripts and styles the admin serves itself."""
    port = free_port()
    proc = subprocess.Popen([*KVRING, "admin", "--etcd", etcd_server.endpoint, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        for page in ("/docs", "/redoc"):
            with urllib.request.urlopen(base + page, timeout=10) as r:
                html = r.read().decode()
            assert r.status == 200
            assets = re.findall(r"""<(?:script|link)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", html)
            assert len(assets) >= (3 if page == "/docs" else 2), html  # the script, the stylesheet, the icon
            for url in assets:
                assert not re.match(r"(?i)(https?:)?//", url), f"{page} loads {url} from another host"
                with urllib.request.urlopen(base + url, timeout=10) as r:
                    assert r.status == 200 and len(r.read()) > 1000, url
            hosts = set(re.findall(r"(?i)\b(?:https?:)?//([a-z0-9.-]+\.[a-z]{2,})", html))
            assert hosts == set(), f"{page} names other hosts: {hosts}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
