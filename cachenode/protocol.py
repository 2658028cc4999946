"""The kvring data protocol: typed headers plus zero-copy payload frames over ZMQ.

Lifecycle
    A node binds a ROUTER socket; a client opens one DEALER socket per node and may keep many
    requests in flight on it.  Every request carries a client-chosen request id (``rid``); every
    reply echoes it, so replies may arrive in any order.  A request gets exactly one reply,
    except GET, whose reply is streamed: one ``GetHead`` then one ``GetLayer`` message per layer
    of the requested range, the last one flagged ``last``.  Any request may instead get an
    ``Error``, which ends it.

Message format
    Frame 0 is the header, a msgpack map encoded from the tagged unions below (tag field
    ``op``); further frames are payloads.  PUT carries exactly one payload frame, the whole
    layer-major chunk.  ``GetLayer`` carries one frame per key listed in its ``which``, holding
    that key's bytes of that layer (a whole-chunk GET of chunks with different layer counts
    sends each key's own layers).  Headers are small; payloads are never copied into them.

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

Errors and abort
    Malformed input never crashes a node and never touches stored chunks.  It gets an ``Error``
    with one of ``ERROR_CODES`` and increments the node's error counter of that kind: an
    undecodable header (``bad_header``), an unknown ``op`` (``unknown_op``), a wrong number of
    frames (``frame_count``), a payload whose size does not match its declared shape and dtype
    (``size_mismatch``), a chunk above the node's maximum (``too_large``), an unsupported dtype
    or shape (``bad_meta``), a checksum that does not match (``checksum``), a store that cannot
    make room (``no_space``), a Flush without a namespace (``bad_namespace``).  Payload sizes
    are bounded before any allocation: the node's socket refuses frames above
    ``max_chunk_bytes`` plus header room (ZMQ_MAXMSGSIZE, which drops the offending
    connection), and a PUT's declared size is checked before its bytes are looked at.  A client
    that stops waiting (timeout) simply drops late replies by ``rid``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .chunk import ChunkMeta

PROTOCOL_VERSION = 1

ERROR_CODES = (
    "bad_header", "unknown_op", "version", "frame_count", "size_mismatch", "too_large",
    "bad_meta", "bad_key", "checksum", "no_space", "bad_range", "too_many_keys", "bad_namespace", "internal",
)


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
    one frame each, with those layers' checksums."""

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
    code: str
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


def salvage_rid(buf) -> tuple[int, str]:
    """Best-effort ``(rid, error_code)`` of a header that failed to decode, for the error reply."""
    try:
        loose = _loose_decoder.decode(buf)
    except Exception:
        return 0, "bad_header"
    if not isinstance(loose, dict):
        return 0, "bad_header"
    rid = loose.get("rid")
    rid = rid if isinstance(rid, int) and 0 <= rid < 2**63 else 0
    if loose.get("op") not in REQUEST_OPS:
        return rid, "unknown_op"
    if loose.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        return rid, "version"
    return rid, "bad_header"
