"""A node's admin port under the cluster's node token (real etcd, real node processes): flush,
key presence, drain and fault injection need ``Authorization: Bearer <node token>`` from every
address, loopback included; without it, or with a made-up one, they are refused and change
nothing; the read-only probes stay open; a node without a token refuses them all."""

from __future__ import annotations

import functools
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.local.cluster import NodeProcess

MADE_UP = "0123456789abcdef" * 4  # a well-formed token that is not the cluster's


def _http(url: str, method: str = "GET", body: dict | None = None, token: str | None = None,
          header: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, dict | bytes, dict]:
    """(status, JSON body or raw bytes, headers) of one request; ``header``: a raw Authorization;
    ``context``: the TLS client context of an ``https://`` node."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if header is not None:
        headers["Authorization"] = header
    data = json.dumps(body).encode() if body is not None else (b"" if method != "GET" else None)
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as resp:
            status, raw, got = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        status, raw, got = exc.code, exc.read(), dict(exc.headers)
    try:
        return status, json.loads(raw), got
    except ValueError:
        return status, raw, got


def _chunks(node, context: ssl.SSLContext | None = None) -> int:
    return _http(f"{node.admin_addr}/stats", context=context)[1]["chunks"]


def _guarded_requests(keys: list[bytes]) -> list[tuple[str, str, dict | None]]:
    return [("POST", "/v1/flush", {"namespace": "tenant"}),
            ("POST", "/v1/present", {"keys": [k.hex() for k in keys]}),
            ("POST", "/drain", None),
            ("DELETE", "/drain", None),
            ("POST", "/debug/stall?seconds=0", None),
            ("POST", "/debug/signal-on-get?signal=SIGSTOP", None)]


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "no-tls"])
def test_guarded_endpoints_refuse_without_the_node_token_and_work_with_it(cluster_factory, tls):
    cluster = cluster_factory(nodes=2, tls=tls, node_args=["--fault-injection"])
    http = functools.partial(_http, context=cluster.admin_tls)  # over TLS, with the cluster's certificate
    keys = [os.urandom(16) for _ in range(20)]
    data = np.arange(64, dtype=np.uint8)
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls) as client:
        assert client.wait_for_nodes(2)
        assert client.put_many([ChunkItem.of(k, data, [2, 32], "uint8", 8, "tenant") for k in keys]) == [1] * 20
        held = {n.node_id: _chunks(n, cluster.admin_tls) for n in cluster.nodes}
        assert sum(held.values()) == 20

        # From loopback, without a token, with a made-up one, or not as a bearer token: 401, one
        # line of JSON, and nothing changes.
        for node in cluster.nodes:
            for method, path, body in _guarded_requests(keys):
                for auth in ({}, {"token": MADE_UP}, {"token": ""}, {"header": f"Basic {cluster.node_token}"},
                             {"header": cluster.node_token}):
                    status, answer, headers = http(node.admin_addr + path, method, body, **auth)
                    assert status == 401, (node.node_id, method, path, auth, answer)
                    assert list(answer) == ["error"] and "node token" in answer["error"], answer
                    assert "\n" not in answer["error"] and headers.get("WWW-Authenticate") == "Bearer"
            assert _chunks(node, cluster.admin_tls) == held[node.node_id]
            assert http(f"{node.admin_addr}/drain")[1]["state"] == "active"
        assert client.lookup(keys) == [True] * 20

        # The read-only probes stay open.
        for node in cluster.nodes:
            for path in ("/healthz", "/readyz", "/metrics", "/stats", "/drain"):
                assert http(node.admin_addr + path)[0] == 200, path

        # The cluster's token works: presence, drain and its withdrawal, flush.
        token = cluster.node_token
        for node in cluster.nodes:
            status, answer, _ = http(f"{node.admin_addr}/v1/present", "POST", {"keys": [k.hex() for k in keys]},
                                     token=token)
            assert status == 200 and sum(answer["present"]) == held[node.node_id]
        node = cluster.nodes[0]
        status, answer, _ = http(f"{node.admin_addr}/drain", "POST", token=token)
        assert status == 202 and answer["requested_by"] == ["http"]
        status, answer, _ = http(f"{node.admin_addr}/drain", "DELETE", token=token)
        assert status == 200 and answer["requested_by"] == []
        assert client.wait_for_nodes(2, timeout=10, exact=True)
        deleted = 0
        for node in cluster.nodes:
            status, answer, _ = http(f"{node.admin_addr}/v1/flush", "POST", {"namespace": "tenant"}, token=token)
            assert status == 200
            deleted += answer["deleted"]
        assert deleted == 20 and not any(client.lookup(keys))
        # Fault injection answers with the token (it is on in this cluster).
        assert http(f"{node.admin_addr}/debug/stall?seconds=0", "POST", token=token)[0] == 202


def test_a_node_without_a_token_refuses_every_guarded_endpoint(etcd_server, monkeypatch):
    monkeypatch.delenv("KVRING_NODE_TOKEN", raising=False)
    node = NodeProcess("lone", 16 << 20, etcd_server.endpoint, "auth-no-token", extra=["--fault-injection"]).start()
    try:
        for method, path, body in _guarded_requests([os.urandom(16)]):
            for token in (None, MADE_UP):
                status, answer, _ = _http(node.admin_addr + path, method, body, token=token)
                assert status == 403, (method, path, answer)
                assert "--node-token-file" in answer["error"] and "KVRING_NODE_TOKEN" in answer["error"]
        assert _http(f"{node.admin_addr}/drain")[1]["state"] == "active"
        for path in ("/healthz", "/readyz", "/metrics", "/stats", "/drain"):
            assert _http(node.admin_addr + path)[0] == 200, path
    finally:
        node.stop()


def test_the_token_can_come_from_the_environment(etcd_server, monkeypatch):
    token = "env-token-" + "9" * 30
    monkeypatch.setenv("KVRING_NODE_TOKEN", token)
    node = NodeProcess("env", 16 << 20, etcd_server.endpoint, "auth-env").start()
    try:
        assert _http(f"{node.admin_addr}/v1/flush", "POST", {"namespace": "x"}, token=MADE_UP)[0] == 401
        assert _http(f"{node.admin_addr}/v1/flush", "POST", {"namespace": "x"}, token=token)[:2] == (200, {"deleted": 0})
    finally:
        node.stop()


@pytest.mark.parametrize(("content", "says"), [
    ("short", "at least 32 printable ASCII characters without spaces"),
    ("has a space " + "x" * 40, "at least 32 printable ASCII characters without spaces"),
    ("", "is empty"),
])
def test_a_bad_token_stops_the_node_with_one_line(etcd_server, tmp_path, content, says):
    path = tmp_path / "token"
    path.write_text(content)
    out = subprocess.run([sys.executable, "-P", "-m", "kvring.cli", "node", "--node-id", "bad", "--etcd",
                          etcd_server.endpoint, "--node-token-file", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert says in line
    if content:
        assert content not in line  # the token itself is never echoed
