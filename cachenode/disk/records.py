"""What a disk tier writes: chunk records in segment data files, entries in segment journals.

A segment is two files, ``seg-NNNNNNNN.data`` and ``seg-NNNNNNNN.journal``, numbered in the order
they were opened (numbers are never reused, so a path names one segment for good).

**Data file**: chunk records back to back.  A record is a fixed ``RecordHead`` (magic, the
lengths of what follows, and the XXH3-64 of the described part), then the msgpack of
``RecordHeader`` (the chunk's key and its ``ChunkMeta``, whose per-layer checksums cover the
payload), then the payload.  Reading a record checks all of it: magic, header checksum, the key
asked for, the payload's size, and every layer's checksum, before a byte is served.

**Journal**: the segment's index, appended as chunks are written: ``Stored`` (a record's key,
where it is and its namespace; the chunk's vLLM blocks for the KV events, passed through as
msgpack), ``Deleted`` (a key), ``Flushed`` (a namespace).  Each entry is framed by its length
and its XXH3-64, so a torn tail (a crash in the middle of an append) is found and cut.
Replaying the journals of all segments in order rebuilds the index without reading the data.

Order of writes (``tier.py``): a batch of records is written to the data file (and synced,
unless syncing is off) before their ``Stored`` entries are appended, so an entry never names
bytes that are not in the file.  A record without its entry (the process died between the two)
is dead space, cut from the file's end when the segment is reopened.
"""

from __future__ import annotations

import struct

import msgspec
import xxhash

from kvring.common.chunk import ChunkBlocks, ChunkMeta

DATA_SUFFIX = ".data"
JOURNAL_SUFFIX = ".journal"
SEGMENT_PREFIX = "seg-"

RECORD_MAGIC = b"KVRc"
# magic, header bytes, payload bytes, XXH3-64 of (header bytes + the head's first 16 bytes)
RECORD_HEAD = struct.Struct("<4sIQQ")
MAX_HEADER_BYTES = 1 << 20  # a record header past this is not one of ours

ENTRY_HEAD = struct.Struct("<IQ")  # body bytes, XXH3-64 of the body
MAX_ENTRY_BYTES = 1 << 20


class RecordHeader(msgspec.Struct, array_like=True):
    key: bytes
    meta: ChunkMeta


class Stored(msgspec.Struct, array_like=True, tag=0):
    key: bytes
    offset: int  # of the record in the data file
    length: int  # of the whole record
    namespace: str = ""
    blocks: bytes | None = None  # the meta's ChunkBlocks as msgpack, for the KV events
    anchor: bytes | None = None  # the meta's anchor (``anchors.py``), for a chunk evicted from the disk


class Deleted(msgspec.Struct, array_like=True, tag=1):
    key: bytes


class Flushed(msgspec.Struct, array_like=True, tag=2):
    namespace: str


JournalEntry = Stored | Deleted | Flushed

_entry_decoder = msgspec.msgpack.Decoder(JournalEntry)
_header_decoder = msgspec.msgpack.Decoder(RecordHeader)
_encoder = msgspec.msgpack.Encoder()


class BadRecord(Exception):
    """A record that is not the chunk asked for, whole and intact (the reason is the message)."""


def segment_name(number: int, suffix: str) -> str:
    return f"{SEGMENT_PREFIX}{number:08d}{suffix}"


def segment_number(name: str) -> int | None:
    """The number of a segment file's name, or None for a name that is not one of ours."""
    for suffix in (DATA_SUFFIX, JOURNAL_SUFFIX):
        if name.startswith(SEGMENT_PREFIX) and name.endswith(suffix):
            digits = name[len(SEGMENT_PREFIX):-len(suffix)]
            if len(digits) == 8 and digits.isdigit():
                return int(digits)
    return None


def record_head(key: bytes, meta: ChunkMeta) -> bytes:
    """The bytes written before a chunk's payload: ``RecordHead`` and the header."""
    header = _encoder.encode(RecordHeader(key, msgspec.structs.replace(meta, blocks=None)))
    start = RECORD_HEAD.pack(RECORD_MAGIC, len(header), meta.nbytes, 0)[:16]
    return start + struct.pack("<Q", xxhash.xxh3_64_intdigest(start + header)) + header


def parse_head(data: bytes | memoryview, key: bytes) -> tuple[ChunkMeta, int]:
    """The meta of the record starting ``data`` (which holds at least its head and header) and
    the offset of its payload within the record; ``BadRecord`` unless it is ``key``'s."""
    if len(data) < RECORD_HEAD.size:
        raise BadRecord("record shorter than its head")
    magic, header_len, payload_len, digest = RECORD_HEAD.unpack_from(data)
    if magic != RECORD_MAGIC or header_len > MAX_HEADER_BYTES:
        raise BadRecord("not a kvring record")
    end = RECORD_HEAD.size + header_len
    if len(data) < end:
        raise BadRecord("record header cut short")
    header = bytes(data[RECORD_HEAD.size:end])
    if xxhash.xxh3_64_intdigest(bytes(data[:16]) + header) != digest:
        raise BadRecord("record header checksum does not match")
    try:
        parsed = _header_decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRecord(f"record header does not decode: {exc}") from None
    if parsed.key != key:
        raise BadRecord("record holds another key")
    if parsed.meta.nbytes != payload_len:
        raise BadRecord("record payload size does not match its meta")
    return parsed.meta, end


def check_payload(meta: ChunkMeta, payload) -> None:
    """``BadRecord`` unless every layer of ``payload`` matches its checksum."""
    view = memoryview(payload).cast("B")
    lb = meta.layer_bytes
    if view.nbytes != meta.nbytes:
        raise BadRecord("record payload cut short")
    for layer, expected in enumerate(meta.checksums):
        if xxhash.xxh3_64_intdigest(view[layer * lb:(layer + 1) * lb]) != expected:
            raise BadRecord(f"layer {layer} of the record does not match its checksum")


def encode_entry(entry: JournalEntry) -> bytes:
    body = _encoder.encode(entry)
    return ENTRY_HEAD.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


def decode_entry_at(data: bytes) -> JournalEntry | None:
    """The entry ``data`` starts with, if it is whole and intact."""
    entries, _ = decode_entries(data)
    return entries[0][1] if entries else None


def decode_blocks(raw: bytes | None) -> ChunkBlocks | None:
    if raw is None:
        return None
    try:
        return msgspec.msgpack.decode(raw, type=ChunkBlocks)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def blocks_bytes(meta: ChunkMeta) -> bytes | None:
    return None if meta.blocks is None else _encoder.encode(meta.blocks)


def decode_entries(data: bytes) -> tuple[list[tuple[int, JournalEntry]], int]:
    """The whole entries at the start of ``data``, each with its offset, and the length they
    take; the rest (a torn or corrupt tail, or nothing) is to be cut."""
    entries, pos, n = [], 0, len(data)
    head, size = ENTRY_HEAD, ENTRY_HEAD.size
    digest, decode = xxhash.xxh3_64_intdigest, _entry_decoder.decode
    while pos + size <= n:
        length, expected = head.unpack_from(data, pos)
        end = pos + size + length
        if length > MAX_ENTRY_BYTES or end > n:
            break
        body = data[pos + size:end]
        if digest(body) != expected:
            break
        try:
            entries.append((pos, decode(body)))
        except (msgspec.DecodeError, msgspec.ValidationError):
            break
        pos = end
    return entries, pos
