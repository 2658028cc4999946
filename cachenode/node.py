"""One cache node: the chunk store behind a ZMQ ROUTER socket, an admin/metrics HTTP port, and
registration in etcd.

Threads: the main thread runs the data loop (all store access happens there); a daemon thread
serves HTTP; another runs an asyncio loop that keeps the etcd registration alive and polls
this node's drain key; the handoff thread moves chunks the node no longer owns.  SIGTERM or
SIGINT stops the loop, revokes the lease (the node leaves the ring at once) and exits 0.

Drain: requested through etcd (``Etcd.request_drain``, polled every ``drain_poll`` seconds) or
by ``POST /drain`` on the admin port (from loopback only: that is the pod's preStop hook; from
elsewhere use etcd, which the admin API guards with a token).  The node sets its state
``draining`` (clients drop it from the ring; it keeps serving reads for their previous-owner
fallback), the handoff thread moves every chunk to its new owner, and the node reports
``drained``.  ``/readyz`` answers 503 from the moment the drain begins; ``/stats`` (and
``GET /drain``) show its progress and, while it cannot finish, why.  A drain with nowhere to
go (no other active node) keeps its chunks and stays ``draining``.  Withdrawing every request
(``Etcd.cancel_drain``, ``DELETE /drain``) returns the node to ``active``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import xxhash
import zmq
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import protocol as P
from .chunk import validate_meta
from .errors import ContractMismatch, MembershipError, ProtocolError
from .handoff import DrainProgress, Handoff
from .membership import LEFT_RING_STATES, Contract, Etcd, EtcdSettings, NodeRecord, Registrar
from .metrics import NodeMetrics
from .policy import make_policy
from .store import ChunkStore, StoreFull

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 1 << 20
MAX_KEY_BYTES = 64
MAX_KEYS_PER_REQUEST = 65_536
MAX_LEASE_MS = 60_000


@dataclass(frozen=True)
class NodeConfig:
    """Settings of one node, built once in ``main`` (see ``kvring node --help``)."""

    node_id: str
    memory: int
    host: str = "127.0.0.1"
    data_port: int = 0
    admin_port: int = 0
    advertise_host: str | None = None
    max_chunk_bytes: int = 256 << 20
    policy: str = "lru"
    max_leased_fraction: float = 0.5
    etcd: EtcdSettings | None = None
    lease_ttl: int = 10
    contract: Contract = field(default_factory=Contract)
    handoff: bool = True
    drain_poll: float = 1.0  # seconds between looks at this node's drain key in etcd
    # Testing only: POST /debug/corrupt?key=HEX (from loopback) flips a stored byte, so tests can
    # show that a corrupt chunk is never loaded. Off unless --fault-injection is given.
    fault_injection: bool = False

    def __post_init__(self) -> None:
        if not self.node_id or "/" in self.node_id:
            raise ValueError(f"node id {self.node_id!r} must be non-empty and contain no '/'")
        if self.memory <= 0:
            raise ValueError("--memory must be positive, e.g. --memory 4GiB")
        if not 0 < self.max_chunk_bytes <= self.memory:
            raise ValueError(f"--max-chunk-bytes must be in (0, memory={self.memory}]")
        if not 0.0 <= self.max_leased_fraction < 1.0:
            raise ValueError("--max-leased-fraction must be in [0, 1)")
        if self.lease_ttl < 1:
            raise ValueError("--lease-ttl must be at least 1 second")
        if not self.drain_poll > 0:
            raise ValueError("drain_poll must be positive seconds")
        make_policy(self.policy)


class CacheNode:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.store = ChunkStore(config.memory, make_policy(config.policy), config.max_leased_fraction)
        self.metrics = NodeMetrics(self.store)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_chunk_bytes + MAX_HEADER_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 256)
        self.sock.setsockopt(zmq.LINGER, 0)
        if config.data_port:
            self.sock.bind(f"tcp://{config.host}:{config.data_port}")
            self.data_port = config.data_port
        else:
            self.data_port = self.sock.bind_to_random_port(f"tcp://{config.host}")
        self.http = ThreadingHTTPServer((config.host, config.admin_port), _make_http_handler(self))
        self.http.daemon_threads = True
        self.admin_port = self.http.server_address[1]
        adv = config.advertise_host or config.host
        self.record = NodeRecord(
            node_id=config.node_id,
            data_addr=f"tcp://{adv}:{self.data_port}",
            admin_addr=f"http://{adv}:{self.admin_port}",
            capacity=config.memory,
            pid=os.getpid(),
        )
        self.registrar: Registrar | None = None
        self.handoff: Handoff | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self.fatal: str | None = None
        self.started = time.time()
        self._drain_lock = threading.Lock()
        self.drain_requests: set[str] = set()  # who asked: "etcd", "http"
        self.drain_started: float | None = None
        self.drain_finished: float | None = None
        self._handlers = {
            P.Ping: self._ping, P.Lookup: self._lookup, P.Get: self._get, P.Put: self._put,
            P.Delete: self._delete, P.Stats: self._stats, P.ListKeys: self._keys, P.Flush: self._flush,
        }

    # ---- lifecycle --------------------------------------------------------------------------

    def start_background(self) -> None:
        threading.Thread(target=self.http.serve_forever, name="kvring-http", daemon=True).start()
        if self.config.etcd is not None:
            ready = threading.Event()
            threading.Thread(target=self._membership_thread, args=(ready,), name="kvring-etcd", daemon=True).start()
            ready.wait(self.config.etcd.timeout * 3 + 1)
            if self.fatal:
                raise ContractMismatch(self.fatal)
            if self.config.handoff:
                self.handoff = Handoff(self.config.node_id, self.config.etcd, self.config.contract,
                                       state=lambda: self.record.state, held=lambda: len(self.store),
                                       on_drained=self._drained)
                if self.record.state in LEFT_RING_STATES:
                    self.handoff.reset_drain()
                self.handoff.start()

    def _membership_thread(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        etcd = Etcd(self.config.etcd)
        self.registrar = Registrar(etcd, self.record, self.config.contract, ttl=self.config.lease_ttl)

        async def main() -> None:
            try:  # a drain requested before (re)start holds: register as draining, not active
                if await etcd.drain_requested(self.config.node_id):
                    self.request_drain("etcd")
                    self.registrar.record = self.record
            except MembershipError:
                pass
            try:
                await self.registrar.register_once()
                logger.info("node %s registered in etcd as %s", self.config.node_id, self.record.data_addr)
            except MembershipError as exc:
                logger.warning("etcd unreachable at start (%s); serving anyway, will register when it is back", exc)
            except ContractMismatch as exc:
                self.fatal = str(exc)
                ready.set()
                return
            ready.set()
            watcher = asyncio.ensure_future(self._watch_drain_key(Etcd(self.config.etcd)))
            try:
                await self.registrar.run()
            except ContractMismatch as exc:
                self.fatal = str(exc)
                logger.error("%s", exc)
                self._stop.set()
            finally:
                watcher.cancel()

        loop.run_until_complete(main())

    async def _watch_drain_key(self, etcd: Etcd) -> None:
        """Follow this node's drain key in etcd (a cheap point read every ``drain_poll`` seconds)."""
        try:
            while True:
                try:
                    requested = await etcd.drain_requested(self.config.node_id)
                    if self._stop.is_set():
                        return  # shutting down: the state no longer changes
                    if requested:
                        self.request_drain("etcd")
                    else:
                        self.cancel_drain("etcd")
                except MembershipError:
                    pass  # keep the current state; the registrar logs etcd outages
                await asyncio.sleep(self.config.drain_poll)
        finally:
            await etcd.close()

    def set_state(self, state: str) -> None:
        if self.registrar is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.registrar.set_state, state)
        self.record = msgspec.structs.replace(self.record, state=state)

    # ---- drain ------------------------------------------------------------------------------

    def request_drain(self, source: str) -> None:
        """Start draining (idempotent); ``source`` ("etcd" or "http") records who asked."""
        with self._drain_lock:
            new = source not in self.drain_requests
            self.drain_requests.add(source)
            if self.record.state in LEFT_RING_STATES:
                return
            self.drain_started, self.drain_finished = time.time(), None
            if self.handoff is not None:
                self.handoff.reset_drain()
            self.set_state("draining")
        if new:
            logger.info("node %s draining (asked through %s)", self.config.node_id, source)

    def cancel_drain(self, source: str) -> None:
        """Withdraw ``source``'s request; with none left the node goes back to ``active``."""
        with self._drain_lock:
            if source not in self.drain_requests:
                return
            self.drain_requests.discard(source)
            if self.drain_requests or self.record.state not in LEFT_RING_STATES:
                return
            self.drain_started = self.drain_finished = None
            self.set_state("active")
        logger.info("node %s: drain cancelled, active again", self.config.node_id)

    def _drained(self) -> None:
        with self._drain_lock:
            if self.record.state != "draining":
                return
            self.drain_finished = time.time()
            self.set_state("drained")
        logger.info("node %s drained: every chunk handed off", self.config.node_id)

    def drain_status(self) -> dict:
        progress = self.handoff.drain if self.handoff is not None else DrainProgress()
        state = self.record.state
        left = state in LEFT_RING_STATES
        reason, waiting = (progress.reason, progress.waiting) if left else ("", "")
        if state == "draining" and self.handoff is None:
            reason, waiting = "no_handoff", ("this node runs without handoff (--no-handoff or no etcd): its chunks "
                                             "stay here; restart it with handoff to drain")
        return {
            "state": state,
            "requested_by": sorted(self.drain_requests),
            "started_at": self.drain_started,
            "finished_at": self.drain_finished,
            "handed_off": progress.handed_off,
            "remaining": len(self.store) if left else None,
            "reason": reason,
            "waiting": waiting,
        }

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            for _ in range(256):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.handle(frames)
        self._shutdown()

    def _shutdown(self) -> None:
        if self.handoff is not None:
            self.handoff.stop()
        if self.record.state == "drained" and "etcd" in self.drain_requests and self._loop is not None \
                and self._loop.is_running():
            # The drain request has been carried out: a pod coming back under this id starts active.
            fut = asyncio.run_coroutine_threadsafe(self.registrar.etcd.cancel_drain(self.config.node_id), self._loop)
            try:
                fut.result(timeout=2)
            except Exception:
                logger.warning("could not remove this node's drain request from etcd")
        if self.registrar is not None and self._loop is not None and self._loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self.registrar.deregister(), self._loop)
            try:
                fut.result(timeout=2)
            except Exception:
                logger.warning("could not revoke the etcd lease; it will expire by itself")
        self.http.shutdown()
        self.sock.close(linger=0)

    # ---- request handling -------------------------------------------------------------------

    def handle(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0]
        if len(frames) < 2:
            return self._error(ident, 0, "frame_count", "a request needs a header frame")
        t0 = time.perf_counter()
        header = frames[1]
        rid = 0
        try:
            if len(header) > MAX_HEADER_BYTES:
                raise ProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}", "bad_header")
            try:
                req = P.decode_request(header.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                rid, code = P.salvage_rid(header.buffer)
                raise ProtocolError(f"cannot decode header: {exc}", code) from None
            rid = req.rid
            if req.v != P.PROTOCOL_VERSION:
                raise ProtocolError(f"protocol version {req.v} is not supported (this node speaks "
                                    f"{P.PROTOCOL_VERSION})", "version")
            handler = self._handlers[type(req)]
            payloads = frames[2:]
            if not isinstance(req, P.Put) and payloads:
                raise ProtocolError(f"{type(req).__name__} takes no payload frames, got {len(payloads)}",
                                    "frame_count")
            handler(ident, req, payloads)
            self.metrics.observe(type(req).__struct_config__.tag, time.perf_counter() - t0)
        except ProtocolError as exc:
            self._error(ident, rid, exc.code, str(exc))
        except Exception as exc:  # a bug must not take the node down
            logger.exception("internal error handling a request")
            self._error(ident, rid, "internal", f"{type(exc).__name__}: {exc}")

    def _send(self, ident, msg, payloads=()) -> None:
        self.sock.send_multipart([ident, P.encode(msg), *payloads], copy=False)

    def _error(self, ident, rid: int, code: str, message: str) -> None:
        self.metrics.error(code)
        self._send(ident, P.Error(rid=rid, code=code, message=message))

    @staticmethod
    def _check_keys(keys: list[bytes]) -> None:
        if len(keys) > MAX_KEYS_PER_REQUEST:
            raise ProtocolError(f"{len(keys)} keys in one request; the maximum is {MAX_KEYS_PER_REQUEST}",
                                "too_many_keys")
        for key in keys:
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise ProtocolError(f"keys must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}", "bad_key")

    def _ping(self, ident, req: P.Ping, _) -> None:
        self._send(ident, P.Pong(rid=req.rid, node_id=self.config.node_id))

    def _lookup(self, ident, req: P.Lookup, _) -> None:
        self._check_keys(req.keys)
        present = self.store.lookup(req.keys, min(max(req.lease_ms, 0), MAX_LEASE_MS))
        hits = sum(present)
        self.metrics.found("lookup", hits, len(present) - hits)
        self._send(ident, P.LookupReply(rid=req.rid, present=present))

    def _get(self, ident, req: P.Get, _) -> None:
        self._check_keys(req.keys)
        entries = [self.store.get(k) for k in req.keys]
        found = [(pos, e) for pos, e in enumerate(entries) if e is not None]
        self.metrics.found("get", len(found), len(entries) - len(found))
        if found:
            if req.layer_end == -1:  # whole chunks: each key to its own last layer
                end = max(e.meta.layers for _, e in found)
            else:
                end = req.layer_end
                short = min(e.meta.layers for _, e in found)
                if not 0 <= req.layer_start < end <= short:
                    raise ProtocolError(f"layer range [{req.layer_start}, {req.layer_end}) is outside the "
                                        f"stored chunks' {short} layers", "bad_range")
            if not 0 <= req.layer_start < end:
                raise ProtocolError(f"layer range [{req.layer_start}, {req.layer_end}) is empty", "bad_range")
        self._send(ident, P.GetHead(rid=req.rid, metas=[e.meta if e else None for e in entries]))
        if not found:
            return
        sent = 0
        if not req.stream:  # one message, each key's whole range as one contiguous frame
            which, views, checksums = [], [], []
            for pos, e in found:
                lb, stop = e.meta.layer_bytes, min(end, e.meta.layers)
                which.append(pos)
                views.append(e.buf[req.layer_start * lb:stop * lb])
                checksums.extend(e.meta.checksums[req.layer_start:stop])
                sent += views[-1].nbytes
            self._send(ident, P.GetLayer(rid=req.rid, layer=req.layer_start, which=which, checksums=checksums,
                                         last=True, span=True), views)
            self.metrics.bytes_out.inc(sent)
            return
        for layer in range(req.layer_start, end):
            which, views, checksums = [], [], []
            for pos, e in found:
                if layer < e.meta.layers:
                    lb = e.meta.layer_bytes
                    which.append(pos)
                    views.append(e.buf[layer * lb:(layer + 1) * lb])
                    checksums.append(e.meta.checksums[layer])
                    sent += lb
            msg = P.GetLayer(rid=req.rid, layer=layer, which=which, checksums=checksums, last=layer == end - 1)
            self._send(ident, msg, views)
        self.metrics.bytes_out.inc(sent)

    def _put(self, ident, req: P.Put, payloads) -> None:
        if len(payloads) != 1:
            raise ProtocolError(f"PUT takes exactly one payload frame, got {len(payloads)}", "frame_count")
        self._check_keys([req.key])
        validate_meta(req.meta, self.config.max_chunk_bytes)
        buf = payloads[0].buffer
        if buf.nbytes != req.meta.nbytes:
            raise ProtocolError(f"payload is {buf.nbytes} bytes, shape {req.meta.shape} of {req.meta.dtype} "
                                f"needs {req.meta.nbytes}", "size_mismatch")
        lb = req.meta.layer_bytes
        for layer, expected in enumerate(req.meta.checksums):
            if xxhash.xxh3_64_intdigest(buf[layer * lb:(layer + 1) * lb]) != expected:
                raise ProtocolError(f"checksum of layer {layer} does not match; chunk rejected", "checksum")
        try:
            stored = self.store.put(req.key, req.meta, buf)
        except StoreFull as exc:
            raise ProtocolError(str(exc), "no_space") from None
        self.metrics.bytes_in.inc(buf.nbytes)
        self._send(ident, P.PutReply(rid=req.rid, stored=stored))

    def _delete(self, ident, req: P.Delete, _) -> None:
        self._check_keys(req.keys)
        deleted = sum(self.store.delete(k) for k in req.keys)
        self._send(ident, P.DeleteReply(rid=req.rid, deleted=deleted))

    def _stats(self, ident, req: P.Stats, _) -> None:
        self._send(ident, P.StatsReply(rid=req.rid, stats=self.stats()))

    def _flush(self, ident, req: P.Flush, _) -> None:
        if not req.namespace:
            raise ProtocolError("Flush needs a namespace; chunks put without one cannot be flushed", "bad_namespace")
        deleted = self.store.delete_namespace(req.namespace)
        logger.info("flushed namespace %r: %d chunks", req.namespace, deleted)
        self._send(ident, P.FlushReply(rid=req.rid, deleted=deleted))

    def _keys(self, ident, req: P.ListKeys, _) -> None:
        limit = min(max(req.limit, 0), MAX_KEYS_PER_REQUEST)
        keys = sorted(k for k in self.store.keys() if k > req.after)[:limit]
        self._send(ident, P.KeysReply(rid=req.rid, keys=keys))

    def stats(self) -> dict:
        m = self.metrics
        return {
            "node_id": self.config.node_id,
            "state": self.record.state,
            "data_addr": self.record.data_addr,
            "admin_addr": self.record.admin_addr,
            "capacity": self.store.capacity,
            "used": self.store.used,
            "chunks": len(self.store),
            "evictions": self.store.evictions,
            "leased_bytes": self.store.leased_bytes(),
            # hits/misses: what LOOKUPs found (the cache's hit rate); GETs are counted apart.
            "hits": m.tally["lookup_hits"],
            "misses": m.tally["lookup_misses"],
            **m.tally,
            "errors": dict(m.error_tally),
            "registered": bool(self.registrar and self.registrar.registered.is_set()),
            "registrations": self.registrar.registrations if self.registrar else 0,
            "handed_off": self.handoff.moved if self.handoff else 0,
            "namespaces": len(self.store.namespaces()),
            "drain": self.drain_status(),
            "uptime_s": round(time.time() - self.started, 3),
            "pid": os.getpid(),
        }


def _make_http_handler(node: CacheNode):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._reply(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ready = node.config.etcd is None or (node.registrar is not None and node.registrar.registered.is_set())
                ready = ready and node.record.state not in LEFT_RING_STATES
                self._reply(200 if ready else 503, b"ready\n" if ready else b"not ready\n", "text/plain")
            elif path == "/metrics":
                self._reply(200, generate_latest(node.metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/stats":
                self._json(200, node.stats())
            elif path == "/drain":
                self._json(200, node.drain_status())
            else:
                self._reply(404, b"not found; try /healthz /readyz /metrics /stats /drain\n", "text/plain")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.startswith("/debug/corrupt"):
                self._corrupt()
                return
            if self._drain_path():
                node.request_drain("http")
                self._json(202, node.drain_status())

        def do_DELETE(self) -> None:  # noqa: N802
            if self._drain_path():
                node.cancel_drain("http")
                self._json(200, node.drain_status())

        def _corrupt(self) -> None:
            """Fault injection (``--fault-injection`` only): flip one byte of a stored chunk in
            place of its first layer, leaving its recorded checksums as they were."""
            if not node.config.fault_injection or not _is_loopback(self.client_address[0]):
                self._json(403, {"error": "fault injection is off (kvring node --fault-injection, loopback only)"})
                return
            query = dict(p.split("=", 1) for p in self.path.partition("?")[2].split("&") if "=" in p)
            try:
                key = bytes.fromhex(query.get("key", ""))
            except ValueError:
                key = b""
            entry = node.store.peek(key)
            if entry is None:
                self._json(404, {"error": "no such chunk here (give ?key=HEX of a stored chunk)"})
                return
            data = bytearray(entry.buf)
            data[0] ^= 0xFF
            entry.buf = memoryview(bytes(data))  # one reference swap: safe against the I/O thread
            self._json(200, {"corrupted": key.hex()})

        def _drain_path(self) -> bool:
            """Checks shared by POST/DELETE /drain; replies and returns False when they fail."""
            length = self.headers.get("Content-Length", "0")
            length = int(length) if length.isdigit() else 0
            if 0 < length <= 1 << 16:
                self.rfile.read(length)  # any body is ignored, but must not be left on the connection
            if self.path.split("?", 1)[0] != "/drain":
                self._json(404, {"error": "not found; POST or DELETE /drain"})
                return False
            if not _is_loopback(self.client_address[0]):
                self._json(403, {"error": "POST/DELETE /drain are accepted from loopback only (the pod's preStop "
                                          "hook); drain this node remotely through etcd: `kvring drain --etcd ... "
                                          f"--node {node.config.node_id}` or the admin API"})
                return False
            if node.config.etcd is None:
                self._json(409, {"error": "this node runs without etcd, so there is no ring to hand chunks to"})
                return False
            return True

        def _json(self, code: int, body: dict) -> None:
            self._reply(code, json.dumps(body).encode(), "application/json")

        def _reply(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args) -> None:
            logger.debug("http: " + fmt, *args)

    return Handler


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def run_node(config: NodeConfig) -> int:
    """Run a node until SIGTERM/SIGINT; prints one READY line with its addresses for launchers."""
    node = CacheNode(config)
    try:
        node.start_background()
    except ContractMismatch as exc:
        logger.error("%s", exc)
        print(f"error: {exc}", flush=True)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: node.stop())
    print(f"READY node={config.node_id} data={node.record.data_addr} admin={node.record.admin_addr}", flush=True)
    node.serve_forever()
    return 2 if node.fatal else 0
