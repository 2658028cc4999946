"""The disk tier's index: where each chunk on disk is, segment by segment, rebuilt from the
segments' journals at start.

Threading contract: one lock (``DiskIndex.lock``) guards every read and change; it is held only
for in-memory work, never across I/O.  The node's data loop asks it whether a key is on disk,
the writer thread adds what it wrote and drops evicted segments, readers drop bad records.

Memory: about 200 bytes per chunk on disk (its key, a ``Location`` and their slots in the
table and in its segment's key list), outside the memory budget: 200 MiB for a million chunks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from .records import (DATA_SUFFIX, JOURNAL_SUFFIX, Deleted, Flushed, Stored, decode_entries, segment_name,
                      segment_number)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Location:
    """Where one chunk's record is (never changed once made: not frozen only because a frozen
    dataclass takes three times as long to build, which a million of them at start notice)."""

    segment: int
    offset: int  # of the record in the segment's data file
    length: int
    namespace: str
    entry: int = -1  # offset of its ``Stored`` entry in the segment's journal (-1: not journaled yet)


@dataclass(slots=True)
class Segment:
    """One segment: its number, the bytes its records take and the keys written into it (some
    since deleted or written again elsewhere: the index has the last word)."""

    number: int
    size: int = 0  # data bytes (the next record's offset)
    journal: int = 0  # journal bytes
    keys: list[bytes] = field(default_factory=list)
    # Keys served from this segment since it was written (their second chance when it is evicted:
    # ``DiskTier._carry_forward``); kept over a stop (``marks.py``): a graceful one, or a crash
    # as of the last periodic save.
    read: set[bytes] = field(default_factory=set)
    readers: int = 0  # reads asked for and not done (``DiskTier.read``: pinned)
    kept: int = -1  # evicted while pinned: its data file, open until the last of them is done


@dataclass
class RebuildReport:
    """What a start found on disk (``/stats``'s ``disk.rebuild``)."""

    seconds: float = 0.0
    segments: int = 0
    chunks: int = 0
    bytes: int = 0
    cleared: str = ""  # why the directory was cleared ("" if it was not)
    read_marks: int = 0  # second-chance marks the last run kept, taken back (``marks.py``)
    # What was dropped: journal bytes of torn entries, data bytes past the last journaled record,
    # entries naming bytes the data file does not have, segments missing one of their files, and
    # the bytes of the oldest segments over a capacity lowered since they were written.
    dropped: dict[str, int] = field(default_factory=lambda: {
        "torn_journal_bytes": 0, "unjournaled_bytes": 0, "entries_past_end": 0, "incomplete_segments": 0,
        "over_capacity_bytes": 0})

    def as_dict(self) -> dict:
        return {"seconds": round(self.seconds, 3), "segments": self.segments, "chunks": self.chunks,
                "bytes": self.bytes, "cleared": self.cleared, "read_marks": self.read_marks,
                "dropped": dict(self.dropped)}


class DiskIndex:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[bytes, Location] = {}
        self.segments: dict[int, Segment] = {}  # oldest first
        self.bytes = 0  # data and journal bytes of every segment
        self.marks_version = 0  # read marks added so far (``marks.py`` saves them when it moved)

    def __len__(self) -> int:
        return len(self.entries)

    # Each method below expects ``lock`` held by its caller.

    def add(self, key: bytes, location: Location) -> None:
        self.entries[key] = location
        self.segments[location.segment].keys.append(key)

    def remove(self, key: bytes) -> Location | None:
        return self.entries.pop(key, None)

    def remove_namespace(self, namespace: str) -> dict[bytes, Location]:
        doomed = {key: loc for key, loc in self.entries.items() if loc.namespace == namespace}
        for key in doomed:
            del self.entries[key]
        return doomed

    def drop_segment(self, number: int) -> list[bytes]:
        """Forget segment ``number``; returns the keys whose chunks were in it."""
        segment = self.segments.pop(number)
        self.bytes -= segment.size + segment.journal
        entries = self.entries
        live = [key for key in segment.keys if (loc := entries.get(key)) is not None and loc.segment == number]
        for key in live:
            del entries[key]
        return live


def rebuild(directory: str, index: DiskIndex, report: RebuildReport) -> int:
    """Fill ``index`` from the journals in ``directory`` (oldest segment first), cutting torn
    journal tails and unjournaled data tails; returns the number the next segment takes."""
    t0 = time.perf_counter()
    numbers: dict[int, set[str]] = {}
    for name in os.listdir(directory):
        number = segment_number(name)
        if number is not None:
            numbers.setdefault(number, set()).add(name[-len(DATA_SUFFIX):] if name.endswith(DATA_SUFFIX)
                                                   else JOURNAL_SUFFIX)
    for number in sorted(numbers):
        data = os.path.join(directory, segment_name(number, DATA_SUFFIX))
        journal = os.path.join(directory, segment_name(number, JOURNAL_SUFFIX))
        if numbers[number] != {DATA_SUFFIX, JOURNAL_SUFFIX}:
            report.dropped["incomplete_segments"] += 1
            for path in (data, journal):
                if os.path.exists(path):
                    os.unlink(path)
            continue
        _replay(number, data, journal, index, report)
    report.segments = len(index.segments)
    report.chunks = len(index.entries)
    report.bytes = sum(loc.length for loc in index.entries.values())
    report.seconds = time.perf_counter() - t0
    return max(numbers, default=0) + 1


def _replay(number: int, data_path: str, journal_path: str, index: DiskIndex, report: RebuildReport) -> None:
    with open(journal_path, "rb") as f:
        raw = f.read()
    entries, whole = decode_entries(raw)
    if whole < len(raw):
        report.dropped["torn_journal_bytes"] += len(raw) - whole
        os.truncate(journal_path, whole)
    data_size = os.path.getsize(data_path)
    if not entries and not data_size:  # opened and never written (a stop right after a start)
        os.unlink(data_path)
        os.unlink(journal_path)
        return
    segment = Segment(number, journal=whole)
    index.segments[number] = segment
    end = 0
    namespaces: dict[str, str] = {}  # one string object per namespace, not one per chunk
    live, keys = index.entries, segment.keys
    for at, entry in entries:
        if type(entry) is Stored:
            if entry.offset + entry.length > data_size:
                report.dropped["entries_past_end"] += 1
                continue
            namespace = namespaces.setdefault(entry.namespace, entry.namespace)
            live[entry.key] = Location(number, entry.offset, entry.length, namespace, at)
            keys.append(entry.key)
            end = max(end, entry.offset + entry.length)
        elif type(entry) is Deleted:
            index.remove(entry.key)
        elif type(entry) is Flushed:
            index.remove_namespace(entry.namespace)
    if data_size > end:
        report.dropped["unjournaled_bytes"] += data_size - end
        os.truncate(data_path, end)
    segment.size = end
    index.bytes += segment.size + segment.journal
