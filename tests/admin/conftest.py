"""The admin API as it runs: a real ``kvring admin`` process serving over loopback, against the
session's real etcd and real node processes.

``admin_server(cluster, ...)`` starts one (module scope: stopped when the module's tests are
done, or earlier by ``stop()``), waits until it answers ``/healthz`` and returns an
``AdminServer``: its URL, its pid (to read its memory from ``/proc``) and its log (stderr, kept
in a file).  Started for a ``LocalCluster`` it gets that cluster's node token file, as ``kvring
up`` gives it (``node_token=False``: none)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from polling import wait_for

from kvring.local.cluster import LocalCluster, free_port, stop_process_group

TOKEN = "test-token-0123456789abcdef"


@dataclass
class AdminServer:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def memory(self, field: str = "VmRSS") -> int:
        """The server process's ``VmRSS`` (or ``VmHWM``, its peak) in bytes, from ``/proc``."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")

    def stop(self) -> None:
        stop_process_group(self.proc, timeout=10)


def _start(etcd: str, cluster: str, log_path: Path, token: str | None, extra: tuple[str, ...]) -> AdminServer:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("KVRING_ADMIN_TOKEN", "KVRING_NODE_TOKEN")}
    if token:
        env["KVRING_ADMIN_TOKEN"] = token
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "kvring.cli", "admin", "--etcd", etcd, "--cluster",
                                 cluster, "--host", "127.0.0.1", "--port", str(port), *extra],
                                stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
    server = AdminServer(proc, f"http://127.0.0.1:{port}", log_path)

    def healthy() -> bool:
        assert proc.poll() is None, f"kvring admin exited with {proc.returncode}:\n{server.log()}"
        try:
            return httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False
    try:
        wait_for(healthy, 60, "kvring admin answering /healthz", interval=0.1)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory):
    """``admin_server(cluster_or_etcd, *extra_cli_args, cluster=None, token=TOKEN, node_token=True)``
    -> ``AdminServer``."""
    started: list[AdminServer] = []
    logs = tmp_path_factory.mktemp("admin-logs")

    def start(where: LocalCluster | str, *extra: str, cluster: str | None = None,
              token: str | None = TOKEN, node_token: bool = True) -> AdminServer:
        etcd = where.etcd if isinstance(where, LocalCluster) else where
        name = cluster or (where.cluster if isinstance(where, LocalCluster) else "default")
        if node_token and isinstance(where, LocalCluster):
            extra = ("--node-token-file", str(where.node_token_file), *extra)
        server = _start(etcd, name, logs / f"admin-{len(started)}.log", token, extra)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
