"""A node's fault injection (``kvring node --fault-injection``): ``POST /debug/<what>`` on its
admin port, from loopback, with the cluster's node token (and over TLS its client certificate).

Importable as ``faults`` from every test folder (like ``polling``)."""

from __future__ import annotations

import urllib.request

from kvring.local.cluster import LocalCluster, NodeProcess


def inject(cluster: LocalCluster, node: NodeProcess | str, what: str) -> int:
    """``POST /debug/<what>`` (``corrupt?key=<hex>``, ``stall?seconds=8``, ...) on ``node`` (a node
    process of ``cluster``, or its id); the HTTP status, 200 (done) or 202 (armed or begun)."""
    if isinstance(node, str):
        node = next(n for n in cluster.nodes if n.node_id == node)
    request = urllib.request.Request(f"{node.admin_addr}/debug/{what}", method="POST", headers=cluster.node_auth)
    with urllib.request.urlopen(request, timeout=5, context=cluster.admin_tls) as resp:
        assert resp.status in (200, 202), (what, resp.status)
        return resp.status
