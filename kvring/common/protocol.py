"""The kvring data protocol: typed headers plus zero-copy payload frames over TCP.

Lifecycle
    A node listens on one TCP port; a client opens connections to it (a small pool per node,
    one request in flight on each).  Every request carries a client-chosen request id
    (``rid``); every reply echoes it.  A request gets exactly one reply, except GET, whose reply
    is streamed: one ``GetHead`` then one ``GetLayer`` message per layer of the requested range,
    the last one flagged ``last`` (a non-streamed GET gets one ``GetLayer`` with ``span``).
    Any request may instead get an ``Error``, which ends it.  A client that stops waiting
    (timeout) closes the connection: the node drops what it was still sending, and no late
    reply can be mistaken for the answer to a later request.

Message format
    Each message is framed (``kvring.cachenode.framing``): a 14-byte prefix (magic ``KVR1``,
    header length u32, payload count u16, reserved u32), one u64 length per payload, the header,
    then the payloads.  The header is a msgpack map encoded from the tagged unions below (tag
    field ``op``).  PUT carries exactly one payload, the whole layer-major chunk.  ``GetLayer``
    carries one payload per key listed in its ``which``: that key's bytes of that layer (or of
    its whole range, with ``span``).  Payloads are never copied into headers; a receiver reads
    each payload into a buffer of its own, which a node stores as the chunk and a client hands
    to its caller as a zero-copy view.

Operations (request -> reply)
    ``Ping -> Pong``; ``Lookup(keys, lease_ms) -> LookupReply(present)``;
    ``Get(keys, layer range, stream) -> GetHead, GetLayer...``; ``Put(key, meta) + payload ->
    PutReply``; ``Delete(keys) -> DeleteReply(deleted)``; ``Stats -> StatsReply``;
    ``ListKeys(after, limit) -> KeysReply`` (handoff and draining page through a node with it);
    ``Flush(namespace) -> FlushReply(deleted)``: delete every chunk whose metadata names
    ``namespace`` (``ChunkMeta.namespace``, set by the writer).  Chunks put without a namespace
    (``""``) are never flushed, and a Flush of ``""`` is refused with ``bad_namespace`` rather
    than read as "everything".  A Flush is per node; ``ClusterClient.flush_namespace`` sends it
    to every member (draining ones included) and adds up the counts.

Versioning
    Each header has ``v``; a node answers any other version with ``Error(code="version")``.
    Fields are only ever added with defaults; a change of meaning bumps ``PROTOCOL_VERSION``.
    Requests carry the sender's ring ``epoch`` (0 = unknown) for diagnostics and handoff.
    New operations are added the same way: a node that predates one answers ``unknown_op``.

Errors, bounds and abort
    Malformed input never crashes a node, never touches stored chunks and never reads as the
    node's own fault: each kind gets its ``ErrorCode`` (``kvring.common.errors``) and counts
    in the node's error counter of that kind; the node logs a rate-limited summary, not one
    line per message.  Everything is bounded before work or allocation: a header above
    ``MAX_HEADER_BYTES``, more than one payload on a request, or a payload above the node's
    maximum chunk size is refused from the frame prefix alone (the node answers, then closes
    the connection, since the rest of the message is not read); keys are 1..``MAX_KEY_BYTES``
    bytes, at most ``MAX_KEYS_PER_REQUEST`` per request; a GET may not name a key twice
    (``duplicate_keys``: its reply would hold the same bytes again), so a reply never holds
    more than the distinct chunks the node stores; layer ranges are checked against the stored
    chunks; leases are capped at ``MAX_LEASE_MS``.  A streamed reply is produced a slice at a
    time as the client reads it, interleaved with every other client's requests, so no request
    holds the node's loop for long and a slow reader holds only a bounded send queue.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .chunk import MAX_KEY_BYTES, ChunkMeta  # noqa: F401 (MAX_KEY_BYTES: the protocol's limit too)
from .errors import ErrorCode

PROTOCOL_VERSION = 1

MAX_HEADER_BYTES = 1 << 20  # a request header (a LOOKUP of MAX_KEYS_PER_REQUEST keys fits)
MAX_KEYS_PER_REQUEST = 16_384  # 4M tokens of 256-token chunks in one request
MAX_LEASE_MS = 60_000
MAX_LIST_KEYS = 10_000  # keys in one KeysReply



class _Msg(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    rid: int
    v: int = PROTOCOL_VERSION
    epoch: int = 0


# ---- requests --------------------------------------------------------------------------------

class Ping(_Msg, tag="ping"):
    pass


class Lookup(_Msg, tag="lookup"):
    """Which of ``keys`` are present; present ones are leased for ``lease_ms``."""

    keys: list[bytes]
    lease_ms: int = 0


class Get(_Msg, tag="get"):
    """Layers ``[layer_start, layer_end)`` of ``keys`` (``layer_end = -1``: through the last).

    ``stream``: one ``GetLayer`` per layer (for layerwise consumers); otherwise a single
    ``GetLayer`` with ``span=True`` carries each key's whole range as one frame."""

    keys: list[bytes]
    layer_start: int = 0
    layer_end: int = -1
    stream: bool = True


class Put(_Msg, tag="put"):
    key: bytes
    meta: ChunkMeta


class Delete(_Msg, tag="delete"):
    keys: list[bytes]


class Stats(_Msg, tag="stats"):
    pass


class ListKeys(_Msg, tag="keys"):
    """Keys the node holds (for handoff and draining), at most ``limit``, after ``after``."""

    after: bytes = b""
    limit: int = 10_000


class Flush(_Msg, tag="flush"):
    """Delete every chunk stored under ``namespace`` (must not be empty)."""

    namespace: str


Request = Ping | Lookup | Get | Put | Delete | Stats | ListKeys | Flush


# ---- replies ---------------------------------------------------------------------------------

class Pong(_Msg, tag="pong"):
    node_id: str


class LookupReply(_Msg, tag="lookup_ok"):
    present: list[bool]


class GetHead(_Msg, tag="get_head"):
    """Metadata of each requested key (``None`` = not stored); layers follow if any is found."""

    metas: list[ChunkMeta | None]


class GetLayer(_Msg, tag="get_layer"):
    """One layer of the found keys that have it: positions ``which`` in the request's key list,
    one frame each, with those layers' checksums.  A streamed GET's layers come in order from
    ``layer_start``; the client checks each frame against its number's checksum in the key's
    ``GetHead`` metadata (the writer's), so a layer numbered out of turn is refused."""

    layer: int
    which: list[int]
    checksums: list[int]  # span: every layer's checksum of each key in turn
    last: bool = False
    span: bool = False  # each frame holds the key's layers [layer, end) back to back


class PutReply(_Msg, tag="put_ok"):
    stored: bool  # False: an identical chunk was already there


class DeleteReply(_Msg, tag="delete_ok"):
    deleted: int


class StatsReply(_Msg, tag="stats_ok"):
    stats: dict[str, Any]


class KeysReply(_Msg, tag="keys_ok"):
    keys: list[bytes]


class FlushReply(_Msg, tag="flush_ok"):
    deleted: int


class Error(_Msg, tag="error"):
    code: str  # an ErrorCode's value; a string, so a newer node's codes still decode
    message: str


Reply = (Pong | LookupReply | GetHead | GetLayer | PutReply | DeleteReply | StatsReply | KeysReply | FlushReply
         | Error)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_loose_decoder = msgspec.msgpack.Decoder()
REQUEST_OPS = {cls.__struct_config__.tag for cls in Request.__args__}


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_request(buf) -> Request:
    return _request_decoder.decode(buf)


def decode_reply(buf) -> Reply:
    return _reply_decoder.decode(buf)


def salvage_rid(buf) -> tuple[int, ErrorCode]:
    """Best-effort ``(rid, error code)`` of a header that failed to decode, for the error reply.

    Any msgpack value may arrive here (``op`` a map, ``rid`` a bool or a string, ...): nothing in
    it is trusted beyond its type."""
    try:
        loose = _loose_decoder.decode(buf)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return 0, ErrorCode.BAD_HEADER
    if not isinstance(loose, dict):
        return 0, ErrorCode.BAD_HEADER
    rid = loose.get("rid")
    rid = rid if type(rid) is int and 0 <= rid < 2**63 else 0
    op = loose.get("op")
    if type(op) is not str or op not in REQUEST_OPS:
        return rid, ErrorCode.UNKNOWN_OP
    version = loose.get("v", PROTOCOL_VERSION)
    if type(version) is not int or version != PROTOCOL_VERSION:
        return rid, ErrorCode.VERSION
    return rid, ErrorCode.BAD_HEADER
