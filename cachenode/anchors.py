"""Deleting the anchor of a chunk one of whose parts this node let go.

The connector stores a chunk's KV as parts spread over the nodes (``connector/parts.py``), and a
load needs every full-attention part.  One part, the chunk's *anchor*, names the chunk's vLLM
blocks: the pool's KV events credit routers with the chunk while it is held.  Each other
full-attention part carries the anchor's key (``ChunkMeta.anchor``).  When a node lets such a
part go by itself (evicted from memory, and from its disk if it has one; dropped as corrupt; its
disk write failed after memory let it go), the chunk can no longer be loaded whole, unless
another node holds a copy of that part.  Its anchor would go on being credited, and would take
memory that chunks a load can take could use.

``AnchorDrops`` collects those parts as they go (on any thread, never blocking) and, on a thread
of its own, every ``interval`` seconds:

1. asks every owner of each part whether it holds it (``ClusterClient.held_nowhere``: a copy on a
   replica, a part handed off to its new owner, or a save that stored it again since, keeps the
   chunk; so does an owner that does not answer);
2. deletes, on all their owners, the anchors of the parts held nowhere.  The anchor's node
   announces its blocks removed, and the pool stream withdraws them.

Bounded: at most ``max_pending`` parts wait (past that they are counted ``skipped``, and their
anchors stay, as they would without this); a batch that fails (etcd or the owners unreachable) is
counted ``failed`` and dropped, not retried.  A delete that races a new save of the same chunk
costs that chunk (its next lookup misses, it is computed and saved again), never wrong KV: a
chunk without its anchor is a miss.  Deletes and flushes do not come here: whoever deleted
a chunk deleted what it meant to.  A part lost where no node sees it go (its node killed, or
restarted without its disk) is found by the connector's lookups instead, which delete the anchor
the same way (``ClusterClient.drop_anchors``; ``kvring.connector.broken_chunks``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvring.common.errors import KVRingError

from .client.cluster import ClusterClient

logger = logging.getLogger(__name__)


@dataclass
class AnchorCounts:
    """What ``AnchorDrops`` did (``/stats``'s ``anchors``)."""

    parts: int = 0  # parts let go that carried an anchor, taken up
    held_elsewhere: int = 0  # of those, held by another node (or an owner did not answer): kept
    anchors_deleted: int = 0  # anchor copies deleted
    skipped: int = 0  # parts not taken up: ``max_pending`` already waited
    failed: int = 0  # parts of batches that failed (the cluster unreachable): their anchors stay

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class AnchorDrops:
    def __init__(self, connect: Callable[[], ClusterClient], interval: float = 0.2, batch: int = 1024,
                 max_pending: int = 65536) -> None:
        self._connect = connect
        self.interval = interval
        self.batch = batch
        self.max_pending = max_pending
        self.counts = AnchorCounts()
        self._lock = threading.Lock()
        self._pending: dict[bytes, bytes] = {}  # part key -> its anchor, in the order they went
        self._stop = threading.Event()
        self._failing = ""
        self._thread = threading.Thread(target=self._run, name="kvring-anchors", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def part_gone(self, key: bytes, anchor: bytes) -> None:
        """``key``, a part of the chunk ``anchor`` names, left this node by itself (any thread)."""
        if key == anchor:
            return
        with self._lock:
            if key in self._pending:
                return
            if len(self._pending) >= self.max_pending:
                self.counts.skipped += 1
                return
            self._pending[key] = anchor
            self.counts.parts += 1

    def _take(self) -> dict[bytes, bytes]:
        with self._lock:
            if len(self._pending) <= self.batch:
                taken, self._pending = self._pending, {}
                return taken
            keys = list(self._pending)[:self.batch]
            return {key: self._pending.pop(key) for key in keys}

    def _run(self) -> None:
        client: ClusterClient | None = None
        try:
            while not self._stop.wait(self.interval):
                while (taken := self._take()) and not self._stop.is_set():
                    try:
                        if client is None:
                            client = self._connect()
                        self._drop(client, taken)
                    except KVRingError as exc:
                        with self._lock:
                            self.counts.failed += len(taken)
                        if str(exc) != self._failing:
                            logger.warning("cannot delete the anchors of %d parts let go (kept): %s", len(taken), exc)
                            self._failing = str(exc)
                        break
                    self._failing = ""
        finally:
            if client is not None:
                client.close()

    def _drop(self, client: ClusterClient, taken: dict[bytes, bytes]) -> None:
        dropped = client.drop_anchors(taken)
        with self._lock:
            self.counts.held_elsewhere += dropped.held
            self.counts.anchors_deleted += dropped.copies_deleted
