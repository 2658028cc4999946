"""The client's view of the cluster: members, the ring, the previous ring, failure marks.

Threading contract: ``Membership`` runs its tasks on the process's etcd loop
(``kvring.membership.loop``, one daemon thread shared by every client of the process; the only
place the client touches etcd): it reads the cluster once and then **watches** its prefix: an idle
client sends etcd nothing.  Each change publishes an immutable ``RingView`` snapshot; callers on
any thread read ``membership.view`` once per call and route with it, so a call never sees half
of a change.  When the watch breaks (etcd restarted, a connection lost) or its revision was
compacted away, the client reads the whole cluster again and watches from there; it also does
so every ``resync_interval`` seconds, which bounds how long a silently dead connection could
hide a change.  ``FailureMarks`` (ejected nodes) is written and read by any thread (single
dict operations, atomic under the GIL).

After a ring change the old ring stays in the view as ``prev_ring`` for ``handoff_window``
seconds: a key missed on its new owner is looked for on its previous owner, so moving
ownership does not turn into a burst of misses.  If etcd goes away the client keeps routing
with the last view it had.

The contract is never a default: a client given none waits (up to ``contract_wait`` seconds)
for the cluster's first node to record it, and fails with a clear error if none does.  Every
change of it is seen: gone (etcd lost its data) keeps the one in use -- the nodes write it back
-- and a different one sets ``conflict``, which turns every read into a miss and every write into
a no-op (the connector recomputes) until the process restarts with the cluster's contract.
``require`` names what else a process cannot work with (the connector: a chunk size other than
its own): a contract it rejects is a conflict too.

A client that must not wait for the cluster (the connector inside vLLM: serving goes on without
its cache) attaches in the background instead (``start_background``): until etcd answers and
the cluster's contract is recorded, it is not ``usable`` -- every read a miss, every write a
no-op -- and it keeps trying, without a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvring.common.contract import Contract
from kvring.common.errors import ContractMismatch, MembershipError, NodeUnavailable
from kvring.common.records import NodeRecord
from kvring.common.ring import HashRing
from kvring.membership.etcd import Change, Etcd, decode_contract, decode_record
from kvring.membership.loop import etcd_loop
from kvring.membership.settings import EtcdSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RingView:
    """One consistent snapshot of the cluster as this client sees it."""

    ring: HashRing
    members: dict[str, NodeRecord] = field(default_factory=dict)
    prev_ring: HashRing | None = None
    prev_until: float = 0.0  # monotonic time until which ``prev_ring`` is consulted

    def previous(self) -> HashRing | None:
        """The ring before the last change, while the handoff window lasts."""
        if self.prev_ring is not None and time.monotonic() < self.prev_until:
            return self.prev_ring
        return None


class FailureMarks:
    """Nodes ejected from this client's routing after a connection failure or a timeout.

    A node is skipped for ``backoff`` seconds after it fails, twice as long for each failure in
    a row (a node that fails again as soon as it is retried), up to ``max_backoff``; then the
    next request tries it again.  The streak starts over once a node has gone ``max_backoff``
    without failing, or when its record changes (it registered again: ``forgive``).  Failures
    of a node already ejected (requests that were in flight) do not lengthen its ejection.
    """

    def __init__(self, backoff: float, max_backoff: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff = backoff
        self.clock = clock
        self.max_backoff = max(backoff, max_backoff)
        self.ejections = 0  # how many times a node was ejected (for metrics)
        self._marks: dict[str, tuple[float, int]] = {}  # node -> (monotonic time it may be retried, streak)

    def alive(self, node_id: str) -> bool:
        mark = self._marks.get(node_id)
        return mark is None or mark[0] < self.clock()

    def mark(self, node_id: str, why: str) -> None:
        now = self.clock()
        until, streak = self._marks.get(node_id, (0.0, 0))
        if until >= now:
            return
        if now - until > self.max_backoff:
            streak = 0
        streak += 1
        wait = min(self.backoff * 2 ** (streak - 1), self.max_backoff)
        self._marks[node_id] = (now + wait, streak)
        self.ejections += 1
        logger.warning("node %s ejected from routing for %.0fs (failure %d in a row): %s", node_id, wait, streak, why)

    def failed(self, node_id: str, error: Exception) -> None:
        """A request to ``node_id`` failed: eject it if the node itself is at fault (it could not
        be reached or did not answer), not for an error it answered with."""
        if isinstance(error, NodeUnavailable):
            self.mark(node_id, str(error))

    def forgive(self, node_id: str) -> None:
        self._marks.pop(node_id, None)


class Membership:
    """Follows a cluster's members in etcd (see the module docstring)."""

    def __init__(self, settings: EtcdSettings, contract: Contract | None, resync_interval: float,
                 handoff_window: float, on_members: Callable[[dict[str, NodeRecord]], None],
                 contract_wait: float = 30.0, require: Callable[[Contract], list[str]] | None = None) -> None:
        self.settings = settings
        self.contract = contract
        self.contract_wait = contract_wait
        self.require = require  # what else this process cannot work with in a contract (its differences)
        self.conflict: str | None = None  # how the recorded contract differs from the one in use
        self.attached = threading.Event()  # the contract is known and the members were read once
        self.resync_interval = resync_interval
        self.handoff_window = handoff_window
        self.on_members = on_members  # called (on the membership thread) before a new view is published
        self.view = RingView(HashRing({}, epoch=0))
        self.etcd_ok = False
        self.etcd_lost = False  # etcd answers but holds nothing of the cluster (lost its data)
        self.resyncs = 0  # whole-cluster reads after the first (a broken or compacted watch, the interval)
        self.changed = threading.Condition()
        self._etcd = Etcd(settings)
        self._members: dict[str, NodeRecord] = {}  # as etcd has them (the view may keep an older ring)
        self._revision = 0  # the etcd revision the client is up to date with
        self._loop = etcd_loop()
        self._follower: asyncio.Future | None = None
        self._attacher: concurrent.futures.Future | None = None  # ``start_background``'s attempts

    @property
    def usable(self) -> bool:
        """Reads and writes may go to the cluster: attached, under a contract this process takes."""
        return self.attached.is_set() and not self.conflict

    def start(self, timeout: float) -> None:
        """Read (or record) the contract and the members once; then follow them."""
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        try:
            fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise MembershipError(f"etcd did not answer within {timeout:.1f}s") from None

    def start_background(self) -> None:
        """``start`` without waiting, nor a deadline: the client is not ``usable`` until it has
        attached (``attached``), retrying while etcd or the cluster's contract is not there."""
        self._attacher = asyncio.run_coroutine_threadsafe(self._attach(), self._loop)

    async def _attach(self) -> None:
        given, logged = self.contract, False
        while True:
            try:
                await self._start(deadline=math.inf)
                break
            except MembershipError as exc:
                self.contract = given  # one adopted before the failure is read again
                if not logged:
                    logger.warning("cluster %r not reachable yet (%s); reads miss and writes are dropped until it "
                                   "is, trying again", self.settings.cluster, exc)
                    logged = True
                await asyncio.sleep(1.0)
        logger.info("cluster %r reached: contract %s, %d nodes", self.settings.cluster, self.contract,
                    len(self.view.ring))

    async def _start(self, deadline: float | None = None) -> None:
        if self.contract is None:
            self.contract = await self._wait_for_contract(deadline)
        else:
            self.contract = await self._etcd.ensure_contract(self.contract)
        rejected = self.require(self.contract) if self.require is not None else []
        self.conflict = "; ".join(rejected) or None
        if rejected:
            logger.error("%s", ContractMismatch(
                f"the contract of cluster {self.settings.cluster!r} does not suit this process ({self.conflict}); "
                "every read is a miss and every write is dropped"))
        await self._resync()
        self.attached.set()
        self._follower = asyncio.ensure_future(self._follow())

    async def _wait_for_contract(self, deadline: float | None = None) -> Contract:
        """The recorded contract, asked for until ``deadline`` (default: ``contract_wait`` from now;
        ``inf``: a background attach, which asks less often the longer it waits)."""
        deadline = time.monotonic() + self.contract_wait if deadline is None else deadline
        waiting: bool | None = None  # what the last warning said: etcd answering (no contract), or not
        pause = 0.25
        while True:
            try:
                recorded = await self._etcd.read_contract()
                answering, why = True, "has no contract in etcd yet (its first node records it)"
            except MembershipError as exc:
                if time.monotonic() >= deadline:
                    raise
                recorded, answering, why = None, False, f"cannot be read: {exc}"
            if recorded is not None:
                if waiting is not None:
                    logger.info("cluster %r: contract recorded: %s", self.settings.cluster, recorded)
                return recorded
            if time.monotonic() >= deadline:
                raise MembershipError(
                    f"cluster {self.settings.cluster!r} has no contract in etcd at {','.join(self.settings.endpoints)} "
                    f"after {self.contract_wait:.0f}s: none of its nodes has started (start them first, e.g. "
                    "`kvring up`), or the cluster name is wrong")
            if waiting is not answering:
                waiting = answering
                logger.warning("cluster %r %s; %s", self.settings.cluster, why,
                               f"waiting up to {self.contract_wait:.0f}s" if math.isfinite(deadline)
                               else "reads miss and writes are dropped until it is there")
            await asyncio.sleep(pause)
            if not math.isfinite(deadline):
                pause = min(pause * 2, 2.0)

    def _check_contract(self, recorded: Contract | None) -> None:
        if recorded is None:  # etcd lost its data: the nodes write it back
            return
        diff = self.contract.differences(recorded) + (self.require(recorded) if self.require is not None else [])
        conflict = "; ".join(diff) if diff else None
        if conflict != self.conflict:
            if conflict:
                logger.error("%s", ContractMismatch(
                    f"the contract of cluster {self.settings.cluster!r} changed in etcd ({conflict}); every read "
                    "is a miss and every write is dropped until this process restarts with it"))
            else:
                logger.warning("cluster %r: the recorded contract matches this process's again",
                               self.settings.cluster)
        self.conflict = conflict

    async def _follow(self) -> None:
        """Watch the cluster; after a break, or every ``resync_interval``, read it whole again --
        and watch again only from a read that succeeded, so a watch never runs while ``etcd_ok``
        says etcd is lost (a watch opened just as etcd came back would otherwise wait for the
        next change with the flag still down)."""
        pause = 0.25
        while True:
            try:
                async with asyncio.timeout(self.resync_interval):
                    async for change in self._etcd.changes(self._revision):
                        self._apply(change)
                        pause = 0.25
            except TimeoutError:
                pass  # the periodic resync
            except MembershipError as exc:
                if self.etcd_ok:
                    logger.warning("etcd watch lost (%s); routing with the last ring (epoch %d)",
                                   exc, self.view.ring.epoch)
                self.etcd_ok = False
            while True:  # after a break, each read waits its backoff first
                if not self.etcd_ok:
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 5.0)
                try:
                    await self._resync()
                    self.resyncs += 1
                    break
                except MembershipError as exc:
                    logger.debug("etcd resync failed: %s", exc)
                    self.etcd_ok = False

    async def _resync(self) -> None:
        """Read the whole cluster (contract and members) and publish what changed."""
        snap = await self._etcd.snapshot()
        self.etcd_ok = True
        self._revision = snap.revision
        if self.contract is not None:
            self._check_contract(snap.contract)
        self._members = dict(snap.members)
        self._publish(snap.revision, etcd_lost=snap.contract is None)

    def _apply(self, change: Change) -> None:
        """One watched change: the contract, or a node record written or gone."""
        self._revision = change.revision
        if change.key == self.settings.key("contract"):
            self._check_contract(decode_contract(change.key, change.value) if change.value is not None else None)
            return
        prefix = self.settings.nodes_prefix
        if not change.key.startswith(prefix):
            return  # a drain request: the node follows its own
        node_id = change.key[len(prefix):].decode(errors="replace")
        if change.value is None:
            self._members.pop(node_id, None)
        elif (rec := decode_record(change.key, change.value)) is not None:
            self._members[rec.node_id] = rec
        self._publish(change.revision, etcd_lost=False)

    def _publish(self, revision: int, etcd_lost: bool) -> None:
        members = dict(self._members)
        old = self.view
        if members == old.members:
            return
        if not members and etcd_lost:
            # Not a cluster whose nodes all left (their contract stays): an etcd that lost its
            # data.  The nodes re-register within their lease TTL; until then, the last ring.
            if not self.etcd_lost:
                logger.warning("etcd has no record of cluster %r (its data lost?); routing with the last ring "
                               "(epoch %d) until the nodes register again", self.settings.cluster, old.ring.epoch)
            self.etcd_lost = True
            return
        self.etcd_lost = False
        ring = HashRing.of_members(members, self.contract, revision)
        prev_ring, prev_until = old.prev_ring, old.prev_until
        if old.ring.nodes and set(old.ring.nodes) != set(ring.nodes):
            prev_ring, prev_until = old.ring, time.monotonic() + self.handoff_window
        self.on_members(members)
        self.view = RingView(ring, members, prev_ring, prev_until)
        logger.info("ring epoch %d: %d nodes", revision, len(ring))
        with self.changed:
            self.changed.notify_all()

    def wait_for_nodes(self, count: int, timeout: float, exact: bool) -> bool:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                n = len(self.view.ring)
                if n == count or (not exact and n >= count):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    self._log_short_ring(count)
                    return False
                self.changed.wait(min(left, 0.1))

    def _log_short_ring(self, count: int) -> None:
        """Why a wait for ``count`` nodes ended without them: the members etcd has and their states."""
        view = self.view
        members = ", ".join(f"{r.node_id} {r.state}" for r in sorted(view.members.values(), key=lambda r: r.node_id))
        logger.warning("cluster %r: the ring has %d nodes, not the %d waited for; members in etcd: %s%s",
                       self.settings.cluster, len(view.ring), count, members or "none",
                       "" if self.etcd_ok else " (etcd lost: the last ring it had)")

    def close(self) -> None:
        if self._attacher is not None:
            self._attacher.cancel()

        async def shutdown() -> None:
            if self._follower is not None:
                self._follower.cancel()
                await asyncio.gather(self._follower, return_exceptions=True)  # its watch cancelled
            await self._etcd.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        except Exception:
            pass
