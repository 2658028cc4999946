"""The disk tier's scrubber: every record on disk read again and checked in the background, so
bit rot is found before a GET meets it.

A record that fails its checks is handled as a GET's read handles it (``DiskTier.drop_bad``):
counted as ``corrupt``, dropped from the index (journaled), and told to ``on_gone``, so the node's
KV events stop offering its blocks to routers and a chunk memory still holds is written again.
Without a scrub, a record nobody reads stays offered until its segment is evicted.

Pacing: one record at a time, on a thread of its own (GETs never queue behind it on the reader
pool), at most ``rate`` bytes a second on average, into one buffer of its own as large as the
largest record, held during a pass only; its pages are dropped from the page cache after each
read like every read of the tier's.  A pass walks the segments oldest first and each
in file order (sequential reads), taking each segment's records as they are when it gets there
(a chunk deleted or evicted meanwhile is skipped; a segment unlinked under it ends that
segment).  A pass starts at most every ``interval`` seconds, the first at once: bit rot acquired
while the node was down is looked for first.  A stalled disk stalls the scrub like any disk
operation; ``stop`` ends it within one record.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from .index import Location
from .records import BadRecord

if TYPE_CHECKING:
    from .tier import DiskTier

logger = logging.getLogger(__name__)


class Scrubber:
    """Reads every record of ``tier`` again at ``rate`` bytes/s, a pass at most every ``interval``
    seconds (see the module docstring)."""

    def __init__(self, tier: DiskTier, rate: int, interval: float) -> None:
        self.tier = tier
        self.rate = rate
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scratch = np.empty(0, dtype=np.uint8)  # one buffer, grown to the largest record
        self._next_read = 0.0  # monotonic time the next read may start (the rate's pacing)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvring-disk-scrub", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self._pass()
            except Exception:  # a bug must not take the node down: the next pass tries again
                logger.exception("disk %s: a scrub pass failed", self.tier.directory)
            if self._stop.wait(max(0.0, self.interval - (time.monotonic() - began))):
                return

    def _pass(self) -> None:
        tier = self.tier
        with tier.index.lock:
            numbers = list(tier.index.segments)
        for number in numbers:
            for key, location in self._records(number):
                if self._stop.is_set() or not self._check(key, location):
                    break
        self._scratch = np.empty(0, dtype=np.uint8)  # held during a pass only
        if not self._stop.is_set():
            with tier.index.lock:
                tier.counts["scrub_passes"] += 1

    def _records(self, number: int) -> list[tuple[bytes, Location]]:
        """Segment ``number``'s records on disk now, in file order (none if it is gone)."""
        index = self.tier.index
        with index.lock:
            segment = index.segments.get(number)
            if segment is None:
                return []
            entries = index.entries
            return [(key, loc) for key in segment.keys if (loc := entries.get(key)) is not None
                    and loc.segment == number]

    def _check(self, key: bytes, location: Location) -> bool:
        """Read and check one record (paced); False when its segment is gone (skip the rest)."""
        tier = self.tier
        with tier.index.lock:
            if tier.index.entries.get(key) is not location:
                return True  # deleted, or written again elsewhere, since the snapshot
        self._pace(location.length)
        tier.wait_if_stalled(self._stop)
        if self._stop.is_set():
            return False
        try:
            tier.read_record(key, location, self._buffer)
        except FileNotFoundError:
            return False  # evicted since
        except BadRecord as exc:
            tier.drop_bad(key, location, f"{exc} (found by the scrub)")
        except OSError as exc:
            tier.read_failed(key, location, exc)
        with tier.index.lock:
            tier.counts["scrubbed"] += 1
            tier.counts["scrubbed_bytes"] += location.length
        return True

    def _pace(self, nbytes: int) -> None:
        """Wait until reading ``nbytes`` more keeps the average at ``rate`` bytes a second."""
        now = time.monotonic()
        start = max(self._next_read, now)
        self._next_read = start + nbytes / self.rate
        if start > now:
            self._stop.wait(start - now)

    def _buffer(self, nbytes: int) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes]
