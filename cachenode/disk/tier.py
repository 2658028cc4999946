"""The disk tier: every chunk a node stores is also written to disk, behind its PUT, so memory
is the hot tier over the disk and a restart keeps what was written.

Writes: ``write`` (on the node's data loop) only queues the chunk; one writer thread appends
queued records to the open segment's data file in batches, syncs the file (``fdatasync``, unless
``sync`` is off), appends their journal entries and only then makes them visible in the index.
The queue is bounded (``write_queue`` bytes): a chunk that finds it full is not written (counted
as ``write_skipped``; it lives in memory only), so a slow or stalled disk never holds memory or
the data loop.  After a batch is synced its pages are dropped from the page cache
(``POSIX_FADV_DONTNEED``): the node's memory budget already holds the hot chunks, and a page
cache double of them would only take memory from the pod.

What a crash loses: a SIGKILLed node loses exactly the chunks still queued (at most
``write_queue`` bytes, normally the last few milliseconds of PUTs: ``/stats``' ``disk.queued``);
a power loss also loses up to ``JOURNAL_SYNC_SECONDS`` of journal entries.  Half-written records
and torn journal entries are found and cut at the next start (``index.rebuild``).  A graceful
stop (``close``) writes the whole queue first.

Space: segments of ``segment_bytes`` are evicted whole, oldest first (by write time), when the
next record would take the tier past ``capacity``; a full filesystem (ENOSPC) evicts the oldest
segment and skips the record, counted as ``full``.  With the ``second-chance`` eviction (the
default), the records of an evicted segment that were read since they were written are first
copied, file to file in the kernel (``copy_file_range``), to the end of the open segment and
journaled there (``carried``): a chunk in use outlives the cycling, and goes the next time round
unless it is read again meanwhile.  An evicted segment carries at most half its bytes (each
eviction frees at least the other half, so the cycling cannot chase its own tail), and the open
segment never grows past twice ``segment_bytes`` with them.  ``fifo`` carries nothing.  What
was read is kept over a stop (``marks.py``): written every ``marks_interval`` seconds while it
changes, by the writer thread, and at a graceful stop.

Reads: ``read`` runs on a pool of ``read_threads`` threads, into a buffer from the node's pool;
every record is checked (``records.parse_head``, ``records.check_payload``) before it is handed
back, and its pages are dropped from the page cache (a chunk read is promoted into memory).  A
bad record is counted (``corrupt``), dropped from the index (and journaled as deleted), told to
``on_gone`` like an eviction (the node's KV events announce its blocks removed) and answered as a
miss.  The scrub (``scrub.py``) reads every record again in the background at ``scrub_rate``, so
a bad record nobody asks for is found too.  A read asked for before its segment is evicted is
served all the same: ``read`` pins the segment as it looks the chunk up, and an eviction that
finds its segment pinned keeps the data file open (``Segment.kept``) past unlinking its name, until
the last pinned read is done.  Such a file's bytes outlast the eviction by as long as those reads
take (bounded by the reads in flight); a restart never sees them (their name is gone).

Deletes and flushes drop chunks from the index at once (and cancel queued writes), and journal
a ``Deleted``/``Flushed`` entry so that a restart does not bring them back.

Fault injection: ``stall(seconds)`` makes every disk operation of the tier wait that long first,
like a hung device; the data loop is never one of them.
"""

from __future__ import annotations

import dataclasses
import errno
import heapq
import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum

import msgspec

from kvring.common.chunk import ChunkBlocks, ChunkMeta

from .identity import DiskError, DiskIdentity, claim_directory, lock_directory
from .index import DiskIndex, Location, RebuildReport, Segment, rebuild
from .marks import load_marks, save_marks
from .records import (DATA_SUFFIX, ENTRY_HEAD, JOURNAL_SUFFIX, BadRecord, Deleted, Flushed, Stored, blocks_bytes,
                      check_payload, decode_blocks, decode_entries, decode_entry_at, encode_entry, parse_head,
                      record_head, segment_name)
from .scrub import Scrubber

logger = logging.getLogger(__name__)

JOURNAL_SYNC_SECONDS = 1.0
BATCH_RECORDS = 64
BATCH_BYTES = 64 << 20
HEAD_READ = 64 << 10  # bytes read with a record's head (its payload's start comes along)
CLOSE_TIMEOUT = 30.0  # seconds a graceful stop waits for the queue to be written

_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # copy_file_range cannot here
_COPY_PIECE = 1 << 20  # bytes a piece where records are copied through the process instead


class Eviction(str, Enum):
    """What an evicted segment does with the records read since they were written (``--disk-eviction``)."""

    SECOND_CHANCE = "second-chance"  # carries them to the open segment (module docstring)
    FIFO = "fifo"  # lets them go with the rest


@dataclass(frozen=True)
class DiskConfig:
    """Settings of a node's disk tier (``kvring node --disk-dir --disk-capacity``)."""

    directory: str
    capacity: int
    segment_bytes: int = 0  # 0: capacity / 32, within [16 MiB, 1 GiB]
    write_queue: int = 256 << 20
    sync: bool = True
    read_threads: int = 4
    read_timeout: float = 2.0  # seconds a GET waits for the disk before it answers a miss
    scrub_rate: int = 16 << 20  # bytes a second the scrub reads at most (``scrub.py``); 0: no scrub
    scrub_interval: float = 86400.0  # seconds from the start of one scrub pass to the next, at least
    eviction: Eviction = Eviction.SECOND_CHANCE
    marks_interval: float = 60.0  # seconds between saves of the read marks while they change (0: at a stop only)

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("--disk-dir must name a directory")
        if self.capacity < 16 << 20:
            raise ValueError("--disk-capacity must be at least 16MiB, e.g. --disk-capacity 100GiB")
        if self.marks_interval < 0:
            raise ValueError("--disk-marks-interval cannot be negative (0 keeps the read marks at a graceful stop "
                             "only)")
        if self.scrub_rate < 0 or self.scrub_interval < 0:
            raise ValueError("--disk-scrub-rate and --disk-scrub-interval cannot be negative (a rate of 0 turns "
                             "the scrub off)")
        try:
            object.__setattr__(self, "eviction", Eviction(self.eviction))  # the command line gives a string
        except ValueError:
            raise ValueError(f"--disk-eviction must be one of {', '.join(e.value for e in Eviction)}, not "
                             f"{self.eviction!r}") from None

    @property
    def segment_size(self) -> int:
        return self.segment_bytes or min(1 << 30, max(16 << 20, self.capacity // 32))


@dataclass(slots=True)
class _Write:
    """A chunk queued for the disk."""

    key: bytes
    meta: ChunkMeta
    buf: object
    cancelled: bool = False
    written: bool = False  # indexed: on disk now
    released: bool = False  # memory let the chunk go while it was queued (``take_over``)


@dataclass(slots=True)
class Dropped:
    """What a delete took from the tier: where the chunk's record was, or, for one still queued
    (``location`` None), the vLLM blocks its write carried."""

    location: Location | None
    blocks: ChunkBlocks | None = None


@dataclass(slots=True)
class ReadResult:
    """A chunk read back whole and checked (``meta``, ``buf``), or why not (``missing``)."""

    meta: ChunkMeta | None = None
    buf: object = None
    missing: str = ""  # "gone" (evicted or deleted meanwhile), "corrupt", "error", "timeout"


class DiskTier:
    """One node's disk tier (see the module docstring).  ``take`` allocates payload buffers;
    ``on_gone`` hears each chunk that leaves the tier by itself, with its key and its journal
    entry (its vLLM blocks and anchor; None if the entry cannot be read): evicted with its
    segment (on the writer thread), or dropped as corrupt when read (on a reader thread); with
    it, a chunk read back carries its blocks too (``_with_blocks``).  ``on_unwritten`` hears each
    chunk memory let go while it was queued for the disk (``take_over``) that was then not
    written (too large, the disk full or failing), with its metadata, on the writer thread."""

    def __init__(self, config: DiskConfig, identity: DiskIdentity, take: Callable[[int], object],
                 on_gone: Callable[[bytes, Stored | None], None] | None = None) -> None:
        self.config = config
        self.directory = config.directory
        self.identity = identity
        self._take = take
        self.on_gone = on_gone
        self.on_unwritten: Callable[[bytes, ChunkMeta], None] | None = None
        self.index = DiskIndex()
        self.report = RebuildReport()
        self._lock_fd = -1
        self._queue: deque[_Write | Deleted | Flushed] = deque()
        self._queued_bytes = 0
        self._pending: dict[bytes, _Write] = {}  # key -> its queued write (loop thread and writer, under lock)
        self._cond = threading.Condition(self.index.lock)
        self._closing = False
        self._writer: threading.Thread | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._segment: Segment | None = None
        self._written: list[tuple[_Write, Location]] = []  # in the open segment, not committed yet
        self._entries: list[bytes] = []  # journal entries not appended yet
        self._data_fd = self._journal_fd = -1
        self._next_number = 1
        self._journal_synced = time.monotonic()
        self._marks_saved_at = time.monotonic()  # when the read marks were last saved (or the tier opened)
        self._marks_saved_version = 0  # ``index.marks_version`` then
        self._stall_until = 0.0
        self.counts = dict.fromkeys(("written", "written_bytes", "write_skipped", "too_large", "full",
                                     "write_errors", "reads", "read_bytes", "read_errors", "read_gone", "corrupt",
                                     "evicted", "evicted_segments", "kept_for_reads", "carried", "carried_bytes",
                                     "carry_errors", "scrubbed", "scrubbed_bytes", "scrub_passes"), 0)
        self._scrubber: Scrubber | None = None

    # ---- start and stop (the node's main thread) ------------------------------------------------

    def open(self) -> RebuildReport:
        """Lock and claim the directory, rebuild the index from it and start the threads."""
        self._lock_fd = lock_directory(self.directory)
        try:
            self.report.cleared = claim_directory(self.directory, self.identity)
            self._next_number = rebuild(self.directory, self.index, self.report)
            self._open_segment()
            self._trim_to_capacity()
            self.report.read_marks = load_marks(self.directory, self.index)
        except OSError as exc:
            os.close(self._lock_fd)
            raise DiskError(f"cannot use --disk-dir {self.directory}: {exc}") from None
        dropped = {k: v for k, v in self.report.dropped.items() if v}
        logger.info("disk %s: index rebuilt in %.3f s: %d chunks (%d bytes) in %d segments%s", self.directory,
                    self.report.seconds, self.report.chunks, self.report.bytes, self.report.segments,
                    f"; dropped {dropped}" if dropped else "")
        self._writer = threading.Thread(target=self._write_loop, name="kvring-disk-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(self.config.read_threads, thread_name_prefix="kvring-disk-read")
        if self.config.scrub_rate > 0:
            self._scrubber = Scrubber(self, self.config.scrub_rate, self.config.scrub_interval)
            self._scrubber.start()
        return self.report

    def close(self) -> None:
        """Write what is queued (for up to ``CLOSE_TIMEOUT`` seconds), sync, and let go."""
        if self._scrubber is not None:
            self._scrubber.stop()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(CLOSE_TIMEOUT)
            if self._writer.is_alive():
                logger.warning("disk %s: %d queued chunks not written at stop (the disk did not take them in "
                               "%.0f s)", self.directory, len(self._queue), CLOSE_TIMEOUT)
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)
        if not (self._writer and self._writer.is_alive()):
            self._close_segment()
            if self.config.eviction is Eviction.SECOND_CHANCE and self._lock_fd >= 0:
                try:
                    save_marks(self.directory, self.index)
                except OSError as exc:
                    logger.warning("disk %s: the read marks could not be kept for the next start (%s)",
                                   self.directory, exc.strerror)
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    # ---- the data loop's side: nothing here waits on the disk ----------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self.index.entries or key in self._pending

    def __len__(self) -> int:
        return len(self.index.entries)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def take_over(self, key: bytes) -> bool:
        """Memory lets ``key``'s chunk go: whether the tier holds it, written or queued.  A queued
        one is marked, so that a write of it that fails is told to ``on_unwritten`` (with the
        chunk held nowhere then); one whose write has ended is judged by the index alone."""
        with self._cond:
            write = self._pending.get(key)
            if write is not None:
                write.released = True
                return True
            return key in self.index.entries

    def holds(self, key: bytes) -> bool:
        """On disk now (not only queued)."""
        return key in self.index.entries

    def queued(self, key: bytes) -> tuple[ChunkMeta, object] | None:
        """The meta and buffer of ``key``'s write if it is queued (not written yet, not deleted)."""
        with self._cond:
            write = self._pending.get(key)
            if write is None or write.cancelled or write.written:
                return None
            return write.meta, write.buf

    def write(self, key: bytes, meta: ChunkMeta, buf) -> bool:
        """Queue a chunk for the disk; False if it is there already or the queue is full."""
        nbytes = meta.nbytes
        with self._cond:
            if key in self.index.entries or key in self._pending or self._closing:
                return False
            if self._queued_bytes + nbytes > self.config.write_queue:
                self.counts["write_skipped"] += 1
                return False
            write = _Write(key, meta, buf)
            self._pending[key] = write
            self._queue.append(write)
            self._queued_bytes += nbytes
            self._cond.notify()
        return True

    def delete(self, key: bytes) -> Dropped | None:
        """Drop ``key``'s chunk, written or queued; what was dropped (None: the tier had none)."""
        with self._cond:
            write = self._pending.pop(key, None)
            if write is not None:
                write.cancelled = True
            location = self.index.remove(key)
            if location is None:
                return Dropped(None, write.meta.blocks) if write is not None else None
            self._queue.append(Deleted(key))
            self._cond.notify()
        return Dropped(location)

    def location(self, key: bytes) -> Location | None:
        with self.index.lock:
            return self.index.entries.get(key)

    def delete_namespace(self, namespace: str) -> dict[bytes, Dropped]:
        """Drop every chunk of ``namespace``, written or queued; what was dropped, by key."""
        with self._cond:
            cancelled = [w for w in self._pending.values() if w.meta.namespace == namespace]
            for write in cancelled:
                write.cancelled = True
                del self._pending[write.key]
            removed = self.index.remove_namespace(namespace)
            self._queue.append(Flushed(namespace))
            self._cond.notify()
        return {**{key: Dropped(location) for key, location in removed.items()},
                **{write.key: Dropped(None, write.meta.blocks) for write in cancelled}}

    def keys_after(self, after: bytes, limit: int) -> list[bytes]:
        with self.index.lock:
            keys = [key for key in self.index.entries if key > after]
        return heapq.nsmallest(limit, keys)

    def read(self, key: bytes, done: Callable[[ReadResult], None]) -> None:
        """Read ``key``'s chunk on a reader thread and call ``done`` there with the result.  Its
        segment is pinned from here on: evicted meanwhile, it is still read (module docstring)."""
        with self.index.lock:
            location = self.index.entries.get(key)
            segment = None
            if location is None:
                self.counts["read_gone"] += 1  # evicted since the caller found it
            elif self._readers is not None:
                segment = self.index.segments[location.segment]
                segment.readers += 1
        if segment is None:
            done(ReadResult(missing="gone"))
            return
        try:
            future = self._readers.submit(self._read, key, location, done, segment)
        except RuntimeError:  # shutting down
            self._unpin(segment)
            done(ReadResult(missing="gone"))
            return
        # A read cancelled before it ran (the tier closing) lets go of its pin too.
        future.add_done_callback(lambda f: self._unpin(segment) if f.cancelled() else None)

    def _unpin(self, segment: Segment) -> None:
        """A read of ``segment`` is done: the last one closes the file an eviction kept open."""
        with self.index.lock:
            segment.readers -= 1
            fd = segment.kept if segment.readers == 0 else -1
            if fd >= 0:
                segment.kept = -1
        if fd >= 0:
            os.close(fd)

    def entry_of(self, location: Location, done: Callable[[Stored], None]) -> None:
        """Read a chunk's journal entry (its vLLM blocks, for the KV events of a chunk that leaves
        the disk without being in memory) on a reader thread; ``done`` only if it is whole."""
        if location.entry >= 0 and self._readers is not None:
            try:
                self._readers.submit(self._read_entry, location, done)
            except RuntimeError:  # shutting down: no events any more
                pass

    def _read_entry(self, location: Location, done: Callable[[Stored], None]) -> None:
        self.wait_if_stalled()
        entry = self._journal_entry(location)
        if entry is not None:
            done(entry)

    def _journal_entry(self, location: Location) -> Stored | None:
        """The ``Stored`` entry of the journal at ``location.entry`` (None: not journaled yet, or
        it cannot be read whole)."""
        if location.entry < 0:
            return None
        try:
            with open(os.path.join(self.directory, segment_name(location.segment, JOURNAL_SUFFIX)), "rb") as f:
                f.seek(location.entry)
                head = f.read(ENTRY_HEAD.size)
                body = f.read(ENTRY_HEAD.unpack(head)[0]) if len(head) == ENTRY_HEAD.size else b""
        except (OSError, struct.error):
            return None
        entry = decode_entry_at(head + body)
        return entry if type(entry) is Stored else None

    def stall(self, seconds: float) -> None:
        """Fault injection: every disk operation waits until ``seconds`` from now first."""
        self._stall_until = time.monotonic() + seconds

    def stats(self) -> dict:
        return {
            "directory": self.directory,
            "capacity": self.config.capacity,
            "used": self.index.bytes,
            "chunks": len(self.index.entries),
            "segments": len(self.index.segments),
            "queued": len(self._pending),
            "queued_bytes": self._queued_bytes,
            "write_queue": self.config.write_queue,
            "scrub_rate": self.config.scrub_rate,
            "eviction": self.config.eviction.value,
            "stalled": time.monotonic() < self._stall_until,
            **self.counts,
            "rebuild": self.report.as_dict(),
        }

    # ---- reads (reader threads) ---------------------------------------------------------------

    def _read(self, key: bytes, location: Location, done: Callable[[ReadResult], None],
              pinned: Segment | None = None) -> None:
        """``read``'s work on a reader thread; ``pinned``: the segment ``read`` pinned (unpinned
        here), whose kept file serves the read if the segment was evicted since."""
        try:
            self._read_pinned(key, location, done, pinned)
        finally:
            if pinned is not None:
                self._unpin(pinned)

    def _read_pinned(self, key: bytes, location: Location, done: Callable[[ReadResult], None],
                     pinned: Segment | None) -> None:
        self.wait_if_stalled()
        try:
            try:
                meta, buf = self.read_record(key, location)
            except FileNotFoundError:  # its segment was evicted since: kept open, or carried forward?
                with self.index.lock:
                    kept = pinned.kept if pinned is not None else -1
                    moved = self.index.entries.get(key)
                if kept >= 0:
                    meta, buf = self.read_record(key, location, fd=kept)
                elif moved is not None and moved.segment != location.segment:
                    location = moved
                    meta, buf = self.read_record(key, location)
                else:
                    raise
        except FileNotFoundError:
            with self.index.lock:
                self.counts["read_gone"] += 1
            result = ReadResult(missing="gone")  # its segment was evicted since
        except BadRecord as exc:
            self.drop_bad(key, location, str(exc))
            result = ReadResult(missing="corrupt")
        except OSError as exc:
            self.read_failed(key, location, exc)
            result = ReadResult(missing="error")
        else:
            with self.index.lock:
                self.counts["reads"] += 1
                self.counts["read_bytes"] += meta.nbytes
                segment = self.index.segments.get(location.segment)
                if segment is not None and self.index.entries.get(key) is location and key not in segment.read:
                    segment.read.add(key)  # its second chance (``_carry_forward``)
                    self.index.marks_version += 1
            if self.on_gone is not None:
                meta = self._with_blocks(key, meta, location)
            result = ReadResult(meta, buf)
        done(result)

    def _with_blocks(self, key: bytes, meta: ChunkMeta, location: Location) -> ChunkMeta:
        """``meta`` (a record's: it keeps no vLLM blocks) with the blocks its journal entry
        records, so that memory, holding the chunk again, announces them when it lets it go."""
        entry = self._journal_entry(location)
        if entry is None or entry.key != key or entry.blocks is None:
            return meta
        return msgspec.structs.replace(meta, blocks=decode_blocks(entry.blocks))

    def read_record(self, key: bytes, location: Location, take: Callable[[int], object] | None = None,
                    fd: int = -1) -> tuple[ChunkMeta, object]:
        """The record at ``location``, checked whole (``BadRecord`` if it is not ``key``'s), its
        payload in a buffer from ``take`` (default: the node's pool); its pages leave the page cache.
        ``fd``: its segment's data file, open already (an evicted segment's, kept for pinned reads;
        left open), else opened by name."""
        own = fd < 0
        if own:
            fd = self._open_data(location.segment)
        try:
            head = os.pread(fd, min(location.length, HEAD_READ), location.offset)
            meta, start = parse_head(head, key)
            if start + meta.nbytes != location.length:
                raise BadRecord("record length does not match the journal")
            buf = (take or self._take)(meta.nbytes)
            view = memoryview(buf).cast("B")
            have = min(len(head) - start, meta.nbytes)
            view[:have] = head[start:start + have]
            while have < meta.nbytes:
                n = os.preadv(fd, [view[have:]], location.offset + start + have)
                if n == 0:
                    raise BadRecord("record cut short by the end of its file")
                have += n
        finally:
            os.posix_fadvise(fd, location.offset, location.length, os.POSIX_FADV_DONTNEED)
            if own:
                os.close(fd)
        check_payload(meta, buf)
        return meta, buf

    def _open_data(self, number: int) -> int:
        """Segment ``number``'s data file, opened for reading (its descriptor)."""
        return os.open(os.path.join(self.directory, segment_name(number, DATA_SUFFIX)), os.O_RDONLY | os.O_CLOEXEC)

    def drop_bad(self, key: bytes, location: Location, why: str) -> None:
        with self._cond:
            self.counts["corrupt"] += 1
            dropped = self.index.entries.get(key) == location
            if dropped:
                self.index.remove(key)
                self._queue.append(Deleted(key))
                self._cond.notify()
        logger.warning("disk %s: dropped a bad record of key %s in segment %d: %s", self.directory, key.hex()[:32],
                       location.segment, why)
        if dropped and self.on_gone is not None:  # its journal entry names its blocks, if it is whole
            self._read_entry(location, lambda stored: self.on_gone(key, stored))

    def read_failed(self, key: bytes, location: Location, exc: OSError) -> None:
        with self.index.lock:
            self.counts["read_errors"] += 1
        logger.warning("disk %s: reading key %s from segment %d failed: %s", self.directory, key.hex()[:32],
                       location.segment, exc)

    # ---- writes (the writer thread) -----------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            if self._marks_due():
                self._save_marks()  # outside ``_cond``: it takes the index's lock, which ``_cond`` holds
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait(JOURNAL_SYNC_SECONDS)
                    if not self._queue:
                        self._sync_journal_if_due()
                        if self._marks_due():
                            break
                if not self._queue:
                    if self._closing:
                        return
                    continue
                batch, size = [], 0
                while self._queue and len(batch) < BATCH_RECORDS and size < BATCH_BYTES:
                    item = self._queue.popleft()
                    batch.append(item)
                    if type(item) is _Write:
                        size += item.meta.nbytes
            try:
                self._write_batch(batch)
            except Exception:  # a bug must not stop the tier for good: the batch is lost, counted
                logger.exception("disk %s: writing a batch failed", self.directory)
                with self._cond:
                    self.counts["write_errors"] += 1
            finally:
                with self._cond:
                    for item in batch:
                        if type(item) is _Write:
                            self._queued_bytes -= item.meta.nbytes
                            if self._pending.get(item.key) is item:
                                del self._pending[item.key]
                    lost = [item for item in batch if type(item) is _Write and item.released and not item.written
                            and not item.cancelled]
                if self.on_unwritten is not None:
                    for item in lost:
                        self.on_unwritten(item.key, item.meta)

    def _write_batch(self, batch: list) -> None:
        self.wait_if_stalled()
        for item in batch:
            if type(item) is not _Write:
                self._entries.append(encode_entry(item))
            elif not item.cancelled:
                location = self._append(item)
                if location is not None:
                    self._written.append((item, location))
        self._commit()
        self._sync_journal_if_due()

    def _commit(self) -> None:
        """Make the records written to the open segment since the last commit durable (sync),
        visible (index) and journaled, with the tombstones queued between them."""
        written, entries = self._written, self._entries
        self._written, self._entries = [], []
        if written and self.config.sync:
            os.fdatasync(self._data_fd)
        with self._cond:
            at = self._segment.journal + sum(map(len, entries))
            for item, location in written:
                if item.cancelled:  # deleted while it was being written
                    continue
                entry = self._index_stored(item.key, location, blocks_bytes(item.meta), item.meta.anchor, at)
                item.written = True
                entries.append(entry)
                at += len(entry)
                self.counts["written"] += 1
                self.counts["written_bytes"] += item.meta.nbytes
        if entries:
            self._append_journal(b"".join(entries))
        if written and self.config.sync:
            os.posix_fadvise(self._data_fd, written[0][1].offset, 0, os.POSIX_FADV_DONTNEED)

    def _index_stored(self, key: bytes, location: Location, blocks: bytes | None, anchor: bytes | None,
                      at: int) -> bytes:
        """Make a record written (and synced) in the open segment visible, its journal entry to be
        appended at offset ``at``; the entry (under the index lock)."""
        self.index.add(key, dataclasses.replace(location, entry=at))
        return encode_entry(Stored(key, location.offset, location.length, location.namespace, blocks, anchor))

    def _append(self, item: _Write) -> Location | None:
        """Write one record at the end of the open segment (making room first); None if it could
        not be written (counted)."""
        head = record_head(item.key, item.meta)
        length = len(head) + item.meta.nbytes
        if length > self.config.capacity // 2:
            with self._cond:
                self.counts["too_large"] += 1
            return None
        self._make_room(length)
        segment = self._segment
        offset = segment.size
        try:
            _write_all(self._data_fd, [head, memoryview(item.buf).cast("B")], offset)
        except OSError as exc:
            os.ftruncate(self._data_fd, offset)  # no half record left behind
            with self._cond:
                if exc.errno in _OUT_OF_SPACE:
                    self.counts["full"] += 1
                else:
                    self.counts["write_errors"] += 1
            if exc.errno in _OUT_OF_SPACE:
                logger.warning("disk %s is full (%s): a chunk stays in memory only; evicting the oldest segment",
                               self.directory, exc.strerror)
                self._evict_oldest(carry=False)
            else:
                logger.warning("disk %s: writing a chunk failed: %s", self.directory, exc)
            return None
        with self._cond:
            segment.size += length
            self.index.bytes += length
        return Location(segment.number, offset, length, item.meta.namespace)

    def _append_journal(self, data: bytes) -> None:
        try:
            _write_all(self._journal_fd, [data], self._segment.journal)
        except OSError as exc:
            os.ftruncate(self._journal_fd, self._segment.journal)
            with self._cond:
                self.counts["full" if exc.errno in _OUT_OF_SPACE else "write_errors"] += 1
            logger.warning("disk %s: journal append failed (%s): these chunks are served until a restart, "
                           "not after", self.directory, exc.strerror)
            return
        with self._cond:
            self._segment.journal += len(data)
            self.index.bytes += len(data)

    def _marks_due(self) -> bool:
        """``marks_interval`` seconds have passed since the read marks were last saved, and marks
        were added since (a crash keeps those of the last save)."""
        interval = self.config.marks_interval
        return (interval > 0 and self.config.eviction is Eviction.SECOND_CHANCE
                and time.monotonic() - self._marks_saved_at >= interval
                and self.index.marks_version != self._marks_saved_version)

    def _save_marks(self) -> None:
        """Write the read marks (the writer thread, holding no lock)."""
        version = self.index.marks_version
        try:
            save_marks(self.directory, self.index)
        except OSError as exc:
            logger.warning("disk %s: the read marks could not be saved (%s); a crash would lose them",
                           self.directory, exc.strerror)
        except Exception:  # a bug must not stop the writer: only the marks are lost
            logger.exception("disk %s: saving the read marks failed", self.directory)
        self._marks_saved_at, self._marks_saved_version = time.monotonic(), version

    def _sync_journal_if_due(self) -> None:
        now = time.monotonic()
        if self.config.sync and self._journal_fd >= 0 and now - self._journal_synced >= JOURNAL_SYNC_SECONDS:
            self._journal_synced = now
            os.fdatasync(self._journal_fd)

    def _make_room(self, length: int) -> None:
        if self._segment.size and self._segment.size + length > self.config.segment_size:
            self._commit()  # a segment's journal names only its own records
            self._close_segment()
            self._open_segment()
        while self.index.bytes + length > self.config.capacity and len(self.index.segments) > 1:
            self._evict_oldest()

    def _trim_to_capacity(self) -> None:
        """A start under a smaller ``capacity`` than the directory holds (the flag lowered, a
        CacheCluster's ``spec.disk.capacity`` changed): the oldest segments go now, before the
        node announces anything, rather than at the next write."""
        before = self.index.bytes
        while self.index.bytes > self.config.capacity and len(self.index.segments) > 1:
            self._evict_oldest()
        self.report.dropped["over_capacity_bytes"] += before - self.index.bytes

    def _evict_oldest(self, carry: bool = True) -> None:
        """Evict the oldest segment (not the open one), carrying forward what was read from it
        first (``carry`` and the second-chance eviction; not on a full filesystem)."""
        number = next(iter(self.index.segments))
        if number == self._segment.number:
            return
        journal: dict[bytes, Stored] | None = None
        if carry and self.config.eviction is Eviction.SECOND_CHANCE:
            journal = self._carry_forward(number)
        with self._cond:
            segment = self.index.segments[number]
            keys = self.index.drop_segment(number)
            self.counts["evicted"] += len(keys)
            self.counts["evicted_segments"] += 1
            pinned = segment.readers > 0
        if pinned:
            self._keep_for_readers(segment)
        if self.on_gone is not None and keys and journal is None:
            journal = self._journal_of(number)
        for suffix in (DATA_SUFFIX, JOURNAL_SUFFIX):
            try:
                os.unlink(os.path.join(self.directory, segment_name(number, suffix)))
            except FileNotFoundError:
                pass
        if self.on_gone is not None:
            for key in keys:
                self.on_gone(key, journal.get(key))

    def _keep_for_readers(self, segment: Segment) -> None:
        """Keep an evicted segment's data file open for the reads that pinned it (before its
        name is unlinked); the last of them closes it (``_unpin``)."""
        try:
            fd = self._open_data(segment.number)
        except OSError as exc:
            logger.warning("disk %s: evicted segment %d cannot be kept open for the reads under way (%s): they "
                           "miss", self.directory, segment.number, exc.strerror)
            return
        with self._cond:
            if segment.readers > 0:
                segment.kept, fd = fd, -1
                self.counts["kept_for_reads"] += 1
        if fd >= 0:  # its reads ended meanwhile
            os.close(fd)

    def _carry_forward(self, number: int) -> dict[bytes, Stored] | None:
        """Copy the records of segment ``number`` read since they were written to the end of the
        open segment and journal them there, within the bounds of the module docstring; the
        segment's journal entries by key if they were read (None: nothing to carry)."""
        with self._cond:
            budget = self._carry_budget(number)
            segment, entries = self.index.segments[number], self.index.entries
            chosen = sorted(((key, location) for key in segment.read
                             if (location := entries.get(key)) is not None and location.segment == number),
                            key=lambda pair: pair[1].offset)
        picked, size = [], 0
        for key, location in chosen:
            if size + location.length <= budget:
                picked.append((key, location))
                size += location.length
        if not picked:
            return None
        journal = self._journal_of(number)
        try:
            src = self._open_data(number)
        except OSError as exc:
            logger.warning("disk %s: segment %d cannot be read to carry its read chunks forward (%s): they go",
                           self.directory, number, exc.strerror)
            return journal
        self._commit()  # the batch's records so far are durable and journaled before these follow
        moved: list[tuple[bytes, Location, Location, Stored]] = []
        start = self._segment.size
        try:
            for key, old in picked:
                stored = journal.get(key)
                if stored is None or stored.offset != old.offset:  # the journal names it elsewhere: not ours
                    continue
                offset = self._segment.size
                try:
                    _copy_range(src, self._data_fd, old.offset, offset, old.length)
                except OSError as exc:
                    os.ftruncate(self._data_fd, offset)  # no half record left behind
                    with self._cond:
                        self.counts["carry_errors"] += 1
                    logger.warning("disk %s: carrying a read chunk forward failed (%s): the rest of segment %d "
                                   "goes", self.directory, exc.strerror, number)
                    break
                with self._cond:
                    self._segment.size += old.length
                    self.index.bytes += old.length
                moved.append((key, old, Location(self._segment.number, offset, old.length, old.namespace), stored))
        finally:
            os.posix_fadvise(src, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(src)
        if not moved:
            return journal
        if self.config.sync:
            os.fdatasync(self._data_fd)
        added = []
        with self._cond:
            at = self._segment.journal
            for key, old, new, stored in moved:
                if self.index.entries.get(key) is not old:  # deleted (or dropped as bad) while it was copied
                    continue
                entry = self._index_stored(key, new, stored.blocks, stored.anchor, at)
                added.append(entry)
                at += len(entry)
                self.counts["carried"] += 1
                self.counts["carried_bytes"] += new.length
        if added:
            self._append_journal(b"".join(added))
        if self.config.sync:
            os.posix_fadvise(self._data_fd, start, 0, os.POSIX_FADV_DONTNEED)
        return journal

    def _carry_budget(self, number: int) -> int:
        """Bytes segment ``number`` may carry forward: half its own, and what keeps the open
        segment within twice the segment size (under the index lock)."""
        return max(0, min(self.index.segments[number].size // 2, 2 * self.config.segment_size - self._segment.size))

    def _journal_of(self, number: int) -> dict[bytes, Stored]:
        """Segment ``number``'s ``Stored`` entries by key (the last one of each); {} if unreadable."""
        try:
            with open(os.path.join(self.directory, segment_name(number, JOURNAL_SUFFIX)), "rb") as f:
                entries, _ = decode_entries(f.read())
        except OSError:
            return {}
        return {entry.key: entry for _, entry in entries if type(entry) is Stored}

    def _open_segment(self) -> None:
        number = self._next_number
        self._next_number += 1
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self._data_fd = os.open(os.path.join(self.directory, segment_name(number, DATA_SUFFIX)), flags, 0o600)
        self._journal_fd = os.open(os.path.join(self.directory, segment_name(number, JOURNAL_SUFFIX)), flags, 0o600)
        self._segment = Segment(number)
        with self._cond:
            self.index.segments[number] = self._segment

    def _close_segment(self) -> None:
        for fd in (self._data_fd, self._journal_fd):
            if fd >= 0:
                try:
                    if self.config.sync:
                        os.fdatasync(fd)
                finally:
                    os.close(fd)
        self._data_fd = self._journal_fd = -1

    def wait_if_stalled(self, stop: threading.Event | None = None) -> None:
        """Wait out a ``stall`` (fault injection), or until ``stop`` is set."""
        while (left := self._stall_until - time.monotonic()) > 0:
            if stop is not None:
                if stop.wait(min(left, 0.5)):
                    return
            else:
                time.sleep(min(left, 0.5))


def _copy_range(src: int, dst: int, src_offset: int, dst_offset: int, count: int) -> None:
    """Copy ``count`` bytes of file ``src`` at ``src_offset`` to ``dst`` at ``dst_offset``: in the
    kernel where the filesystem can (``copy_file_range``), else through the process."""
    while count:
        try:
            n = os.copy_file_range(src, dst, count, src_offset, dst_offset)
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            data = os.pread(src, min(count, _COPY_PIECE), src_offset)
            if data:
                _write_all(dst, [data], dst_offset)
            n = len(data)
        if n == 0:
            raise OSError(errno.EIO, "the segment ended inside a record")
        src_offset += n
        dst_offset += n
        count -= n


def _write_all(fd: int, parts: list, offset: int) -> None:
    """``pwritev`` every byte of ``parts`` at ``offset`` (short writes resumed)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.pwritev(fd, views, offset)
        if n == 0:
            raise OSError(errno.EIO, "the disk took no bytes")
        offset += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
