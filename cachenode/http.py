"""A node's admin HTTP port: health, metrics, stats, drain, and the admin API's key queries.

Open to anyone who reaches the port (read-only probes, no prompt data):

- ``GET /healthz`` (the process is up), ``GET /readyz`` (serving: registered once, not
  leaving the ring and its data plane answering its own check; 503 while draining or
  unhealthy, not while etcd is away), ``GET /metrics``
  (Prometheus), ``GET /stats`` (JSON), ``GET /drain``.

Guarded by the cluster's node token (``Authorization: Bearer <token>``, from every address,
loopback included; see "Node token" below):

- ``POST /drain`` and ``DELETE /drain``: start or withdraw a drain, from loopback only too (the
  pod's preStop hook; from elsewhere, drain through etcd, which the admin API guards).  A node
  the operator marked restarting (``restart/<node-id>`` in etcd) answers ``POST /drain`` with
  200 and ``"restart": true`` and keeps its chunks (``drain.py``);
- ``POST /v1/present`` ``{"keys": [hex, ...]}`` -> ``{"present": [bool, ...]}`` (no lease) and
  ``POST /v1/flush`` ``{"namespace": ...}`` -> ``{"deleted": n}``: what the admin API asks
  each node, so it never needs the data protocol's client.  ``present`` changes nothing but
  tells which prompt prefixes are cached (a side channel on other users' prompts);
- ``POST /debug/corrupt?key=HEX``: with ``--fault-injection`` only, from loopback only: flip a
  byte of a stored chunk, so tests can show a corrupt chunk is never loaded;
  ``POST /debug/stall?seconds=S`` (same conditions): block the data loop that long, as a hung
  handler would (the self-check's case); ``POST /debug/disk-stall?seconds=S`` (same
  conditions): every operation of the disk tier waits that long, as on a hung device;
  ``POST /debug/signal-on-get?signal=SIGSTOP|SIGKILL``
  (same conditions): the node sends itself that signal when the next GET arrives, before
  answering it, so a test can hang or kill it in the middle of a load;
  ``POST /debug/misnumber-on-get?how=swap|repeat|negative|extra`` (same conditions): the next
  streamed GET's layers go out numbered wrongly, each frame matching the checksums sent with it
  (``dispatch.MISNUMBERINGS``), as from a node with a numbering bug.

Node token: one per cluster, an internal service credential that only the nodes, their preStop
hook, the admin API and local tools hold (not the admin API's user-facing token).  A node takes
it from ``--node-token-file``, read again as the file changes, each of its lines accepted (so a
token changes in steps without a restart), or from ``KVRING_NODE_TOKEN`` once at start
(``NodeConfig.node_token``, ``common.nodetoken``).
Without one configured the guarded endpoints answer 403 saying how to configure it (never open
by default); a request without the token or with another one gets 401 and changes nothing.
Tokens are compared in constant time.  Every refusal is one line of JSON ``{"error": ...}``.

TLS: a node with the cluster's credentials (``--tls-dir``) serves this port over HTTPS with its
certificate and registers an ``https://`` admin address.  A client certificate is optional for
the open endpoints (kubelet probes and Prometheus come without one) and required, signed by the
cluster CA, for the guarded ones: the node token alone, leaked, does not flush a node.  Each
connection shakes hands on its own thread; every connection's silence is bounded by
``REQUEST_TIMEOUT``, and at most ``MAX_CONNECTIONS`` are served at once.

Threading contract: ``ThreadingHTTPServer`` answers on threads of its own; everything that
touches the store runs on the node's I/O thread through ``Server.call``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import signal
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvring.common import protocol as P
from kvring.common.tls import ContextSource

from .dispatch import MISNUMBERINGS

if TYPE_CHECKING:
    from .node import CacheNode

logger = logging.getLogger(__name__)

MAX_BODY = 4 << 20
# What a request to these paths must carry the node token for (every /debug/ path too).
GUARDED = frozenset({"/v1/present", "/v1/flush", "/drain"})


REQUEST_TIMEOUT = 10.0  # seconds a connection may stay silent, its TLS handshake included
# Connections served at once; one more is closed as it arrives, so that a flood holds neither
# more threads nor more descriptors than this (the node keeps a reserve of descriptors for etcd
# and this port; ``server.py``).
MAX_CONNECTIONS = 64


def make_http_server(node: CacheNode, host: str, port: int, tls: ContextSource | None = None) -> ThreadingHTTPServer:
    """The admin port on ``host:port``: HTTPS with ``tls`` (``ClusterCredentials.admin_server_context``)."""
    server = _AdminServer((host, port), _handler_class(node))
    server.tls = tls
    server.daemon_threads = True
    return server


class _AdminServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` whose connections, with ``tls``, shake hands on the request's own
    thread (under ``REQUEST_TIMEOUT``), never on the accepting one: a client that stops half-way
    through its handshake holds up only itself, not the probes behind it.  At most
    ``MAX_CONNECTIONS`` are served at once."""

    tls: ContextSource | None = None
    request_queue_size = MAX_CONNECTIONS  # the listen backlog (socketserver's 5 drops a burst's SYNs)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            logger.debug("admin port: %d connections in flight, closing one from %s", MAX_CONNECTIONS,
                         client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # its thread releases the slot
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request, client_address) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(REQUEST_TIMEOUT)
        try:
            conn = self.tls().wrap_socket(request, server_side=True)  # takes over the descriptor
        except (ssl.SSLError, OSError) as exc:
            logger.debug("admin port: no TLS handshake with %s: %s", client_address[0], exc)
            return
        try:
            self.RequestHandlerClass(conn, client_address, self)
        finally:
            self.shutdown_request(conn)


class _BadRequest(Exception):
    def __init__(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.headers = headers or {}


def _guarded(path: str) -> bool:
    return path in GUARDED or path.startswith("/debug/")


def _handler_class(node: CacheNode):
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT  # a silent client's thread ends, rather than waiting for ever

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._reply(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ready = node.ready()
                self._reply(200 if ready else 503, b"ready\n" if ready else b"not ready\n", "text/plain")
            elif path == "/metrics":
                self._reply(200, generate_latest(node.metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/stats":
                self._json(200, node.server.call(node.stats))
            elif path == "/drain":
                self._json(200, node.drain.status())
            else:
                self._reply(404, b"not found; try /healthz /readyz /metrics /stats /drain\n", "text/plain")

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0]
            try:
                body = self._body()  # read before any refusal: unread bytes would reset the connection
                if _guarded(path):
                    self._require_token(f"POST {path}")
                if path == "/v1/present":
                    self._json(200, {"present": self._present(body)})
                elif path == "/v1/flush":
                    self._json(200, {"deleted": self._flush(body)})
                elif path == "/debug/corrupt":
                    self._json(200, self._corrupt())
                elif path == "/debug/stall":
                    self._json(202, self._stall())
                elif path == "/debug/disk-stall":
                    self._json(202, self._disk_stall())
                elif path == "/debug/signal-on-get":
                    self._json(202, self._signal_on_get())
                elif path == "/debug/misnumber-on-get":
                    self._json(202, self._misnumber_on_get())
                elif self._drain_allowed(path):
                    if node.drain.keep_for_restart():  # marked restarting by the operator: keep the chunks
                        self._json(200, node.drain.restart_status())
                    else:
                        node.drain.request("http")
                        self._json(202, node.drain.status())
            except _BadRequest as exc:
                self._json(exc.code, {"error": str(exc)}, exc.headers)

        def do_DELETE(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0]
            try:
                self._body()
                if _guarded(path):
                    self._require_token(f"DELETE {path}")
                if self._drain_allowed(path):
                    node.drain.cancel("http")
                    self._json(200, node.drain.status())
            except _BadRequest as exc:
                self._json(exc.code, {"error": str(exc)}, exc.headers)

        # ---- the node token -------------------------------------------------------------

        def _require_token(self, what: str) -> None:
            """Return if the request carries the node token (and, over TLS, came with a certificate
            the cluster CA signed); else raise 403 (none configured) or 401."""
            if isinstance(self.connection, ssl.SSLSocket) and not self.connection.getpeercert():
                logger.debug("refused %s from %s: no client certificate", what, self.client_address[0])
                raise _BadRequest(401, f"{what} over TLS needs the cluster's client certificate beside the node "
                                       "token (--tls-dir or KVRING_TLS_DIR for kvring commands)")
            expected = node.config.node_token
            if expected is None:
                raise _BadRequest(403, f"{what} needs the cluster's node token, and this node has none configured: "
                                       "start it with --node-token-file PATH or KVRING_NODE_TOKEN (`kvring up` and "
                                       "the operator do), then send it as `Authorization: Bearer <token>`")
            scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() == "bearer" and expected.accepts(given.strip()):
                return
            logger.debug("refused %s from %s: %s node token", what, self.client_address[0],
                         "a wrong" if scheme else "no")
            raise _BadRequest(401, f"{what} needs the cluster's node token: send `Authorization: Bearer <token>` "
                                   "(--node-token-file or KVRING_NODE_TOKEN for kvring commands)"
                                   + (" (the token given is not the right one)" if scheme else ""),
                              {"WWW-Authenticate": "Bearer"})

        # ---- the admin API's queries ----------------------------------------------------

        def _present(self, body: bytes) -> list[bool]:
            keys = _keys_of(body)
            return node.server.call(lambda: [k in node.holdings for k in keys])

        def _flush(self, body: bytes) -> int:
            try:
                namespace = json.loads(body or b"{}").get("namespace")
            except (ValueError, AttributeError):
                raise _BadRequest(400, 'the body must be JSON: {"namespace": "..."}') from None
            if not isinstance(namespace, str) or not namespace:
                raise _BadRequest(400, "a non-empty namespace is required (chunks put without one cannot be flushed)")
            deleted = node.server.call(lambda: node.holdings.delete_namespace(namespace))
            logger.info("flushed namespace %r: %d chunks (admin port)", namespace[:300], deleted)
            return deleted

        def _fault_injection(self) -> dict[str, str]:
            """The request's query, if fault injection is on and the request comes from loopback."""
            if not node.config.fault_injection or not _is_loopback(self.client_address[0]):
                raise _BadRequest(403, "fault injection is off (kvring node --fault-injection, loopback only)")
            return dict(p.split("=", 1) for p in self.path.partition("?")[2].split("&") if "=" in p)

        def _stall(self) -> dict:
            """Block the data loop for ``seconds`` (at most 60), from a thread of its own."""
            try:
                seconds = min(60.0, max(0.0, float(self._fault_injection().get("seconds", "5"))))
            except ValueError:
                raise _BadRequest(400, "give ?seconds=S") from None
            threading.Thread(target=lambda: node.server.call(lambda: time.sleep(seconds), timeout=seconds + 5),
                             daemon=True).start()
            return {"stalled_s": seconds}

        def _disk_stall(self) -> dict:
            """Make every operation of the disk tier wait ``seconds`` (at most 60), like a hung device."""
            query = self._fault_injection()
            if node.disk is None:
                raise _BadRequest(409, "this node has no disk tier (--disk-dir)")
            try:
                seconds = min(60.0, max(0.0, float(query.get("seconds", "5"))))
            except ValueError:
                raise _BadRequest(400, "give ?seconds=S") from None
            node.disk.stall(seconds)
            return {"disk_stalled_s": seconds}

        def _signal_on_get(self) -> dict:
            """Arm the data loop to send this process ``signal`` when the next GET arrives."""
            name = self._fault_injection().get("signal", "")
            if name not in ("SIGSTOP", "SIGKILL"):
                raise _BadRequest(400, "give ?signal=SIGSTOP or ?signal=SIGKILL")
            node.server.call(lambda: setattr(node.dispatcher, "signal_on_get", getattr(signal, name)))
            return {"armed": name}

        def _misnumber_on_get(self) -> dict:
            """Arm the data loop to number the layers of the next streamed GET wrongly."""
            how = self._fault_injection().get("how", "")
            if how not in MISNUMBERINGS:
                raise _BadRequest(400, f"give ?how= one of {', '.join(MISNUMBERINGS)}")
            node.server.call(lambda: setattr(node.dispatcher, "misnumber_on_get", how))
            return {"armed": how}

        def _corrupt(self) -> dict:
            """Flip one byte of a stored chunk's first layer, leaving its checksums as they were."""
            query = self._fault_injection()
            try:
                key = bytes.fromhex(query.get("key", ""))
            except ValueError:
                key = b""

            def corrupt() -> bool:
                entry = node.store.peek(key)
                if entry is None:
                    return False
                data = bytearray(memoryview(entry.buf).cast("B"))
                data[0] ^= 0xFF
                return node.store.replace_payload(key, data)
            if not node.server.call(corrupt):
                raise _BadRequest(404, "no such chunk here (give ?key=HEX of a stored chunk)")
            return {"corrupted": key.hex()}

        # ---- drain ----------------------------------------------------------------------

        def _drain_allowed(self, path: str) -> bool:
            """Checks shared by POST/DELETE /drain; replies and returns False when they fail."""
            if path != "/drain":
                raise _BadRequest(404, "not found; POST or DELETE /drain, POST /v1/present, POST /v1/flush")
            if not _is_loopback(self.client_address[0]):
                raise _BadRequest(403, "POST/DELETE /drain are accepted from loopback only (the pod's preStop "
                                       "hook); drain this node remotely through etcd: `kvring drain --etcd ... "
                                       f"--node {node.config.node_id}` or the admin API")
            if node.config.etcd is None:
                raise _BadRequest(409, "this node runs without etcd, so there is no ring to hand chunks to")
            return True

        # ---- plumbing -------------------------------------------------------------------

        def _body(self) -> bytes:
            length = self.headers.get("Content-Length", "0")
            length = int(length) if length.isdigit() else 0
            if length > MAX_BODY:
                self.close_connection = True
                raise _BadRequest(413, f"request body over {MAX_BODY} bytes")
            return self.rfile.read(length) if length else b""

        def _json(self, code: int, body: dict, headers: dict[str, str] | None = None) -> None:
            self._reply(code, json.dumps(body).encode(), "application/json", headers)

        def _reply(self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args) -> None:
            logger.debug("http: " + fmt, *args)

    return Handler


def _keys_of(body: bytes) -> list[bytes]:
    try:
        raw = json.loads(body or b"{}").get("keys")
        if not isinstance(raw, list) or not all(isinstance(k, str) for k in raw):
            raise ValueError
        keys = [bytes.fromhex(k) for k in raw]
    except (ValueError, AttributeError):
        raise _BadRequest(400, 'the body must be JSON: {"keys": ["<hex>", ...]}') from None
    if len(keys) > P.MAX_KEYS_PER_REQUEST:
        raise _BadRequest(400, f"{len(keys)} keys; at most {P.MAX_KEYS_PER_REQUEST} per request")
    if any(not 0 < len(k) <= P.MAX_KEY_BYTES for k in keys):
        raise _BadRequest(400, f"keys are 1..{P.MAX_KEY_BYTES} bytes")
    return keys


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
