"""``kvring drain``: ask one node to hand off its chunks and leave the ring, and wait for it.

Two ways in, same outcome (see ``cachenode/node.py``):

- ``--admin URL``: ``POST /drain`` on the node's own admin port, with the cluster's node token
  (``--node-token-file`` or ``KVRING_NODE_TOKEN``, which the operator sets in node pods).  The
  node accepts it from loopback only, which is what a StatefulSet preStop hook is
  (``kvring drain --admin https://127.0.0.1:8080 --tls-dir DIR --wait 120``).  A node with the
  cluster's credentials serves that port over TLS (``https://``) and wants their client
  certificate too (``--tls-dir``, which the operator mounts in node pods).
- ``--etcd ... --cluster ... --node ID``: writes the node's drain key in etcd, which the node
  polls; works from anywhere that reaches etcd (an operator, a person).

A node the operator marked restarting (a rolling update of a cluster with a disk tier) answers
the ``POST`` with ``"restart": true`` and keeps its chunks: the command says so and exits 0 at
once, so the pod's shutdown is not held up.

With ``--wait SECONDS`` the command follows the node's progress until it reports ``drained``
and exits 0, or exits 1 when the time is up, printing why the node has not finished.  It stops
waiting early (exit 1) once the node has reported for ``NOWHERE_GRACE_SECONDS`` that no active
node is left to take its chunks: when a whole cluster shuts down every pod drains at once, and
waiting out the timeout would only delay the shutdown.  ``--cancel`` withdraws the request.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from kvring.common.errors import KVRingError, MembershipError
from kvring.common.records import NodeRecord
from kvring.common.tls import CredentialsError, admin_context
from kvring.common.types import NodeState
from kvring.membership.etcd import Etcd
from kvring.membership.settings import EtcdSettings

POLL_SECONDS = 0.5
REPORT_SECONDS = 5.0
NOWHERE_GRACE_SECONDS = 10.0


class DrainFailed(KVRingError):
    """The drain could not be requested, or did not finish in time (the message says why)."""


def _http(method: str, url: str, timeout: float = 5.0, token: str | None = None,
          tls: ssl.SSLContext | None = None) -> tuple[int, dict]:
    try:
        context = admin_context(url, tls)
    except CredentialsError as exc:
        raise DrainFailed(str(exc)) from None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, method=method, data=b"" if method != "GET" else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        return exc.code, body
    except (OSError, ValueError) as exc:
        raise DrainFailed(f"cannot reach the node's admin port at {url}: {exc}") from None


def _describe(status: dict) -> str:
    parts = [status.get("state", "?")]
    if status.get("remaining") is not None:
        parts.append(f"{status['remaining']} chunks left")
    if status.get("handed_off"):
        parts.append(f"{status['handed_off']} handed off")
    if status.get("waiting"):
        parts.append(status["waiting"])
    return ", ".join(parts)


def _follow(name: str, poll: Callable[[], dict], wait: float, echo: Callable[[str], None],
            nowhere_grace: float = NOWHERE_GRACE_SECONDS) -> dict:
    """Poll until ``drained`` or ``wait`` seconds passed; print progress now and then."""
    start = time.monotonic()
    last_report = 0.0
    nowhere_since: float | None = None
    while True:
        status = poll()
        now = time.monotonic()
        if status.get("state") == NodeState.DRAINED:
            echo(f"{name} drained in {now - start:.1f}s ({status.get('handed_off', 0)} chunks handed off)")
            return status
        if now - start >= wait:
            raise DrainFailed(f"{name} is not drained after {wait:g}s: {_describe(status)}")
        nowhere_since = (nowhere_since or now) if status.get("reason") == "no_owners" else None
        if nowhere_since is not None and now - nowhere_since >= nowhere_grace:
            raise DrainFailed(f"{name} cannot drain, giving up before --wait: {_describe(status)}")
        if now - last_report >= REPORT_SECONDS:
            echo(f"{name}: {_describe(status)}")
            last_report = now
        time.sleep(POLL_SECONDS)


def drain_via_admin(url: str, wait: float, cancel: bool, echo: Callable[[str], None],
                    token: str | None = None, tls: ssl.SSLContext | None = None) -> dict:
    """``POST`` (or with ``cancel``, ``DELETE``) ``/drain`` at ``url`` with the node ``token``
    (over TLS with ``tls``, the cluster's client context, for an ``https://`` node)."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise DrainFailed(f"--admin must be an http(s) URL such as http://127.0.0.1:8080, got {url!r}")
    code, body = _http("DELETE" if cancel else "POST", f"{base}/drain", token=token, tls=tls)
    if code not in (200, 202):
        raise DrainFailed(f"the node at {base} refused: HTTP {code}: {body.get('error', body)}")
    if cancel:
        echo(f"drain withdrawn: {_describe(body)}")
        return body
    if body.get("restart"):  # marked restarting by the operator: the node keeps its chunks, nothing to follow
        echo(f"not draining {base}: {body.get('message') or 'marked restarting, it keeps its chunks'}")
        return body
    echo(f"drain requested at {base}: {_describe(body)}")
    if wait <= 0:
        return body

    def poll() -> dict:
        code, status = _http("GET", f"{base}/drain", tls=tls)
        if code != 200:
            raise DrainFailed(f"GET {base}/drain answered HTTP {code}")
        return status
    return _follow(base, poll, wait, echo)


def drain_via_etcd(settings: EtcdSettings, node_id: str, wait: float, cancel: bool,
                   echo: Callable[[str], None], tls: ssl.SSLContext | None = None) -> dict:
    async def members() -> dict[str, NodeRecord]:
        etcd = Etcd(settings)
        try:
            return (await etcd.members())[0]
        finally:
            await etcd.close()

    async def request() -> dict[str, NodeRecord]:
        etcd = Etcd(settings)
        try:
            found = (await etcd.members())[0]
            if not cancel and node_id not in found:
                raise DrainFailed(f"no node {node_id!r} in cluster {settings.cluster!r}; members: "
                                  f"{', '.join(sorted(found)) or '(none)'}")
            await (etcd.cancel_drain(node_id) if cancel else etcd.request_drain(node_id))
            return found
        finally:
            await etcd.close()

    try:
        asyncio.run(request())
    except MembershipError as exc:
        raise DrainFailed(f"etcd: {exc}") from None
    if cancel:
        echo(f"drain request of {node_id} withdrawn")
        return {}
    echo(f"drain of {node_id} requested in etcd (cluster {settings.cluster!r})")
    if wait <= 0:
        return {}

    def poll() -> dict:
        try:
            record = asyncio.run(members()).get(node_id)
        except MembershipError as exc:
            return {"state": "unknown", "waiting": f"etcd unreachable: {exc}"}
        if record is None:
            raise DrainFailed(f"{node_id} left the cluster (its record is gone) before it reported drained")
        try:  # the node's own view has the progress; its record alone has the state
            code, status = _http("GET", f"{record.admin_addr}/drain", timeout=2.0, tls=tls)
            if code == 200:
                return {**status, "state": record.state}
        except DrainFailed:
            pass
        return {"state": record.state}
    return _follow(node_id, poll, wait, echo)
