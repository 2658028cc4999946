"""The node's request handlers: one decoded request in, its reply (or error) out.

Threading contract: runs on the node's I/O thread only (``Server`` calls ``handle`` from its
loop); it owns the node's holdings (``holdings.py``) through that thread.  Nothing here blocks: a
handler does work bounded by the request's limits (``kvring.common.protocol``), a GET's layers
are produced by a generator the server runs a slice at a time, and a GET of chunks held only on
disk is answered when the disk tier's readers have brought them (or after
its ``read_timeout``, with the rest as misses).

Bad input is answered with its ``ErrorCode`` and counted; it is logged as a summary at most
every ``BadInputLog.period`` seconds, whatever the rate, with messages cut to a bounded length.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator

import msgspec
import xxhash

from kvring.common import protocol as P
from kvring.common.chunk import validate_meta
from kvring.common.errors import ErrorCode, ProtocolError

from .framing import FramingError, Message, pack
from .holdings import Holdings
from .metrics import NodeMetrics
from .server import Connection, Server
from .store import Entry, StoreFull

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 300  # an error message echoed to a client or a log
# What ``POST /debug/misnumber-on-get`` can make a node's next streamed GET do (``_misnumbered``).
MISNUMBERINGS = ("swap", "repeat", "negative", "extra")


def _short(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


class BadInputLog:
    """A rate-limited summary of bad requests (and of the node's own errors) for the log."""

    def __init__(self, period: float = 10.0, clock=time.monotonic) -> None:
        self.period = period
        self._clock = clock
        self._counts: Counter[str] = Counter()
        self._last_detail = ""
        self._next = 0.0
        self._next_traceback = 0.0

    def bad(self, code: ErrorCode | str, peer: str, message: str) -> None:
        self._counts[code] += 1
        self._last_detail = f"{peer}: {code}: {_short(message)}"
        self._maybe_log()

    def internal(self, exc: BaseException) -> None:
        """A bug answering a request: one traceback a minute at most, the rest counted."""
        self._counts[ErrorCode.INTERNAL] += 1
        now = self._clock()
        if now >= self._next_traceback:
            self._next_traceback = now + 60.0
            logger.error("internal error handling a request (more are only counted for a minute):\n%s",
                         _short("".join(traceback.format_exception(exc))[-4000:]))
        self._maybe_log()

    def _maybe_log(self) -> None:
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.period
        summary = ", ".join(f"{code}={n}" for code, n in sorted(self._counts.items()))
        logger.warning("refused %d bad requests since the last report (%s); last: %s",
                       sum(self._counts.values()), summary, self._last_detail)
        self._counts.clear()


class Dispatcher:
    def __init__(self, node_id: str, holdings: Holdings, metrics: NodeMetrics, server: Server,
                 max_chunk_bytes: int, stats: Callable[[], dict]) -> None:
        self.node_id = node_id
        self.holdings = holdings
        self.metrics = metrics
        self.server = server
        self.max_chunk_bytes = max_chunk_bytes
        self.stats = stats
        self.bad_input = BadInputLog()
        # Fault injection (POST /debug/signal-on-get): a signal this process sends itself when the
        # next GET arrives, before answering it.  None: off (always, without --fault-injection).
        self.signal_on_get: int | None = None
        # Fault injection (POST /debug/misnumber-on-get): the next streamed GET's layers numbered
        # as a node with a numbering bug would (``MISNUMBERINGS``).  None: off, as above.
        self.misnumber_on_get: str | None = None
        self._handlers = {
            P.Ping: self._ping, P.Lookup: self._lookup, P.Get: self._get, P.Put: self._put,
            P.Delete: self._delete, P.Stats: self._stats, P.ListKeys: self._keys, P.Flush: self._flush,
        }
        server.handler = self.handle
        server.on_framing_error = self.framing_error
        server.on_refused = self.refused

    # ---- entry points (called by the server) -------------------------------------------------

    def handle(self, conn: Connection, msg: Message) -> None:
        t0 = time.perf_counter()
        rid = 0
        try:
            try:
                req = P.decode_request(msg.header)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                rid, code = P.salvage_rid(msg.header)
                raise ProtocolError(f"cannot decode header: {exc}", code) from None
            rid = req.rid
            if req.v != P.PROTOCOL_VERSION:
                raise ProtocolError(f"protocol version {req.v} is not supported (this node speaks "
                                    f"{P.PROTOCOL_VERSION})", ErrorCode.VERSION)
            if not isinstance(req, P.Put) and msg.payloads:
                raise ProtocolError(f"{type(req).__name__} takes no payload frames, got {len(msg.payloads)}",
                                    ErrorCode.FRAME_COUNT)
            self._handlers[type(req)](conn, req, msg.payloads)
            self.metrics.observe(type(req).__struct_config__.tag, time.perf_counter() - t0)
        except ProtocolError as exc:
            self.bad_input.bad(exc.code, conn.peer, str(exc))
            self._error(conn, rid, exc.code, str(exc))
        except Exception as exc:  # a bug must not take the node down, nor flood its log
            self.bad_input.internal(exc)
            self._error(conn, rid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def framing_error(self, conn: Connection, exc: FramingError) -> None:
        """A message the framing refused (before reading its body): answer, then the server closes."""
        self.bad_input.bad(exc.code, conn.peer, str(exc))
        self._error(conn, 0, exc.code, str(exc))

    def refused(self, conn: Connection, exc: Exception) -> None:
        """A peer that failed the TLS handshake: it never reached the protocol."""
        self.metrics.refuse()
        self.bad_input.bad("tls_refused", conn.peer, str(exc))

    # ---- replies ----------------------------------------------------------------------------

    def _reply(self, conn: Connection, msg, payloads=()) -> None:
        self.server.send(conn, pack(P.encode(msg), payloads))

    def _error(self, conn: Connection, rid: int, code: ErrorCode, message: str) -> None:
        self.metrics.error(code)
        self._reply(conn, P.Error(rid=rid, code=code, message=_short(message)))

    @staticmethod
    def _check_keys(keys: list[bytes]) -> None:
        if len(keys) > P.MAX_KEYS_PER_REQUEST:
            raise ProtocolError(f"{len(keys)} keys in one request; the maximum is {P.MAX_KEYS_PER_REQUEST}",
                                ErrorCode.TOO_MANY_KEYS)
        lengths = set(map(len, keys))
        if lengths and (min(lengths) < 1 or max(lengths) > P.MAX_KEY_BYTES):
            bad = next(n for n in lengths if not 0 < n <= P.MAX_KEY_BYTES)
            raise ProtocolError(f"keys must be 1..{P.MAX_KEY_BYTES} bytes, got {bad}", ErrorCode.BAD_KEY)

    # ---- operations -------------------------------------------------------------------------

    def _ping(self, conn, req: P.Ping, _) -> None:
        self._reply(conn, P.Pong(rid=req.rid, node_id=self.node_id))

    def _lookup(self, conn, req: P.Lookup, _) -> None:
        self._check_keys(req.keys)
        present = self.holdings.lookup(req.keys, min(max(req.lease_ms, 0), P.MAX_LEASE_MS))
        hits = sum(present)
        self.metrics.found("lookup", hits, len(present) - hits)
        self._reply(conn, P.LookupReply(rid=req.rid, present=present))

    def _get(self, conn, req: P.Get, _) -> None:
        if self.signal_on_get is not None:
            sig, self.signal_on_get = self.signal_on_get, None
            os.kill(os.getpid(), sig)
        self._check_keys(req.keys)
        if len(set(req.keys)) != len(req.keys):
            raise ProtocolError("a GET names a key more than once; ask for each key once",
                                ErrorCode.DUPLICATE_KEYS)
        if req.layer_start < 0 or (req.layer_end != -1 and req.layer_end <= req.layer_start):
            raise ProtocolError(f"layer range [{req.layer_start}, {req.layer_end}) is empty or negative",
                                ErrorCode.BAD_RANGE)
        self.holdings.fetch(req.keys, lambda entries: self._answer_get(conn, req, entries))

    def _answer_get(self, conn: Connection, req: P.Get, entries: list[Entry | None]) -> None:
        """Answer a GET with its entries (at once, or once the disk tier has read them)."""
        if conn not in self.server.conns:
            return  # the client went while the disk was read
        try:
            self._answer_entries(conn, req, entries)
        except ProtocolError as exc:
            self.bad_input.bad(exc.code, conn.peer, str(exc))
            self._error(conn, req.rid, exc.code, str(exc))
        except Exception as exc:  # as in ``handle``: answered, counted, never fatal
            self.bad_input.internal(exc)
            self._error(conn, req.rid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _answer_entries(self, conn: Connection, req: P.Get, entries: list[Entry | None]) -> None:
        found = [(pos, e) for pos, e in enumerate(entries) if e is not None]
        self.metrics.found("get", len(found), len(entries) - len(found))
        end = req.layer_end
        if found:
            short = min(e.meta.layers for _, e in found)
            if end == -1:  # whole chunks: each key to its own last layer
                end = max(e.meta.layers for _, e in found)
                if req.layer_start >= end:
                    raise ProtocolError(f"layer {req.layer_start} is past the stored chunks' {end} layers",
                                        ErrorCode.BAD_RANGE)
            elif end > short:
                raise ProtocolError(f"layer range [{req.layer_start}, {req.layer_end}) is outside the stored "
                                    f"chunks' {short} layers", ErrorCode.BAD_RANGE)
        self._reply(conn, P.GetHead(rid=req.rid, metas=[e.meta if e else None for e in entries]))
        if found:
            messages = _layer_messages(req, found, end) if req.stream else _span_message(req, found, end)
            if req.stream and self.misnumber_on_get is not None:
                how, self.misnumber_on_get = self.misnumber_on_get, None
                messages = _misnumbered(messages, how)
            self.server.stream(conn, self._counted(messages))

    def _counted(self, messages: Iterator[tuple[bytes, list]]) -> Iterator[list]:
        for header, views in messages:
            self.metrics.bytes_out.inc(sum(v.nbytes for v in views))
            yield pack(header, views)

    def _put(self, conn, req: P.Put, payloads) -> None:
        if len(payloads) != 1:
            raise ProtocolError(f"PUT takes exactly one payload frame, got {len(payloads)}", ErrorCode.FRAME_COUNT)
        self._check_keys([req.key])
        validate_meta(req.meta, self.max_chunk_bytes)
        buf = payloads[0]
        view = memoryview(buf)
        if view.nbytes != req.meta.nbytes:
            raise ProtocolError(f"payload is {view.nbytes} bytes, shape {req.meta.shape} of {req.meta.dtype} "
                                f"needs {req.meta.nbytes}", ErrorCode.SIZE_MISMATCH)
        lb = req.meta.layer_bytes
        for layer, expected in enumerate(req.meta.checksums):
            if xxhash.xxh3_64_intdigest(view[layer * lb:(layer + 1) * lb]) != expected:
                raise ProtocolError(f"checksum of layer {layer} does not match; chunk rejected", ErrorCode.CHECKSUM)
        try:
            stored = self.holdings.put(req.key, req.meta, buf)
        except StoreFull as exc:
            raise ProtocolError(str(exc), ErrorCode.NO_SPACE) from None
        self.metrics.bytes_in.inc(view.nbytes)
        self._reply(conn, P.PutReply(rid=req.rid, stored=stored))

    def _delete(self, conn, req: P.Delete, _) -> None:
        self._check_keys(req.keys)
        deleted = sum(self.holdings.delete(k) for k in req.keys)
        self._reply(conn, P.DeleteReply(rid=req.rid, deleted=deleted))

    def _stats(self, conn, req: P.Stats, _) -> None:
        self._reply(conn, P.StatsReply(rid=req.rid, stats=self.stats()))

    def _flush(self, conn, req: P.Flush, _) -> None:
        if not req.namespace:
            raise ProtocolError("Flush needs a namespace; chunks put without one cannot be flushed",
                                ErrorCode.BAD_NAMESPACE)
        deleted = self.holdings.delete_namespace(req.namespace)
        logger.info("flushed namespace %r: %d chunks", _short(req.namespace), deleted)
        self._reply(conn, P.FlushReply(rid=req.rid, deleted=deleted))

    def _keys(self, conn, req: P.ListKeys, _) -> None:
        keys = self.holdings.keys_after(req.after, min(max(req.limit, 0), P.MAX_LIST_KEYS))
        self._reply(conn, P.KeysReply(rid=req.rid, keys=keys))


def _span_message(req: P.Get, found: list, end: int) -> Iterator[tuple[bytes, list]]:
    """A non-streamed GET: one message, each key's whole range as one contiguous frame."""
    which, views, checksums = [], [], []
    for pos, e in found:
        lb, stop = e.meta.layer_bytes, min(end, e.meta.layers)
        which.append(pos)
        views.append(memoryview(e.buf)[req.layer_start * lb:stop * lb])
        checksums.extend(e.meta.checksums[req.layer_start:stop])
    yield P.encode(P.GetLayer(rid=req.rid, layer=req.layer_start, which=which, checksums=checksums,
                              last=True, span=True)), views


def _layer_messages(req: P.Get, found: list, end: int) -> Iterator[tuple[bytes, list]]:
    """A streamed GET: one message per layer, produced as the connection takes them."""
    bufs = [(pos, e.meta, memoryview(e.buf)) for pos, e in found]
    for layer in range(req.layer_start, end):
        which, views, checksums = [], [], []
        for pos, meta, buf in bufs:
            if layer < meta.layers:
                lb = meta.layer_bytes
                which.append(pos)
                views.append(buf[layer * lb:(layer + 1) * lb])
                checksums.append(meta.checksums[layer])
        yield P.encode(P.GetLayer(rid=req.rid, layer=layer, which=which, checksums=checksums,
                                  last=layer == end - 1)), views


def _misnumbered(messages: Iterator[tuple[bytes, list]], how: str) -> Iterator[tuple[bytes, list]]:
    """Fault injection: a streamed GET's layer messages as a node with a numbering bug would send
    them, every frame's bytes matching the checksums sent with it, only the numbers wrong.
    ``swap``: the first two layers each numbered as the other; ``repeat``: the first layer sent
    twice; ``negative``: the first layer numbered -1; ``extra``: after the last layer, a layer
    numbered as the first, of zeros, with the zeros' checksums."""
    msgs = [(P.decode_reply(header), views) for header, views in messages]
    first, views = msgs[0]
    if how == "swap" and len(msgs) > 1:
        second, second_views = msgs[1]
        msgs[:2] = [(msgspec.structs.replace(first, layer=second.layer), views),
                    (msgspec.structs.replace(second, layer=first.layer), second_views)]
    elif how == "repeat":
        msgs.insert(0, (msgspec.structs.replace(first, last=False), views))
    elif how == "negative":
        msgs[0] = (msgspec.structs.replace(first, layer=-1), views)
    elif how == "extra":
        last, last_views = msgs[-1]
        zeros = [memoryview(bytes(v.nbytes)) for v in views]
        msgs[-1] = (msgspec.structs.replace(last, last=False), last_views)
        msgs.append((msgspec.structs.replace(first, last=True, checksums=[xxhash.xxh3_64_intdigest(z) for z in zeros]),
                     zeros))
    for msg, frames in msgs:
        yield P.encode(msg), frames
