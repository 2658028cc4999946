"""Repair: one pass that gives every chunk a node holds all of its owners' copies.

A node runs a pass (from the handoff thread, ``handoff.py``) after every change of the ring or
of a member's incarnation -- a node joined, left, or came back empty under its id -- and every
``interval`` seconds besides (a PUT that missed a replica while it was down).  The pass pages
through the node's own keys; for each page it asks every other owner which of the keys it holds
(one LOOKUP per owner, nothing leased) and then:

- a key this node **owns** whose other owners lack it is copied to them -- by one holder only:
  the first owner, in ring order, that holds it (each holder reaches the same verdict from the
  same answers, so two survivors do not both send the copy);
- a key this node **does not own** (the ring moved, or the node is draining) is copied to every
  owner that lacks it, and this copy is deleted once every owner holds it (while draining: once
  one does -- the node is leaving and must not wait on a dead owner).

An owner that does not answer is neither copied to nor counted: the pass is ``incomplete`` and
the handoff thread runs it again soon.  A periodic pass (no membership change) does not copy to
an owner whose memory is at least ``FULL`` used: there a missing copy is most likely one that
node evicted, and copying it back would only evict another, warmer chunk.  Copies are read from this node and sent at most
``RateLimit`` bytes per second (drains are not limited: the node is on its way out), so repair
never crowds out serving.  ``RepairProgress`` is what ``/stats`` shows as ``repair``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from kvring.common.chunk import ChunkItem
from kvring.common.errors import KVRingError
from kvring.common.ring import HashRing

from .client import ClusterClient

logger = logging.getLogger(__name__)

FULL = 0.9  # share of its budget above which a node gets no copies from periodic passes


def full_nodes(stats: dict[str, dict]) -> frozenset[str]:
    """Nodes (from ``ClusterClient.stats()``) using at least ``FULL`` of their budget."""
    return frozenset(n for n, st in stats.items()
                     if isinstance(st.get("used"), int) and st.get("capacity") and st["used"] >= FULL * st["capacity"])


@dataclass
class RepairProgress:
    """The current (or last) repair pass and the totals so far (``/stats``'s ``repair``)."""

    active: bool = False  # a pass is running
    trigger: str = ""  # why it runs: "ring epoch N", "periodic", "retry"
    passes: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    last_pass_s: float | None = None
    scanned: int = 0  # keys of this node examined in this pass
    missing: int = 0  # owner copies found missing in this pass
    copied: int = 0  # of those, made
    copied_bytes: int = 0
    unreachable: int = 0  # owner answers that did not come (the pass runs again)
    copied_total: int = 0  # every copy made, all passes (counted as each is made)
    copied_bytes_total: int = 0
    rate_limit: int = 0  # bytes per second (0: none)
    epoch: int = 0  # ring epoch of the current (or last) pass
    last_epoch: int = 0  # ring epoch of the last finished pass
    incomplete: bool = False  # the last finished pass left work (an owner did not answer): it runs again soon

    # Read by the registration thread while the handoff thread writes: ``begin`` sets ``active``
    # first and leaves ``last_epoch``/``incomplete`` alone; ``end`` sets those before it clears
    # ``active``.  So a reader that sees ``active`` False reads the last finished pass's verdict.

    def begin(self, trigger: str, epoch: int = 0) -> None:
        """A pass starts: its own counts from zero, the totals kept."""
        self.active, self.trigger = True, trigger
        self.epoch = epoch
        self.scanned = self.missing = self.copied = self.copied_bytes = self.unreachable = 0
        self.started_at, self.finished_at = time.time(), None

    def made(self, nbytes: int) -> None:
        """A copy of ``nbytes`` was stored on an owner: it counts in this pass and in the totals
        at once (a reader never sees a copy in place that the totals do not count)."""
        self.copied += 1
        self.copied_bytes += nbytes
        self.copied_total += 1
        self.copied_bytes_total += nbytes

    def end(self, incomplete: bool = False) -> None:
        """The pass is over (finished or broken off)."""
        self.last_epoch, self.incomplete = self.epoch, incomplete
        self.active = False
        self.passes += 1
        self.finished_at = time.time()
        self.last_pass_s = round(self.finished_at - (self.started_at or self.finished_at), 3)

    @property
    def moving(self) -> bool:
        """Copies are being restored right now (what makes a cluster ``Rebalancing``)."""
        return self.active and self.missing > self.copied

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "moving": self.moving}


class RateLimit:
    """A token bucket of ``rate`` bytes per second (one second of burst); 0 means no limit."""

    def __init__(self, rate: int, stop: threading.Event) -> None:
        self.rate = rate
        self._stop = stop
        self._tokens = float(rate)
        self._at = time.monotonic()

    def take(self, nbytes: int) -> None:
        """Wait until ``nbytes`` may be sent (returns early if the thread is stopping)."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        self._tokens = min(float(self.rate), self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= nbytes
        if self._tokens < 0:
            self._stop.wait(-self._tokens / self.rate)


@dataclass
class PageVerdict:
    """What one page's owners hold, and which copies to make."""

    keys: list[bytes]
    owners: list[list[str]]
    holders: list[set[str]]  # owners known to hold each key (this node included when it holds it)
    unreachable: list[set[str]] = field(default_factory=list)  # owners that did not answer


class RepairPass:
    """One pass over a node's keys on ``ring`` (see the module docstring)."""

    def __init__(self, client: ClusterClient, node_id: str, ring: HashRing, progress: RepairProgress,
                 limit: RateLimit, stop: threading.Event, draining: bool = False, page: int = 1024,
                 batch: int = 32, avoid: frozenset[str] = frozenset()) -> None:
        self.client = client
        self.node_id = node_id
        self.ring = ring
        self.progress = progress
        self.limit = limit
        self.stop = stop
        self.draining = draining
        self.avoid = avoid  # owners not to copy to (full ones, in a periodic pass)
        self.page = page
        self.batch = batch
        self.moved = 0  # chunks this node no longer owns, handed to their owners and deleted here
        self.incomplete = False  # some owner did not answer or refused: run again soon

    def run(self) -> int:
        """Walk every key; returns how many chunks left this node (handed off)."""
        after = b""
        while not self.stop.is_set():
            keys = self.client.list_keys(self.node_id, after, self.page)
            if not keys:
                break
            after = keys[-1]
            self.progress.scanned += len(keys)
            self._settle(self._survey(keys))
        return self.moved

    def _survey(self, keys: list[bytes]) -> PageVerdict:
        owners = self.ring.owners_many(keys)
        verdict = PageVerdict(keys, owners, [set() for _ in keys], [set() for _ in keys])
        ask: dict[str, list[int]] = defaultdict(list)
        for i, key_owners in enumerate(owners):
            verdict.holders[i].add(self.node_id)  # listed here, so held here
            for node_id in key_owners:
                if node_id != self.node_id:
                    ask[node_id].append(i)
        for node_id, idx in ask.items():
            try:
                present = self.client.holders(node_id, [keys[i] for i in idx])
            except KVRingError as exc:
                logger.debug("repair: %s did not answer: %s", node_id, exc)
                self.incomplete = True
                self.progress.unreachable += 1
                for i in idx:
                    verdict.unreachable[i].add(node_id)
                continue
            for i, hit in zip(idx, present):
                if hit:
                    verdict.holders[i].add(node_id)
        return verdict

    def _settle(self, v: PageVerdict) -> None:
        send: dict[str, list[int]] = defaultdict(list)  # node -> positions to copy to it
        leaving: list[int] = []
        for i, owners in enumerate(v.owners):
            lacking = [n for n in owners if n not in v.holders[i] and n not in v.unreachable[i]
                       and n not in self.avoid]
            owned = self.node_id in owners
            if owned and lacking and next(n for n in owners if n in v.holders[i]) != self.node_id:
                lacking = []  # an earlier owner holds it and sends the copies
            for node_id in lacking:
                send[node_id].append(i)
            self.progress.missing += len(lacking)
            if not owned:
                leaving.append(i)
        if send:
            self._copy(v, send)
        gone = [v.keys[i] for i in leaving if self._may_drop(v, i)]
        if gone:
            self.client.delete(gone, node=self.node_id)
            self.moved += len(gone)
        if len(gone) < len(leaving):  # some stay until their owners hold them: look again soon
            self.incomplete = True

    def _may_drop(self, v: PageVerdict, i: int) -> bool:
        held = [n for n in v.owners[i] if n in v.holders[i]]
        if self.draining:
            return bool(held)
        return len(held) == len(v.owners[i])

    def _copy(self, v: PageVerdict, send: dict[str, list[int]]) -> None:
        wanted = sorted({i for idx in send.values() for i in idx})
        for start in range(0, len(wanted), self.batch):
            if self.stop.is_set():
                return
            part = wanted[start:start + self.batch]
            chunks = self.client.get([v.keys[i] for i in part], node=self.node_id)
            items = {i: ChunkItem(c.key, c.data, c.meta) for i, c in zip(part, chunks) if c is not None}
            copies = {n: [items[i] for i in idx if i in items] for n, idx in send.items()}
            copies = {n: its for n, its in copies.items() if its}
            nbytes = sum(memoryview(item.payload).nbytes for its in copies.values() for item in its)
            if not self.draining:
                self.limit.take(nbytes)
            by_key = {item.key: i for i, item in items.items()}
            for node_id, stored in self.client.put_to(copies).items():
                for item, ok in zip(copies[node_id], stored):
                    if ok:
                        v.holders[by_key[item.key]].add(node_id)
                        self.progress.made(memoryview(item.payload).nbytes)
                    else:
                        self.incomplete = True

