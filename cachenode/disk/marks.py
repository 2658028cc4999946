"""The second-chance marks kept over a stop, graceful or not.

Each segment remembers the keys served from it since they were written (``Segment.read``): the
chunks its eviction carries forward (``DiskTier._carry_forward``).  They live in memory, and are
written to ``MARKS_FILE`` in the node's directory: by the writer thread every ``marks_interval``
seconds while marks are being added (``DiskTier._marks_due``), and by a node that stops
gracefully (SIGTERM: a rolling upgrade, a drain) after its last write.  The next start takes them
back once the index is rebuilt: after a crash, those of the last save.  The file stays until a
save replaces it (a crash soon after a start keeps what the start took back).  What a start
takes is only a hint checked against the index: a mark counts only where the index still places
its key in the segment it names, so a stale, foreign or damaged file can mark nothing wrong.  A
damaged file (its checksum, its encoding) is removed, and one that cannot be read is ignored,
each with a log line: the node starts all the same.

Format: ``MAGIC``, the body's length and XXH3-64 (``<QQ``), then the body: msgpack of
``[[segment number, [key, ...]], ...]``.
"""

from __future__ import annotations

import logging
import os
import struct

import msgspec
import xxhash

from .index import DiskIndex

logger = logging.getLogger(__name__)

MARKS_FILE = "read-marks"
MAGIC = b"KVRm"
_HEAD = struct.Struct("<4sQQ")
_decode = msgspec.msgpack.Decoder(list[tuple[int, list[bytes]]]).decode


def save_marks(directory: str, index: DiskIndex) -> int:
    """Write every segment's marks (atomically: a temporary file renamed over the last; none: the
    last file removed); how many."""
    with index.lock:  # copied under the lock (the data loop takes it too), sorted outside it
        marks = [(number, list(segment.read)) for number, segment in index.segments.items() if segment.read]
    path = os.path.join(directory, MARKS_FILE)
    if not marks:
        _remove(path)
        return 0
    body = msgspec.msgpack.encode([(number, sorted(keys)) for number, keys in marks])
    with open(path + ".tmp", "wb") as f:
        f.write(_HEAD.pack(MAGIC, len(body), xxhash.xxh3_64_intdigest(body)) + body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return sum(len(keys) for _, keys in marks)


def load_marks(directory: str, index: DiskIndex) -> int:
    """Mark again what the last run saved, where the index agrees; how many marks were taken
    back (0: no file, or a damaged one, which is removed)."""
    path = os.path.join(directory, MARKS_FILE)
    _remove(path + ".tmp")  # a save the last run did not finish
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    except OSError as exc:  # a hint: a node starts without it
        logger.warning("disk %s: the read marks kept over the last stop cannot be read (%s); starting without "
                       "them", directory, exc.strerror)
        return 0
    try:
        magic, length, digest = _HEAD.unpack_from(data)
        body = data[_HEAD.size:]
        if magic != MAGIC or length != len(body) or xxhash.xxh3_64_intdigest(body) != digest:
            raise ValueError("its header or checksum does not match")
        marks = _decode(body)
    except (struct.error, ValueError, msgspec.DecodeError) as exc:
        logger.warning("disk %s: the read marks kept over the last stop are damaged (%s); starting without them",
                       directory, exc)
        _remove(path)
        return 0
    taken = 0
    with index.lock:
        for number, keys in marks:
            segment = index.segments.get(number)
            if segment is None:
                continue
            for key in keys:
                location = index.entries.get(key)
                if location is not None and location.segment == number:
                    segment.read.add(key)
                    taken += 1
    return taken


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already, or not a file of ours: the next start looks again
        pass
