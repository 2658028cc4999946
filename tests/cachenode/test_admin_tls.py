"""A TLS node's admin port (real etcd, real node processes, the real admin API): HTTPS under the
cluster's CA, the guarded endpoints wanting the cluster's client certificate beside the node
token, nothing (the token least of all) in plain text, and every client that asks it -- the admin
API, ``kvring drain`` -- asking over TLS or refusing with one line."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
from polling import wait_for
from test_tls import RecordingProxy

from kvring.cachenode.client import ClusterClient
from kvring.common.tls import CERT_NAME, generate, verifying_context
from kvring.local.cluster import AdminProcess, LocalCluster

KVRING = [sys.executable, "-P", "-m", "kvring.cli"]


@pytest.fixture(scope="module")
def cluster(etcd_server):
    with LocalCluster(nodes=1, memory=64 << 20, etcd=etcd_server.endpoint, cluster="admin-tls", tls=True,
                      admin=True) as c:
        yield c


@pytest.fixture(scope="module")
def ca_only(cluster) -> ssl.SSLContext:
    """What the kubelet's probes and Prometheus hold: the CA at most, no certificate of their own."""
    return verifying_context(cluster.tls.ca.read_bytes())


def _request(url: str, method: str = "GET", body: dict | None = None, *, context: ssl.SSLContext | None,
             headers: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else (b"" if method != "GET" else None)
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _address(node) -> tuple[str, int]:
    """(host, port) of a node's admin port."""
    url = urlsplit(node.admin_addr)
    return url.hostname, url.port


def _put(cluster: LocalCluster, key: bytes, namespace: str) -> None:
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls) as client:
        assert client.wait_for_nodes(1)
        client.put(key, b"k" * 4096, (1, 4096), "uint8", 16, namespace=namespace)


def _held(cluster: LocalCluster, key: bytes) -> bool:
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls) as client:
        assert client.wait_for_nodes(1)
        return client.lookup([key]) == [True]


def test_the_admin_port_serves_https_under_the_cluster_ca_and_answers_no_plain_http(cluster, ca_only, tmp_path):
    node = cluster.nodes[0]
    assert node.admin_addr.startswith("https://127.0.0.1:")
    # The open endpoints answer a client without a certificate (probes, Prometheus) that checks the CA.
    for path in ("/healthz", "/readyz", "/stats", "/metrics"):
        code, body = _request(node.admin_addr + path, context=ca_only)
        assert code == 200, (path, body[:200])
    assert json.loads(_request(node.admin_addr + "/stats", context=ca_only)[1])["node_id"] == node.node_id
    # Plain HTTP gets no HTTP answer: the node only speaks TLS there.
    host, port = _address(node)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"GET /stats HTTP/1.0\r\n\r\n")
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert b"HTTP/1." not in got and b"node_id" not in got
    # Tools that check names (curl, Prometheus) find loopback's address and CERT_NAME in the certificate.
    strict = ssl.create_default_context(cafile=str(cluster.tls.ca))
    assert strict.check_hostname
    assert _request(node.admin_addr + "/healthz", context=strict)[0] == 200  # 127.0.0.1, an IP SAN
    with socket.create_connection((host, port), timeout=5) as sock:
        with strict.wrap_socket(sock, server_hostname=CERT_NAME) as named:
            assert named.version() == "TLSv1.3"
    with socket.create_connection((host, port), timeout=5) as sock:
        with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
            strict.wrap_socket(sock, server_hostname="some-other-name")
    # A client that trusts another CA does not take this node for one of its cluster.
    stranger = verifying_context(generate(tmp_path / "other", "other").ca.read_bytes())
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _request(node.admin_addr + "/healthz", context=stranger)


def test_a_guarded_endpoint_over_tls_needs_the_cluster_certificate_and_the_token(cluster, ca_only, tmp_path):
    node = cluster.nodes[0]
    _put(cluster, b"guarded-key", "tenant-g")
    flush = node.admin_addr + "/v1/flush"
    # The token without a certificate: refused, and said why.
    code, body = _request(flush, "POST", {"namespace": "tenant-g"}, context=ca_only, headers=cluster.node_auth)
    assert code == 401 and "client certificate" in json.loads(body)["error"]
    # The certificate without the token: refused.
    code, body = _request(flush, "POST", {"namespace": "tenant-g"}, context=cluster.admin_tls)
    assert code == 401 and "node token" in json.loads(body)["error"]
    # A certificate of another cluster's CA: the handshake itself fails.
    stranger = generate(tmp_path / "other", "other").client_context()
    stranger.load_verify_locations(cluster.tls.ca)  # it trusts the node, the node does not trust it
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        _request(flush, "POST", {"namespace": "tenant-g"}, context=stranger, headers=cluster.node_auth)
    assert _held(cluster, b"guarded-key")  # nothing of that changed anything
    code, body = _request(flush, "POST", {"namespace": "tenant-g"}, context=cluster.admin_tls,
                          headers=cluster.node_auth)
    assert (code, json.loads(body)) == (200, {"deleted": 1})
    assert not _held(cluster, b"guarded-key")


def test_the_node_token_and_the_answers_cross_the_wire_encrypted(cluster):
    node = cluster.nodes[0]
    host, port = _address(node)
    proxy = RecordingProxy((host, port))
    _put(cluster, b"watched-key", "tenant-w")
    try:
        code, body = _request(f"https://127.0.0.1:{proxy.port}/v1/present", "POST",
                              {"keys": [b"watched-key".hex()]}, context=cluster.admin_tls, headers=cluster.node_auth)
        assert (code, json.loads(body)) == (200, {"present": [True]})  # it went through the proxy
        code, body = _request(f"https://127.0.0.1:{proxy.port}/stats", context=cluster.admin_tls)
        assert code == 200 and b"node_id" in body
    finally:
        proxy.close()
    seen = bytes(proxy.seen)
    assert len(seen) > len(body)
    for secret in (cluster.node_token.encode(), b"Bearer", b"watched-key".hex().encode(), b"node_id", b"/v1/"):
        assert secret not in seen, secret


def test_clients_silent_in_their_handshake_do_not_hold_up_the_probes(cluster, ca_only):
    """A connection that sends nothing, or half a handshake, waits on a thread of its own (and is
    closed after REQUEST_TIMEOUT); the accepting thread goes on serving the probes."""
    node = cluster.nodes[0]
    host, port = _address(node)
    silent = [socket.create_connection((host, port), timeout=5) for _ in range(6)]
    try:
        silent[0].sendall(b"\x16\x03\x01\x02\x00")  # the start of a ClientHello record, and no more
        started = time.monotonic()
        for _ in range(3):
            code, _ = _request(node.admin_addr + "/healthz", context=ca_only)
            assert code == 200
        assert time.monotonic() - started < 5  # answered while all six still hang (each would take 10 s)
    finally:
        for s in silent:
            s.close()


def test_a_flood_of_connections_is_held_to_max_connections_and_the_port_recovers(cluster, ca_only):
    """Past ``MAX_CONNECTIONS`` silent connections, each new one is closed as it arrives (no more
    threads or descriptors); once the flood goes, the probes are answered again at once."""
    from kvring.cachenode.http import MAX_CONNECTIONS

    node = cluster.nodes[0]
    host, port = _address(node)
    flood = [socket.create_connection((host, port), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        def refused() -> bool:
            with socket.create_connection((host, port), timeout=5) as extra:
                try:
                    return extra.recv(1) == b""  # closed by the node, not left waiting
                except ConnectionResetError:
                    return True
        wait_for(refused, 5, "a connection past MAX_CONNECTIONS closed at once")
    finally:
        for s in flood:
            s.close()
    code, _ = wait_for(lambda: _answer(node.admin_addr + "/healthz", ca_only), 5, "the probe answered again")
    assert code == 200


def _answer(url: str, context: ssl.SSLContext) -> tuple[int, bytes] | None:
    try:
        return _request(url, context=context)
    except (urllib.error.URLError, ConnectionError, ssl.SSLError):
        return None


def test_the_admin_api_asks_the_nodes_over_tls(cluster):
    admin = cluster.admin.url
    _put(cluster, b"admin-api-key", "tenant-a")

    def nodes() -> list[dict]:
        with urllib.request.urlopen(f"{admin}/v1/nodes", timeout=10) as r:
            return json.loads(r.read())["nodes"]
    wait_for(lambda: all(n["used"] for n in nodes()), 10, "the nodes' /stats read over TLS")
    assert all(n["error"] is None and n["admin_addr"].startswith("https://") for n in nodes())
    code, body = _request(f"{admin}/v1/keys/{b'admin-api-key'.hex()}/owners", context=None)
    assert code == 200 and json.loads(body)["held_by"] == [cluster.nodes[0].node_id]


def test_an_admin_api_without_the_credentials_says_which_setting_it_lacks(cluster):
    """A `kvring admin` started without --tls-dir for a TLS cluster asks nothing in plain text: it
    lists each node as unreadable and its flush fails there, each saying which setting it lacks."""
    token = "admin-token-" + "a" * 32
    admin = AdminProcess(cluster.etcd, cluster.cluster, token=token, node_token_file=cluster.node_token_file).start()
    try:
        def nodes() -> list[dict]:
            with urllib.request.urlopen(f"{admin.url}/v1/nodes", timeout=10) as r:
                return json.loads(r.read())["nodes"]
        listed = wait_for(lambda: [n for n in nodes() if n["error"]], 10, "the nodes listed with an error")
        assert len(listed) == len(cluster.nodes) and all(n["used"] is None for n in listed)
        assert all("serves its admin port over TLS: give the cluster's credentials (--tls-dir" in n["error"]
                   for n in listed), listed
        code, body = _request(f"{admin.url}/v1/namespaces/tenant-x", "DELETE", context=None,
                              headers={"Authorization": f"Bearer {token}"})
        failed = json.loads(body)["failed"]
        assert code == 502 and set(failed) == {n.node_id for n in cluster.nodes}
        assert all("--tls-dir" in why for why in failed.values()), failed
    finally:
        admin.stop()


def test_kvring_drain_talks_tls_to_a_tls_node_and_refuses_plain_one_way_or_the_other(cluster, tmp_path):
    node = cluster.nodes[0]
    token = ["--node-token-file", str(cluster.node_token_file)]
    without = subprocess.run([*KVRING, "drain", "--admin", node.admin_addr, "--cancel", *token],
                             capture_output=True, text=True, timeout=60)
    assert without.returncode != 0
    said = " ".join((without.stdout + without.stderr).split())
    assert "over TLS: give the cluster's credentials (--tls-dir" in said and "Traceback" not in said
    downgraded = subprocess.run([*KVRING, "drain", "--admin", node.admin_addr.replace("https://", "http://"),
                                 "--cancel", "--tls-dir", str(cluster.tls.directory), *token],
                                capture_output=True, text=True, timeout=60)
    assert downgraded.returncode != 0 and "refusing to send requests unencrypted" in downgraded.stdout + downgraded.stderr
    withdrawn = subprocess.run([*KVRING, "drain", "--admin", node.admin_addr, "--cancel",
                                "--tls-dir", str(cluster.tls.directory), *token],
                               capture_output=True, text=True, timeout=60)
    assert withdrawn.returncode == 0, withdrawn.stdout + withdrawn.stderr
    assert "drain withdrawn: active" in withdrawn.stdout
