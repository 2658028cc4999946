"""Run a kvring cluster on this machine: a local etcd plus node processes on loopback, and
optionally the admin API.

Used by ``kvring up``, the benchmarks and the tests.  Every process is started in its own
process group and stopped (SIGTERM, then SIGKILL) on ``close()``, so nothing is left behind.

Each cluster has a node token of its own (``LocalCluster.node_token``, random unless given),
written to ``node_token_file`` (mode 0600, beside the TLS credentials when there are any) and
given to its nodes and its admin API with ``--node-token-file``: a node's flush, drain, key
queries and fault injection need it (``cachenode/http.py``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvring.common.contract import Contract
from kvring.common.records import split_data_addr
from kvring.common.tls import ClusterCredentials, generate

logger = logging.getLogger(__name__)
_LOG_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")  # in a log line's prefix


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_etcd() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise FileNotFoundError(
            "the etcd binary was not found; install it (Debian: `apt-get install etcd-server`) or pass "
            "--etcd host:port of a running etcd")
    return path


def stop_process_group(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM the process group ``proc`` leads; SIGKILL it if ``proc`` has not exited after ``timeout``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class LocalEtcd:
    """A throw-away etcd server on free loopback ports with a temporary data dir."""

    def __init__(self) -> None:
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = tempfile.mkdtemp(prefix="kvring-etcd-")
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 15.0) -> LocalEtcd:
        url = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [find_etcd(), "--name", "kvring", "--data-dir", self.data_dir,
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvring={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode} at start")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"etcd did not become healthy within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


@dataclass
class NodeProcess:
    """One ``kvring node`` child process."""

    node_id: str
    memory: int
    etcd: str
    cluster: str = "default"
    lease_ttl: int = 10
    contract: Contract = field(default_factory=Contract)
    extra: list[str] = field(default_factory=list)
    data_port: int = 0
    admin_port: int = 0
    disk_dir: str | None = None  # its disk tier's directory (kept over restarts), with ``disk_capacity``
    disk_capacity: int = 0
    proc: subprocess.Popen | None = None
    _drainer: threading.Thread | None = None
    data_addr: str = ""
    admin_addr: str = ""
    output_bytes: int = 0  # what the node has written to stdout/stderr (its log) so far

    def command(self) -> list[str]:
        c = self.contract
        return [sys.executable, "-P", "-m", "kvring.cli", "node", "--node-id", self.node_id,
                "--memory", str(self.memory), "--etcd", self.etcd, "--cluster", self.cluster,
                "--lease-ttl", str(self.lease_ttl), "--data-port", str(self.data_port),
                "--admin-port", str(self.admin_port), "--chunk-size", str(c.chunk_size),
                "--vnodes", str(c.vnodes), "--replication", str(c.replication),
                *(("--disk-dir", self.disk_dir, "--disk-capacity", str(self.disk_capacity)) if self.disk_dir else ()),
                *self.extra]

    def start(self, timeout: float = 20.0, wait: bool = True) -> NodeProcess:
        env = dict(os.environ)
        # A fixed mmap threshold makes glibc return freed chunk buffers to the OS at once,
        # so the node's RSS follows its stored bytes instead of its high-water mark.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True, text=True)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait for the node's READY line; a node that exits, does not get ready in time or says
        something else is killed before the error is raised, so that no caller leaks it."""
        try:
            self._read_ready(timeout)
        except BaseException:
            self.kill()
            raise

    def _read_ready(self, timeout: float) -> None:
        """Read the node's output up to its READY line, never past ``timeout``: the pipe is read
        raw behind a poll, so that a node that hangs before its first line cannot hang us."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        lines: list[str] = []
        pending = b""
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                break
            data = os.read(fd, 65536)
            if not data:
                code = self.proc.wait()
                raise RuntimeError(f"node {self.node_id} exited (code {code}):\n" + "".join(lines)
                                   + pending.decode(errors="replace"))
            self.output_bytes += len(data)
            *complete, pending = (pending + data).split(b"\n")
            for i, raw in enumerate(complete):
                line = raw.decode(errors="replace")
                lines.append(line + "\n")
                if line.startswith("READY "):
                    self._ready(line, after=[b.decode(errors="replace") for b in [*complete[i + 1:], pending] if b])
                    return
        raise TimeoutError(f"node {self.node_id} not ready within {timeout}s:\n" + "".join(lines))

    def _ready(self, line: str, after: list[str]) -> None:
        """Take the addresses off the READY line; log the lines read after it, and keep draining
        the output so the child never blocks on a full pipe."""
        fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
        if "data" not in fields or "admin" not in fields:
            raise RuntimeError(f"node {self.node_id} said READY without its addresses: {line}")
        self.data_addr, self.admin_addr = fields["data"], fields["admin"]
        for rest in after:
            logger.debug("[%s] %s", self.node_id, rest)
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output_bytes += len(line.encode())
            logger.debug("[%s] %s", self.node_id, line.rstrip())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, no goodbye: the node's lease has to run out."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._release()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
        self._release()

    def _release(self) -> None:
        if self._drainer is not None:
            self._drainer.join(2)
            self._drainer = None
        if self.proc is not None and self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()


@dataclass
class AdminProcess:
    """A ``kvring admin`` child process on loopback; the token travels in its environment, the
    node token in a file (``--node-token-file``), the cluster's credentials in ``tls_dir``."""

    etcd: str
    cluster: str = "default"
    port: int = 0
    token: str | None = None
    node_token_file: Path | None = None
    tls_dir: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> AdminProcess:
        self.port = self.port or free_port()
        env = dict(os.environ)
        env.pop("KVRING_ADMIN_TOKEN", None)
        if self.token:
            env["KVRING_ADMIN_TOKEN"] = self.token
        credentials = [*(("--node-token-file", str(self.node_token_file)) if self.node_token_file else ()),
                       *(("--tls-dir", str(self.tls_dir)) if self.tls_dir else ())]
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "kvring.cli", "admin", "--etcd", self.etcd, "--cluster", self.cluster,
             "--host", "127.0.0.1", "--port", str(self.port), *credentials],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"kvring admin exited with code {self.proc.returncode}:\n{err}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as r:
                    if r.status == 200:
                        # Keep reading its log so the child never blocks on a full pipe.
                        threading.Thread(target=self._drain_stderr, daemon=True).start()
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"kvring admin did not answer /healthz within {timeout}s")

    def _drain_stderr(self) -> None:
        """Pass the admin's log on at the level of each line (a traceback's lines at the level of
        the line before them), so its warnings and errors reach whoever runs the cluster (with no
        logging set up, as under ``kvring up``, Python prints WARNING and above to stderr)."""
        level = logging.DEBUG
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            found = _LOG_LEVEL.search(line[:80])
            if found:
                level = logging.getLevelName(found.group(1))
            logger.log(level, "[admin] %s", line)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
            if self.proc.stderr is not None:
                self.proc.stderr.close()


class LocalCluster:
    """etcd (started here unless ``etcd`` is given) plus ``nodes`` node processes, and the admin
    API on loopback when ``admin`` is set.  ``node_token``: the token the nodes' admin ports
    require (a fresh random one unless given)."""

    def __init__(self, nodes: int = 3, memory: int = 1 << 30, etcd: str | None = None,
                 cluster: str = "default", lease_ttl: int = 10, contract: Contract | None = None,
                 node_args: list[str] | None = None, admin: bool = False, admin_port: int = 0,
                 admin_token: str | None = None, tls: bool = False, node_token: str | None = None,
                 disk: int = 0, disk_root: str | None = None) -> None:
        self.local_etcd = None if etcd else LocalEtcd()
        self.etcd = etcd or self.local_etcd.endpoint
        self.cluster = cluster
        self.contract = contract or Contract()
        # With ``tls``: fresh cluster credentials in a temporary directory of their own (removed
        # on close); the nodes require them, and clients pass ``self.tls``.
        self.tls: ClusterCredentials | None = None
        if tls:
            self.tls = generate(tempfile.mkdtemp(prefix="kvring-tls-"), cluster)
            node_args = [*(node_args or []), "--tls-dir", str(self.tls.directory)]
        # The node token, in a file only this user can read: beside the credentials, or in a
        # directory of its own (removed on close either way).
        self.node_token = node_token or secrets.token_hex(32)
        self._token_dir = self.tls.directory if self.tls is not None else Path(tempfile.mkdtemp(prefix="kvring-token-"))
        self.node_token_file = self._token_dir / "node-token"
        fd = os.open(self.node_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.node_token + "\n")
        node_args = [*(node_args or []), "--node-token-file", str(self.node_token_file)]
        # With ``disk`` (bytes per node): each node keeps a disk tier in a directory of its own
        # (``disk_root``/node id, kept; without ``disk_root``, under a temporary directory removed on
        # close), kept when a node restarts.
        self.disk = disk
        self._disk_root = (disk_root or tempfile.mkdtemp(prefix="kvring-disk-")) if disk else None
        self._disk_temporary = bool(disk) and disk_root is None
        self.nodes = [NodeProcess(f"node-{i}", memory, self.etcd, cluster, lease_ttl, self.contract,
                                  list(node_args), **self._disk_of(f"node-{i}")) for i in range(nodes)]
        self.admin = AdminProcess(self.etcd, cluster, admin_port, admin_token, self.node_token_file,
                                  self.tls.directory if self.tls is not None else None) if admin else None

    def start(self) -> LocalCluster:
        try:
            if self.local_etcd is not None:
                self.local_etcd.start()
            for node in self.nodes:
                node.start(wait=False)
            for node in self.nodes:
                node.wait_ready()
            if self.admin is not None:
                self.admin.start()
        except BaseException:
            self.close()
            raise
        return self

    def connector(self, **extra) -> dict:
        """The connector settings (``kv_connector_extra_config``) that point a vLLM instance at this
        cluster, with its credentials when it runs TLS; ``extra`` adds more (``load_mode``, ...)."""
        tls = {"tls_dir": str(self.tls.directory)} if self.tls is not None else {}
        return {"etcd": self.etcd, "cluster": self.cluster, **tls, **extra}

    @property
    def admin_tls(self) -> ssl.SSLContext | None:
        """The client context for the nodes' admin ports (HTTPS, with ``tls``; the credentials as
        they are now), or None."""
        return self.tls.client_context() if self.tls is not None else None

    @property
    def node_auth(self) -> dict[str, str]:
        """The HTTP header a request to a node's guarded admin endpoints needs."""
        return {"Authorization": f"Bearer {self.node_token}"}

    def _disk_of(self, node_id: str) -> dict:
        if self._disk_root is None:
            return {}
        return {"disk_dir": os.path.join(self._disk_root, node_id), "disk_capacity": self.disk}

    def add_node(self, memory: int | None = None) -> NodeProcess:
        first = self.nodes[0]
        node_id = f"node-{len(self.nodes)}"
        node = NodeProcess(node_id, memory or first.memory, self.etcd, self.cluster,
                           first.lease_ttl, self.contract, list(first.extra), **self._disk_of(node_id))
        self.nodes.append(node.start())
        return node

    def restart_empty(self, index: int, timeout: float = 30.0) -> NodeProcess:
        """SIGKILL node ``index`` and start it again under its id, on the same ports (what a
        container restart does): empty, unless it has a disk tier, whose directory it keeps.
        Returns the new process, which also replaces it in ``nodes``."""
        return self.restart(index, graceful=False, timeout=timeout)

    def restart(self, index: int, graceful: bool = True, timeout: float = 30.0) -> NodeProcess:
        """Stop node ``index`` (SIGTERM, or SIGKILL unless ``graceful``) and start it again under
        its id, on the same ports and with the same disk directory."""
        old = self.nodes[index]
        if graceful:
            old.stop()
        else:
            old.kill()
        new = NodeProcess(old.node_id, old.memory, self.etcd, self.cluster, old.lease_ttl, self.contract,
                          list(old.extra), data_port=split_data_addr(old.data_addr)[1],
                          admin_port=int(old.admin_addr.rpartition(":")[2]), disk_dir=old.disk_dir,
                          disk_capacity=old.disk_capacity)
        self.nodes[index] = new.start(timeout=timeout)
        return new

    def etcd_run(self, fn):
        """Run ``await fn(etcd)`` against this cluster's etcd (an ``Etcd`` of its own), from sync code."""
        import asyncio

        from kvring.membership.etcd import Etcd
        from kvring.membership.settings import EtcdSettings

        async def run():
            etcd = Etcd(EtcdSettings.parse(self.etcd, cluster=self.cluster))
            try:
                return await fn(etcd)
            finally:
                await etcd.close()
        return asyncio.run(run())

    def close(self) -> None:
        if self.admin is not None:
            self.admin.stop()
        for node in self.nodes:
            node.stop()
        if self.local_etcd is not None:
            self.local_etcd.close()
        shutil.rmtree(self._token_dir, ignore_errors=True)  # the credentials' directory, if there are any
        if self._disk_temporary:
            shutil.rmtree(self._disk_root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
