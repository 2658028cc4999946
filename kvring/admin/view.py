"""The cached cluster view: what the admin's read endpoints answer from.

A ``ViewRefresher`` runs on the view thread: the process's etcd loop
(``kvring.membership.loop``), borrowed through a ``LoopThread``.  Every ``view_interval``
seconds — or at once when poked, after a drain request — it reads etcd (the contract and the
members in one range read, then the drain requests) and each member's ``/stats`` (in parallel
through ``nodehttp``, each within ``node_timeout``), builds the ring, and publishes one
immutable ``ClusterView``.  Handlers on the serving loop only read ``refresher.status``: a
memory read.

``status`` is replaced whole by the view thread (one reference assignment) and never mutated,
so readers need no lock.  A read that fails — etcd away, or the read taking longer than
``view_timeout`` — keeps the last view and records why: the view is then *stale*, as is a view
older than ``view_stale_after``.  Before the first successful read there is no view and
``require()`` raises ``NoView`` (503).  The first failure, every change of error and the
recovery are logged (``kvring.admin.view``); a failure that repeats is not logged again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvring.common.contract import Contract
from kvring.common.errors import KVRingError, MembershipError
from kvring.common.records import NodeRecord, PoolEventsRecord
from kvring.common.ring import HashRing
from kvring.membership.etcd import Etcd

from .loopthread import LoopThread
from .models import NodeView
from .nodehttp import NodeHTTPError, request_json
from .settings import AdminSettings

logger = logging.getLogger(__name__)


class NoView(KVRingError):
    """The admin has not read the cluster from etcd yet (it has just started, or etcd is away)."""


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The cluster as one read saw it (built on the view thread, read by handlers, never changed)."""

    read_at: float  # wall-clock time (time.time()) when the read began: everything in it is newer
    read_mono: float  # time.monotonic() at the same moment, for the view's age
    contract: Contract | None  # None until the cluster's first node has recorded it
    members: Mapping[str, NodeRecord]
    revision: int  # etcd revision of the members read
    ring: HashRing | None  # None without a contract; rebuilt only when the members change
    drain_requests: frozenset[str]
    nodes: tuple[NodeView, ...]  # each member's record joined with its /stats, by node id
    pool_events: PoolEventsRecord | None = None  # the pool's event stream, if one runs (``kvring events``)

    @property
    def ring_epoch(self) -> int:
        return self.ring.epoch if self.ring is not None else self.revision

    def node(self, node_id: str) -> NodeView | None:
        return next((v for v in self.nodes if v.node_id == node_id), None)


@dataclass(frozen=True, slots=True)
class ViewStatus:
    """What the view thread last published: the latest view and, if the latest read failed, why."""

    view: ClusterView | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Freshness:
    """How current a view is, as a handler tells its caller."""

    read_at: float
    age_s: float
    stale_reason: str | None  # None: fresh


class ViewRefresher:
    """Keeps ``status`` current (see the module docstring).

    Called from the serving loop: ``start``, ``wait_first_read``, ``poke``, ``require``,
    ``freshness``, ``stop`` (a coroutine handed to the view thread to run there).  Everything
    else runs on the view thread.
    """

    def __init__(self, settings: AdminSettings, etcd: Etcd, thread: LoopThread) -> None:
        self.settings = settings
        self.etcd = etcd  # used on the view thread only
        self.thread = thread
        self.status = ViewStatus(view=None)
        self._poked = asyncio.Event()  # set on the view thread only (through ``poke``)
        self._first_read = threading.Event()
        self._task: asyncio.Task | None = None  # the reading loop, on the view thread

    # ---- the serving loop's side --------------------------------------------------------------

    def start(self) -> None:
        self.thread.submit(self._run())

    async def wait_first_read(self, timeout: float) -> None:
        """Wait (without blocking the loop) until the first read has succeeded or failed."""
        await asyncio.to_thread(self._first_read.wait, timeout)

    def poke(self) -> None:
        """Read the view again now (after a change made through the admin), not at the next tick."""
        self.thread.call_soon(self._poked.set)

    def require(self) -> tuple[ClusterView, Freshness]:
        """The latest view and how fresh it is; ``NoView`` before the first successful read."""
        status = self.status
        if status.view is None:
            where = f"cluster {self.settings.etcd.cluster!r} from etcd at {','.join(self.settings.etcd.endpoints)}"
            if status.error is None:
                raise NoView(f"the admin is still reading {where} for the first time; retry in a second")
            raise NoView(f"the admin could not read {where} yet: {status.error}; it tries again every "
                         f"{self.settings.view_interval:g}s — check that etcd runs and that --etcd points at it")
        return status.view, self.freshness(status)

    def freshness(self, status: ViewStatus) -> Freshness:
        assert status.view is not None
        age = time.monotonic() - status.view.read_mono
        reason = None
        if status.error is not None:
            reason = f"the latest read of the cluster failed ({status.error}); this is the last view read"
        elif age > self.settings.view_stale_after:
            reason = (f"the view has not been read again for {age:.1f}s (it is read every "
                      f"{self.settings.view_interval:g}s)")
        return Freshness(read_at=status.view.read_at, age_s=age, stale_reason=reason)

    async def stop(self) -> None:
        """(view thread, at shutdown) End the reading loop and close the etcd client."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.etcd.close()

    # ---- the view thread --------------------------------------------------------------------

    async def _run(self) -> None:
        self._task = asyncio.current_task()
        while True:
            await self._read_once()
            self._first_read.set()
            try:
                await asyncio.wait_for(self._poked.wait(), self.settings.view_interval)
            except TimeoutError:
                pass
            self._poked.clear()

    async def _read_once(self) -> None:
        try:
            view = await asyncio.wait_for(self._read(), self.settings.view_timeout)
        except TimeoutError:
            self._failed(f"reading the cluster took longer than {self.settings.view_timeout:g}s")
        except MembershipError as exc:
            self._failed(f"etcd at {','.join(self.settings.etcd.endpoints)} cannot be reached ({exc})")
        except Exception as exc:  # a bug or a malformed record: keep serving the last view, say why
            self._failed(f"{type(exc).__name__}: {exc}", exc_info=not isinstance(exc, KVRingError))
        else:
            if self.status.error is not None:
                logger.info("the cluster view is current again (ring epoch %d, %d nodes)",
                            view.ring_epoch, len(view.members))
            self.status = ViewStatus(view=view)

    def _failed(self, error: str, exc_info: bool = False) -> None:
        last = self.status
        if error != last.error:
            held = (f"answering from the view read {time.monotonic() - last.view.read_mono:.1f}s ago, marked stale"
                    if last.view is not None else "no view yet: read endpoints answer 503")
            logger.warning("reading the cluster view failed: %s; %s", error, held, exc_info=exc_info)
        self.status = ViewStatus(view=last.view, error=error)

    async def _read(self) -> ClusterView:
        read_at, read_mono = time.time(), time.monotonic()
        snap = await self.etcd.snapshot()
        drains = frozenset(await self.etcd.drain_requests())  # after the members: never older than them
        nodes = await self._node_views(snap.members)
        return ClusterView(read_at=read_at, read_mono=read_mono, contract=snap.contract, members=snap.members,
                           revision=snap.revision, ring=self._ring(snap.contract, snap.members, snap.revision),
                           drain_requests=drains, nodes=nodes, pool_events=snap.pool_events)

    def _ring(self, contract: Contract | None, members: dict[str, NodeRecord], revision: int) -> HashRing | None:
        """The ring of ``members`` under ``contract``; the last one while neither changed (its
        epoch stays the revision the members last changed at, as in every client)."""
        last = self.status.view
        if contract is None:
            return None
        if last is not None and last.ring is not None and last.members == members and last.contract == contract:
            return last.ring
        return HashRing.of_members(members, contract, revision)

    async def _node_views(self, members: dict[str, NodeRecord]) -> tuple[NodeView, ...]:
        """Each member's record joined with its own ``/stats`` (read in parallel)."""
        return tuple(await asyncio.gather(*(self._read_node(rec) for _, rec in sorted(members.items()))))

    async def _read_node(self, rec: NodeRecord) -> NodeView:
        try:
            stats = await request_json(rec.admin_addr, "GET", "/stats", timeout=self.settings.node_timeout,
                                       tls=self.settings.node_tls)
            if not isinstance(stats, dict):
                raise ValueError(f"/stats answered a JSON {type(stats).__name__}, not an object")
            return _node_view(rec, stats)
        except (NodeHTTPError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            return _node_view(rec, None, str(exc))


def _node_view(rec: NodeRecord, stats: dict | None, error: str | None = None) -> NodeView:
    """A member's etcd record joined with its ``/stats`` (``None``: it did not answer, ``error`` says why)."""
    got = stats or {}
    return NodeView(
        node_id=rec.node_id,
        state=got.get("state", rec.state) if stats is not None else "unreachable",
        registered_state=rec.state,
        on_ring=rec.on_ring,
        data_addr=rec.data_addr,
        admin_addr=rec.admin_addr,
        events_addr=rec.events_addr,
        events_replay_addr=rec.events_replay_addr,
        capacity=rec.capacity,
        used=got.get("used"),
        chunks=got.get("chunks"),
        hits=got.get("hits"),
        misses=got.get("misses"),
        drain=got.get("drain"),
        repair=got.get("repair"),
        kv_events=got.get("kv_events"),
        error=error,
    )
