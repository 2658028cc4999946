"""Withdrawing the chunks a lookup finds broken: the anchor held, a part a load needs gone.

A chunk's anchor (``ChunkParts.anchor``) names its vLLM blocks to the pool's KV events, and each
other full-attention part of the chunk carries the anchor's key.  A node that lets such a part go
by itself deletes the anchor (``kvring.cachenode.anchors``).  But a part can go where no node
sees it go: with a node that was killed, or restarted without its disk, or never stored at all
(one rank's save failed while rank 0's succeeded).  Its chunk would stay credited to routers
until its anchor is evicted, and every request routed to it would recompute.

The scheduler's lookups ask for every part of every chunk of a prompt, so they see such chunks
(``ChunkParts.broken``).  ``BrokenChunks`` takes each one (an anchor at most once per
``recheck`` seconds, of the newest ``16 * max_pending`` remembered; at most ``max_pending``
waiting, the rest counted ``broken_chunks_skipped``)
and, on a thread of its own, ``grace`` seconds later -- a save still under way, whose workers put
a chunk's parts one after another, has finished by then -- asks every owner of the missing parts
whether it holds them (``ClusterClient.drop_anchors``).  The anchors of chunks with a part held
nowhere are deleted on all their owners, and the pool's KV events withdraw those chunks.  A part
some owner holds, or one whose owner did not answer, keeps its chunk.

Nothing here touches what a load reads: a chunk that lacks a part is a miss for every lookup
whether or not its anchor is deleted.  A delete that races a new save of the same chunk costs
that chunk (its next lookup misses, and it is saved again), never wrong KV.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvring.cachenode.client import ClusterClient
from kvring.common.errors import KVRingError

from .stats import Counters

logger = logging.getLogger(__name__)

MAX_SEEN_PER_PENDING = 16  # anchors remembered (taken within ``recheck``), per one that may wait


@dataclass(frozen=True, slots=True)
class _Suspect:
    due: float  # monotonic time after which it is checked
    anchor: bytes
    missing: tuple[bytes, ...]  # the part keys the lookup did not find


class BrokenChunks:
    def __init__(self, client: ClusterClient, counters: Counters, grace: float, recheck: float = 60.0,
                 max_pending: int = 4096, batch: int = 1024) -> None:
        self.client = client
        self.counters = counters
        self.grace = grace
        self.recheck = recheck
        self.max_pending = max_pending
        self.batch = batch  # parts asked about in one round
        self._lock = threading.Lock()
        self._pending: deque[_Suspect] = deque()
        self._seen: dict[bytes, float] = {}  # anchor -> when it was last taken, oldest first
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failing = ""
        self._thread = threading.Thread(target=self._run, name="kvring-broken-chunks", daemon=True)
        self._thread.start()

    def found(self, anchor: bytes, missing: list[bytes]) -> None:
        """A lookup found ``anchor`` and not the parts ``missing`` (the scheduler's thread:
        never blocks on the cluster)."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(anchor)
            if seen is not None and now - seen < self.recheck:
                return
            if len(self._pending) >= self.max_pending:
                self.counters.add(broken_chunks_skipped=1)
                return
            self._seen.pop(anchor, None)
            self._seen[anchor] = now
            while self._seen and (now - next(iter(self._seen.values())) >= self.recheck
                                  or len(self._seen) > MAX_SEEN_PER_PENDING * self.max_pending):
                del self._seen[next(iter(self._seen))]
            self._pending.append(_Suspect(now + self.grace, anchor, tuple(missing)))
        self.counters.add(broken_chunks=1)
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)

    def _due(self) -> list[_Suspect] | float:
        """The suspects due now (at most ``batch`` parts' worth), or how long until the next is."""
        now = time.monotonic()
        taken: list[_Suspect] = []
        parts = 0
        with self._lock:
            while self._pending and self._pending[0].due <= now and (not taken or parts < self.batch):
                suspect = self._pending.popleft()
                taken.append(suspect)
                parts += len(suspect.missing)
            if taken:
                return taken
            return self._pending[0].due - now if self._pending else 3600.0

    def _run(self) -> None:
        while not self._stop.is_set():
            due = self._due()
            if isinstance(due, float):
                self._wake.wait(due)
                self._wake.clear()
                continue
            self._check(due)

    def _check(self, suspects: list[_Suspect]) -> None:
        parts = {key: s.anchor for s in suspects for key in s.missing}
        try:
            dropped = self.client.drop_anchors(parts)
        except Exception as exc:  # the cluster could not be asked (or a bug): the chunks stay credited
            if not isinstance(exc, KVRingError):
                logger.exception("kvring: checking the chunks found broken failed")
            elif str(exc) != self._failing:
                logger.warning("kvring: cannot check %d chunks found broken (they stay credited): %s",
                               len(suspects), exc)
                self._failing = str(exc)
            return
        self._failing = ""
        self.counters.add(broken_chunks_withdrawn=len(dropped.anchors))
        if dropped.anchors:
            logger.info("kvring: withdrew %d chunks that had lost a part (their anchors deleted)",
                        len(dropped.anchors))
