"""What a node holds: its memory store and, with ``--disk-dir``, its disk tier, as one set.

The data protocol sees one set of chunks: a LOOKUP finds a chunk in either tier, a GET serves
it from either, a DELETE or flush takes it from both, a key listing (repair, handoff) pages
through both.  Memory is the hot tier over the disk:

- A PUT stores the chunk in memory and queues it for the disk (``DiskTier.write``); a chunk
  evicted from memory stays on disk.
- A GET of a chunk only on disk reads it on the tier's reader threads, promotes it into memory
  (it is in use) and answers once every key asked for is read, or after ``read_timeout``
  seconds with what came (the rest as misses): a stalled disk delays only the GETs that need
  it, never the data loop.  Reads of one key already under way are shared.  One that was under
  way when its segment was evicted still serves (it was read whole and checked); one whose key
  was deleted or namespace flushed meanwhile does not.  A chunk memory let go while its disk
  write is still queued is served from the queued write's buffer, and memory takes it back.
- A LOOKUP that leases chunks found only on disk (a worker is about to load them) starts reading
  them into memory at once, so the GET that follows finds them there: the read pins its segment
  (evicted meanwhile, it is read all the same: ``DiskTier.read``), and memory takes the chunk
  under what is left of the lease, as if the LOOKUP had found it there.  At most
  ``MAX_PREFETCHES`` such reads are under way; past that (``prefetch_skipped``) a GET reads for
  itself, and a chunk evicted from the disk before it comes is a miss.
- What waits on a slow disk is bounded: at most ``MAX_READS`` keys are being read at once (past
  it a GET answers the rest as misses), and a GET does not wait on a read already older than
  the read timeout (the disk is stalled: a miss at once, not another waiter).

KV events (``events.py``) follow what the node holds, not which tier: a chunk moving between
memory and disk is not announced; one that leaves both is (also one memory let go while its disk
write was queued, if the write then fails or the chunk is deleted first).  A node that restarts
with chunks on disk announces them again after its ``AllBlocksCleared``, at the publisher's pace:
a thread reads the journals, the loop announces what the disk still holds.  A chunk part that
leaves both tiers by itself (evicted, dropped as corrupt, its disk write failed), not deleted,
hands the anchor it names to ``anchors`` (``anchors.py``).

Threading contract: everything here runs on the data loop, except ``_announce`` (the journal
reader's thread, which posts its pieces to the loop) and the tier's callbacks, which
``Server.post`` back to the loop.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvring.common.chunk import ChunkBlocks, ChunkMeta

from .anchors import AnchorDrops
from .disk.records import JOURNAL_SUFFIX, Stored, decode_blocks, decode_entries, segment_name
from .disk.tier import DiskTier, Dropped, ReadResult
from .events import NodeEvents
from .server import Server
from .store import ChunkStore, Entry, StoreFull

logger = logging.getLogger(__name__)

MAX_PREFETCHES = 256
MAX_READS = 4096
ANNOUNCE_PIECE = 1024  # chunks kept over a restart announced in one turn of the loop


class Holdings:
    def __init__(self, store: ChunkStore, disk: DiskTier | None, server: Server,
                 events: NodeEvents | None = None) -> None:
        self.store = store
        self.disk = disk
        self.server = server
        self.events = events
        self._reading: dict[bytes, _Read] = {}
        self.prefetched = 0
        self.prefetch_skipped = 0  # leased chunks on disk not read ahead (``MAX_PREFETCHES`` under way)
        self.rewritten = 0  # chunks written to the disk again as their segment went (``_disk_gone``)
        # Rewriting what memory holds ends only where evicting a segment frees cold bytes too: on a
        # disk with room for memory twice over (and two segments of slack).  A smaller one, where
        # each rewrite would push out the next segment of rewrites without end, keeps plain FIFO.
        self._rewrites = disk is not None and (
            disk.config.capacity >= 2 * store.capacity + 2 * disk.config.segment_size)
        self.read_timeouts = 0
        self.announced_kept = 0  # chunks the disk kept over the restart, announced
        self.anchors: AnchorDrops | None = None  # the node sets it once it has a cluster client
        store.watch(_Leaving(self))
        if disk is not None:
            disk.on_gone = lambda key, stored: server.post(lambda: self._disk_gone(key, stored, evicted=True))
            disk.on_unwritten = lambda key, meta: server.post(lambda: self._unwritten(key, meta))

    # ---- presence --------------------------------------------------------------------------

    def lookup(self, keys: list[bytes], lease_ms: int) -> list[bool]:
        present = self.store.lookup(keys, lease_ms)
        disk = self.disk
        if disk is None or all(present):
            return present
        until = time.monotonic() + lease_ms / 1000
        for i, key in enumerate(keys):
            if not present[i] and key in disk:
                present[i] = True
                if lease_ms > 0 and disk.holds(key):
                    if key in self._reading or len(self._reading) < MAX_PREFETCHES:
                        self.prefetched += 1
                        self._read(key, lambda _entry: None, until)
                    else:
                        self.prefetch_skipped += 1
        return present

    def __contains__(self, key: bytes) -> bool:
        """Held in either tier (not a use, nothing leased)."""
        return key in self.store or (self.disk is not None and key in self.disk)

    def __len__(self) -> int:
        """Chunks held in either tier (counted once)."""
        if self.disk is None:
            return len(self.store)
        disk = self.disk
        return len(disk) + sum(1 for key in self.store.keys() if not disk.holds(key))

    def keys_after(self, after: bytes, limit: int) -> list[bytes]:
        keys = self.store.keys_after(after, limit)
        if self.disk is None:
            return keys
        return heapq.nsmallest(limit, set(keys).union(self.disk.keys_after(after, limit)))

    # ---- changes ---------------------------------------------------------------------------

    def put(self, key: bytes, meta: ChunkMeta, buf) -> bool:
        """Store a chunk (``StoreFull`` as ``ChunkStore.put``); False if memory had it already."""
        stored = self.store.put(key, meta, buf)
        if stored and self.disk is not None:
            self.disk.write(key, meta, buf)
        return stored

    def delete(self, key: bytes) -> bool:
        if self.disk is None:
            return self.store.delete(key)
        read = self._reading.get(key)
        if read is not None:
            read.deleted = True  # what it brings back is not held any more
        dropped = self.disk.delete(key)
        if self.store.delete(key):
            return True
        if dropped is not None:
            self._left_disk(key, dropped)
        return dropped is not None

    def delete_namespace(self, namespace: str) -> int:
        if not namespace:
            raise ValueError("refusing to flush the empty namespace (it would mean chunks that have none)")
        if self.disk is None:
            return self.store.delete_namespace(namespace)
        for read in self._reading.values():  # their namespaces are known only once they are read
            read.flushed.add(namespace)
        only_on_disk = 0
        for key, dropped in self.disk.delete_namespace(namespace).items():
            if key not in self.store:
                only_on_disk += 1
                self._left_disk(key, dropped)
        return self.store.delete_namespace(namespace) + only_on_disk

    # ---- reads -----------------------------------------------------------------------------

    def fetch(self, keys: list[bytes], done: Callable[[list[Entry | None]], None]) -> None:
        """The entries of ``keys`` (None: not held), reading from the disk what is only there;
        ``done`` runs on the loop, at once if nothing needs the disk, else once every read is
        back or the disk's ``read_timeout`` has passed."""
        entries = [self.store.get(key) for key in keys]
        disk = self.disk
        if disk is not None and not all(entries):
            for i, key in enumerate(keys):
                if entries[i] is None:
                    entries[i] = self._from_queue(key)
        timeout = disk.config.read_timeout if disk is not None else 0.0
        # A read under way is waited for even if its segment was evicted since: it is pinned.
        waiting = [i for i, e in enumerate(entries) if e is None and disk is not None
                   and (keys[i] in self._reading or disk.holds(keys[i])) and self._can_wait(keys[i], timeout)]
        if not waiting:
            done(entries)
            return
        left = set(waiting)
        answered = False

        def finish() -> None:
            nonlocal answered
            if not answered:
                answered = True
                if left:
                    self.read_timeouts += 1
                done(entries)

        def arrived(i: int, entry: Entry | None) -> None:
            if answered:
                return
            entries[i] = entry
            left.discard(i)
            if not left:
                finish()

        for i in waiting:
            self._read(keys[i], lambda entry, i=i: arrived(i, entry))
        if left:
            self.server.later(timeout, finish)

    def _from_queue(self, key: bytes) -> Entry | None:
        """A chunk memory let go while its disk write is still queued: taken back into memory from
        the queue's buffer (the pool never hands out a buffer something still references)."""
        queued = self.disk.queued(key)
        if queued is None:
            return None
        return self._hold(key, *queued)  # held in both tiers again: nothing announced

    def _hold(self, key: bytes, meta: ChunkMeta, buf) -> Entry:
        """Memory takes a chunk back from the disk tier (its entry; one held nowhere if memory is
        full of leased chunks)."""
        try:
            self.store.put(key, meta, buf)
            return self.store.peek(key)
        except StoreFull:
            return Entry(meta, buf)

    def _can_wait(self, key: bytes, timeout: float) -> bool:
        read = self._reading.get(key)
        if read is None:
            return len(self._reading) < MAX_READS
        return time.monotonic() - read.started < timeout

    def _read(self, key: bytes, then: Callable[[Entry | None], None], lease_until: float = 0.0) -> None:
        """Read ``key`` from the disk (or join its read under way); ``lease_until``: a LOOKUP's
        lease (monotonic seconds) memory keeps it under once it is back."""
        read = self._reading.get(key)
        if read is not None:
            read.waiters.append(then)
            read.lease_until = max(read.lease_until, lease_until)
            return
        self._reading[key] = _Read(time.monotonic(), [then], lease_until=lease_until)
        self.disk.read(key, lambda result: self.server.post(lambda: self._read_done(key, result)))

    def _read_done(self, key: bytes, result: ReadResult) -> None:
        """A disk read is back: its chunk goes into memory and to whoever waits for it, unless it
        was deleted (or its namespace flushed) meanwhile.  One whose segment was evicted meanwhile
        is served and held in memory: it was read whole and checked, and the eviction already
        told the KV events it left the disk (memory holding it again tells them it is back)."""
        entry = None
        read = self._reading.pop(key, None)
        if result.meta is not None and read is not None and not read.deleted \
                and result.meta.namespace not in read.flushed:
            entry = self.store.get(key)
            if entry is None:
                entry = self._hold(key, result.meta, result.buf)
            lease_ms = int((read.lease_until - time.monotonic()) * 1000)
            if lease_ms > 0:
                self.store.lookup([key], lease_ms)  # held as the LOOKUP would have found it (if in memory)
        for then in read.waiters if read is not None else ():
            then(entry)

    # ---- what leaves the node -------------------------------------------------------------

    def _left_disk(self, key: bytes, dropped: Dropped) -> None:
        """A chunk memory no longer held was deleted from the disk: announce its blocks (read from
        its journal entry, or the ones its queued write carried)."""
        if self.events is None:
            return
        if dropped.location is not None:
            self.disk.entry_of(dropped.location,
                               lambda stored: self.server.post(lambda: self._disk_gone(key, stored, evicted=False)))
        elif dropped.blocks is not None:
            self.events.blocks_changed(False, dropped.blocks)

    def _unwritten(self, key: bytes, meta: ChunkMeta) -> None:
        """Memory let a chunk go while it was queued for the disk (so did not announce it), and
        the write failed: unless it is held again since, it is held nowhere now."""
        if key not in self.disk and key not in self.store:
            self._gone(key, meta.blocks, meta.anchor, evicted=True)

    def _disk_gone(self, key: bytes, stored: Stored | None, evicted: bool) -> None:
        """A chunk left the disk (``evicted`` with its segment or dropped as corrupt; else
        deleted), with its journal entry.  If memory still holds it (it is in use: a hot prefix),
        it is written again, to the newest segment, so the disk keeps holding all that memory does
        and the chunk outlasts the disk's first-in-first-out cycling and a restart (a delete or
        flush took it from memory first); not on a disk too small for that (``_rewrites``).  Else,
        unless the disk has it again, it is gone."""
        if key in self.disk:
            return
        entry = self.store.peek(key)
        if entry is not None:
            if self._rewrites and self.disk.write(key, entry.meta, entry.buf):
                self.rewritten += 1
            return
        if stored is not None:
            self._gone(key, decode_blocks(stored.blocks), stored.anchor, evicted)

    def _gone(self, key: bytes, blocks: ChunkBlocks | None, anchor: bytes | None, evicted: bool) -> None:
        """``key`` is held in neither tier any more: its blocks are announced removed, and a part
        that went by itself (``evicted``: not deleted) hands its chunk's anchor to ``anchors``."""
        if self.events is not None and blocks is not None:
            self.events.blocks_changed(False, blocks)
        if evicted and anchor is not None and self.anchors is not None:
            self.anchors.part_gone(key, anchor)

    def announce_disk(self) -> None:
        """Announce the chunks the disk kept over a restart: a thread of its own reads the
        journals, the loop announces what the disk still holds (``_announce_kept``)."""
        if self.events is None or self.disk is None or not len(self.disk):
            return
        threading.Thread(target=self._announce, name="kvring-disk-announce", daemon=True).start()

    def _announce(self) -> None:
        disk, publisher = self.disk, self.events.publisher
        for number in list(disk.index.segments):
            try:
                with open(os.path.join(disk.directory, segment_name(number, JOURNAL_SUFFIX)), "rb") as f:
                    entries, _ = decode_entries(f.read())
            except OSError:
                continue
            kept = [_Kept(entry.key, number, entry.offset, blocks) for _, entry in entries
                    if type(entry) is Stored and (blocks := decode_blocks(entry.blocks)) is not None]
            for start in range(0, len(kept), ANNOUNCE_PIECE):
                while publisher.backlog > publisher.settings.max_queued // 2:
                    time.sleep(0.01)
                piece, done = kept[start:start + ANNOUNCE_PIECE], threading.Event()
                self.server.post(lambda piece=piece, done=done: (self._announce_kept(piece), done.set()))
                done.wait()  # the backlog above counts it once announced
        self.server.post(lambda: logger.info("disk %s: announced %d chunks kept over the restart", disk.directory,
                                             self.announced_kept))

    def _announce_kept(self, kept: list[_Kept]) -> None:
        """Announce the chunks of ``kept`` the disk still holds where their journal entry put
        them.  On the loop, as deletes are, so a chunk deleted or evicted while the journals were
        read is either not announced or announced before its removal, never after it."""
        entries = self.disk.index.entries
        for k in kept:
            location = entries.get(k.key)
            if location is not None and location.segment == k.segment and location.offset == k.offset:
                self.events.blocks_changed(True, k.blocks)
                self.announced_kept += 1


@dataclass(slots=True)
class _Kept:
    """A chunk a journal names, with its vLLM blocks, to announce if the disk still holds it."""

    key: bytes
    segment: int
    offset: int
    blocks: ChunkBlocks


@dataclass(slots=True)
class _Read:
    """A disk read under way and who waits for it."""

    started: float  # monotonic
    waiters: list[Callable[[Entry | None], None]]
    lease_until: float = 0.0  # a LOOKUP's lease (monotonic), which memory holds the chunk under
    deleted: bool = False  # its key was deleted meanwhile
    flushed: set[str] = field(default_factory=set)  # namespaces flushed meanwhile


class _Leaving:
    """The memory store's watcher: passes on what changes the node's holdings, not what moves
    between its tiers."""

    def __init__(self, holdings: Holdings) -> None:
        self.holdings = holdings

    def stored(self, key: bytes, meta: ChunkMeta) -> None:
        disk, events = self.holdings.disk, self.holdings.events
        if events is not None and (disk is None or key not in disk):  # else: read back from the disk
            events.stored(key, meta)

    def removed(self, key: bytes, meta: ChunkMeta, evicted: bool) -> None:
        disk = self.holdings.disk
        if disk is None or not disk.take_over(key):  # else: it stays on disk (or says if its write fails)
            self.holdings._gone(key, meta.blocks, meta.anchor, evicted)
