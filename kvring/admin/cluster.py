"""The admin API's connections to one cluster, opened once and kept for the app's lifetime.

- an ``Etcd`` (asyncio, on the app's loop) for fresh reads of membership, the contract and
  drain requests, and for writing drain requests — so an etcd outage is reported, not hidden;
- a ``ClusterClient`` (its own I/O thread, blocking calls run in a worker thread) for the ring,
  lookups, owners and flushes: the very client the connector uses, so a lookup here follows
  the connector's code path;
- an ``httpx.AsyncClient`` for each node's ``/stats`` on its admin port.

The cluster client is created on first use when etcd or the cluster's contract is not there
yet at start, so the admin may start before etcd or before the first node.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import anyio
import httpx

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.errors import KVRingError
from kvring.cachenode.membership import LEFT_RING_STATES, Contract, Etcd, NodeRecord

from .models import NodeView
from .settings import AdminSettings

logger = logging.getLogger(__name__)


class NoContract(KVRingError):
    """No node of the cluster has started yet, so there is no contract (chunk size, ring) to use."""


class ClusterHandle:
    def __init__(self, settings: AdminSettings) -> None:
        self.settings = settings
        self.etcd = Etcd(settings.etcd)
        self.http = httpx.AsyncClient(timeout=settings.node_timeout)
        self._client: ClusterClient | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        try:
            await self.client()
        except KVRingError as exc:
            logger.warning("cluster client not connected yet (%s); will retry on the next request", exc)

    async def close(self) -> None:
        await self.http.aclose()
        await self.etcd.close()
        if self._client is not None:
            client, self._client = self._client, None
            await anyio.to_thread.run_sync(client.close)

    async def client(self) -> ClusterClient:
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    contract = await self.etcd.read_contract()
                    if contract is None:
                        raise NoContract(f"cluster {self.settings.etcd.cluster!r} has no contract in etcd yet: no "
                                         "node of it has started (check --cluster)")
                    self._client = await anyio.to_thread.run_sync(self._connect, contract)
        return self._client

    def _connect(self, contract: Contract) -> ClusterClient:
        return ClusterClient(self.settings.etcd, contract=contract, timeout=self.settings.client_timeout)

    async def blocking(self, fn, *args):
        """Run a blocking cluster-client call off the event loop."""
        return await anyio.to_thread.run_sync(fn, *args)

    # ---- reads ------------------------------------------------------------------------------

    async def members(self) -> tuple[dict[str, NodeRecord], int]:
        return await self.etcd.members()

    async def node_views(self, members: dict[str, NodeRecord]) -> list[NodeView]:
        """Each member's record joined with its own ``/stats`` (read in parallel)."""
        async def one(rec: NodeRecord) -> NodeView:
            stats, error = None, None
            try:
                resp = await self.http.get(f"{rec.admin_addr}/stats")
                resp.raise_for_status()
                stats = resp.json()
            except (httpx.HTTPError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}".rstrip(": ")
            return NodeView(
                node_id=rec.node_id,
                state=stats.get("state", rec.state) if stats else "unreachable",
                registered_state=rec.state,
                on_ring=rec.state not in LEFT_RING_STATES,
                data_addr=rec.data_addr,
                admin_addr=rec.admin_addr,
                capacity=rec.capacity,
                used=stats.get("used") if stats else None,
                chunks=stats.get("chunks") if stats else None,
                hits=stats.get("hits") if stats else None,
                misses=stats.get("misses") if stats else None,
                drain=stats.get("drain") if stats else None,
                error=error,
            )
        return list(await asyncio.gather(*(one(rec) for _, rec in sorted(members.items()))))

    def ring_epoch(self, fallback: int) -> int:
        return self._client.ring.epoch if self._client is not None else fallback


def states_of(views: list[NodeView]) -> dict[str, int]:
    return dict(sorted(Counter(v.state for v in views).items()))

