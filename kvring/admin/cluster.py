"""``ClusterHandle``: the admin API's view of, and connections to, one cluster.

One per app, made by its lifespan.  Handlers call it on the serving loop (uvicorn's); none of its
methods blocks that loop or waits on etcd or a node there:

- reads answer from the cached view (``view.py``), read in the background on the view thread
  (the process's etcd loop), where the admin's etcd client lives;
- the mutating endpoints' fresh etcd reads and their writes (drain requests) run on that same
  thread, bounded by the etcd client's timeouts, and poke the view to be read again at once;
- questions to the nodes (``queries.py``: presence for lookups and key owners, flushes) run on
  the queries thread (``kvring-admin-queries``), a bounded number at a time, within a timeout.

The admin never speaks the data protocol (the import contracts keep it that way): owners come
from the ring it builds from etcd's members with the cluster's contract, exactly as every
client builds it.  It may start before etcd, before the contract exists, or before the first
node: the view is read again every ``view_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Coroutine
from datetime import datetime, timezone
from typing import Any, TypeVar

from kvring.common.contract import Contract
from kvring.common.errors import KVRingError, MembershipError
from kvring.common.records import NodeRecord
from kvring.membership.etcd import Etcd
from kvring.membership.loop import etcd_loop

from .loopthread import LoopThread
from .models import NodeView, ViewAge
from .queries import NodeQueries
from .settings import AdminSettings
from .view import ClusterView, Freshness, ViewRefresher

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NoContract(KVRingError):
    """No node of the cluster has started yet, so there is no contract (chunk size, ring) to use."""


class ClusterHandle:
    """See the module docstring.  Every method runs on the serving loop."""

    def __init__(self, settings: AdminSettings) -> None:
        self.settings = settings
        self._view_thread = LoopThread("kvring-admin-view", loop=etcd_loop())
        self._etcd = Etcd(settings.etcd)  # used on the view thread only
        self.refresher = ViewRefresher(settings, self._etcd, self._view_thread)
        self.queries = NodeQueries(settings)

    async def start(self) -> None:
        """Start both threads and wait for the first read of the view (it may fail: etcd away)."""
        self._view_thread.start()
        self.queries.start()
        self.refresher.start()
        await self.refresher.wait_first_read(self.settings.view_timeout)
        if self.refresher.status.view is None:
            logger.warning("serving without a view of the cluster yet (%s); read endpoints answer 503 until "
                           "it is read", self.refresher.status.error or "still reading")

    async def close(self) -> None:
        await self.queries.aclose()
        await self._view_thread.aclose(self.refresher.stop())

    # ---- reads: the cached view ---------------------------------------------------------------

    def view(self) -> tuple[ClusterView, ViewAge]:
        """The latest view and its age for the answer; ``NoView`` (503) before the first read."""
        view, fresh = self.refresher.require()
        return view, view_age(fresh)

    def contract(self, view: ClusterView) -> Contract:
        """The view's contract; ``NoContract`` (503) while the cluster has none."""
        if view.contract is None:
            raise NoContract(f"cluster {self.settings.etcd.cluster!r} has no contract in etcd yet: no node of it "
                             "has started (check --cluster)")
        return view.contract

    # ---- the mutating endpoints: fresh etcd reads and writes, on the view thread ---------------

    async def _on_etcd(self, coro: Coroutine[Any, Any, T]) -> T:
        limit = self.settings.view_timeout  # a backstop: the etcd client's own timeouts come first
        try:
            async with asyncio.timeout(limit):
                return await self._view_thread.run(coro)
        except TimeoutError:
            raise MembershipError(f"etcd did not answer within {limit:g}s") from None

    async def members_now(self) -> dict[str, NodeRecord]:
        members, _ = await self._on_etcd(self._etcd.members())
        return members

    async def drain_requests_now(self) -> set[str]:
        return await self._on_etcd(self._etcd.drain_requests())

    async def request_drain(self, node_id: str) -> None:
        await self._on_etcd(self._etcd.request_drain(node_id))
        self.refresher.poke()

    async def cancel_drain(self, node_id: str) -> None:
        await self._on_etcd(self._etcd.cancel_drain(node_id))
        self.refresher.poke()


def view_age(fresh: Freshness) -> ViewAge:
    return ViewAge(as_of=datetime.fromtimestamp(fresh.read_at, timezone.utc), age_s=round(fresh.age_s, 3),
                   stale=fresh.stale_reason is not None, stale_reason=fresh.stale_reason)


def states_of(views: tuple[NodeView, ...] | list[NodeView]) -> dict[str, int]:
    return dict(sorted(Counter(v.state for v in views).items()))
