"""The authenticated, encrypted data plane (real etcd, real node processes, real TLS): only peers
holding the cluster's credentials reach the protocol, and no chunk byte crosses in plain text."""

from __future__ import annotations

import socket
import threading
import urllib.request

import numpy as np
import pytest
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.client.transport import Exchange, Links, Reply, next_rid
from kvring.common import protocol as P
from kvring.common.chunk import ChunkItem
from kvring.common.errors import NodeUnavailable
from kvring.common.tls import generate

PATTERN = b"kvring-secret-kv-" * 4  # a run of bytes no TLS record carries by chance


def _payload(size: int) -> bytes:
    """Random bytes with the pattern every 4 KiB: any plain-text stretch of it shows."""
    data = bytearray(np.random.default_rng(3).bytes(size))
    for at in range(0, size - len(PATTERN), 4096):
        data[at:at + len(PATTERN)] = PATTERN
    return bytes(data)


def _stats(cluster, node) -> dict:
    import json
    with urllib.request.urlopen(f"{node.admin_addr}/stats", timeout=5, context=cluster.admin_tls) as r:
        return json.loads(r.read())


@pytest.fixture
def tls_cluster(cluster_factory):
    return cluster_factory(nodes=2, tls=True)


def test_a_client_with_the_credentials_reads_and_writes_everything(tls_cluster):
    data = _payload(3 << 20)
    with ClusterClient(tls_cluster.etcd, cluster=tls_cluster.cluster, tls=tls_cluster.tls) as client:
        assert client.wait_for_nodes(2)
        keys = [b"tls-%d" % i for i in range(6)]
        assert client.put_many([ChunkItem.of(k, data, (4, len(data) // 4), "uint8", 256) for k in keys]) == [1] * 6
        assert all(bytes(c.data) == data for c in client.get(keys))
        assert client.lookup(keys + [b"absent"]) == [True] * 6 + [False]
        streamed = b"".join(bytes(b.views[0]) for b in client.iter_layers(keys[:1]))
        assert streamed == data
        assert client.delete(keys[:2]) == 2
        assert all(s["tls"] and s["tls_refused"] == 0 for s in client.stats().values())


def _refused(data_addr: str, message: bytes) -> bytes:
    """Send one framed request over plain TCP; what came back before the node hung up."""
    host, _, port = data_addr.removeprefix("tcp://").rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(message)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        return got


def test_a_peer_without_credentials_gets_every_operation_refused_and_counted(tls_cluster):
    from kvring.cachenode.framing import MAGIC, pack

    node = tls_cluster.nodes[0]
    with ClusterClient(tls_cluster.etcd, cluster=tls_cluster.cluster, tls=tls_cluster.tls) as client:
        assert client.wait_for_nodes(2)
        key = b"guarded"
        client.put(key, b"x" * 4096, (1, 4096), "uint8", 16, namespace="tenant")
        held_by = client.locate([key])[0]
        before = _stats(tls_cluster, node)["tls_refused"]
        meta = ChunkItem.of(b"poison", b"p" * 4096, (1, 4096), "uint8", 16).meta
        requests = {
            "PUT": pack(P.encode(P.Put(rid=1, key=b"poison", meta=meta)), [b"p" * 4096]),
            "GET": pack(P.encode(P.Get(rid=2, keys=[key]))),
            "LOOKUP": pack(P.encode(P.Lookup(rid=3, keys=[key]))),
            "DELETE": pack(P.encode(P.Delete(rid=4, keys=[key]))),
            "FLUSH": pack(P.encode(P.Flush(rid=5, namespace="tenant"))),
        }
        for op, frames in requests.items():
            got = _refused(node.data_addr, b"".join(bytes(f) for f in frames))
            assert MAGIC not in got, f"{op}: the node answered {got[:64]!r}"  # at most a TLS alert came back
        wait_for(lambda: _stats(tls_cluster, node)["tls_refused"] - before >= len(requests), 5, "the refusals counted")
        # Nothing happened: the chunk is still there, unchanged, and the poison never landed.
        assert client.locate([key])[0] == held_by
        assert bytes(client.get([key])[0].data) == b"x" * 4096
        assert client.lookup([b"poison"]) == [False]
        with urllib.request.urlopen(f"{node.admin_addr}/metrics", timeout=5, context=tls_cluster.admin_tls) as r:
            assert b"kvring_node_tls_refused_total" in r.read()


def test_a_client_of_another_cluster_is_refused(tls_cluster, tmp_path):
    other = generate(tmp_path / "other", "other")  # a CA of its own: a stranger's credentials
    with ClusterClient(tls_cluster.etcd, cluster=tls_cluster.cluster, tls=other, timeout=2) as client:
        assert client.wait_for_nodes(2)
        with pytest.raises(NodeUnavailable, match="TLS handshake"):
            client.request("node-0", P.Ping(rid=next_rid()))
    with ClusterClient(tls_cluster.etcd, cluster=tls_cluster.cluster, timeout=2) as plain:  # no credentials
        assert plain.wait_for_nodes(2)
        assert all("error" in s for s in plain.stats().values())


class RecordingProxy:
    """A TCP forwarder that keeps every byte it carries, both ways."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()  # each socket is the source of one pump: closed once, by it

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("encrypted", [True, False], ids=["tls", "plain-control"])
def test_a_recording_proxy_between_client_and_node_sees_no_chunk_byte(cluster_factory, encrypted):
    """The client's own transport, pointed at the node through the proxy: PUT then GET a chunk.
    Without TLS (the control) the proxy sees the chunk; with it, not one 64-byte run of it."""
    cluster = cluster_factory(nodes=1, tls=encrypted)
    node = cluster.nodes[0]
    host, _, port = node.data_addr.removeprefix("tcp://").rpartition(":")
    proxy = RecordingProxy((host, int(port)))
    data = _payload(1 << 20)
    item = ChunkItem.of(b"recorded", data, (4, len(data) // 4), "uint8", 256)
    links = Links(connect_timeout=5, buffer_pool_bytes=64 << 20,
                  tls=cluster.tls.client_context if encrypted else None)
    links.update({node.node_id: f"tcp://127.0.0.1:{proxy.port}"})
    try:
        with Exchange(links, timeout=5) as ex:
            ex.request(node.node_id, P.Put(rid=next_rid(), key=item.key, meta=item.meta), [data])
            assert [type(e.msg) for e in ex.events()] == [P.PutReply]
        with Exchange(links, timeout=5) as ex:
            ex.request(node.node_id, P.Get(rid=next_rid(), keys=[item.key]), streamed=True)
            replies = [e for e in ex.events() if isinstance(e, Reply)]
        assert b"".join(bytes(p) for r in replies for p in r.payloads) == data  # it went through the proxy
    finally:
        links.close()
        proxy.close()
    seen = bytes(proxy.seen)
    assert len(seen) > 2 * len(data)  # both directions were recorded
    assert (PATTERN in seen) is (not encrypted)
    leaked = sum(seen.find(data[at:at + 64]) >= 0 for at in range(0, len(data), 64 << 10))
    assert leaked == (0 if encrypted else len(range(0, len(data), 64 << 10)))


def test_a_node_given_incomplete_credentials_refuses_to_start_saying_what_is_missing(tmp_path, etcd_server):
    import subprocess
    import sys

    creds = generate(tmp_path / "creds", "c")
    creds.key.unlink()  # a Secret mounted without its key
    proc = subprocess.run([sys.executable, "-P", "-m", "kvring.cli", "node", "--node-id", "n", "--etcd",
                           etcd_server.endpoint, "--memory", "64MiB", "--tls-dir", str(creds.directory)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    said = " ".join((proc.stdout + proc.stderr).replace("│", " ").split())  # the usage error's box, unwrapped
    assert "lacks tls.key" in said and "Traceback" not in said
