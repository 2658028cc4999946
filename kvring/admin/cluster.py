"""The admin API's connections to one cluster, opened once and kept for the app's lifetime.

- an ``Etcd`` (asyncio, on the app's loop) for fresh reads of membership, the contract and
  drain requests, and for writing drain requests -- so an etcd outage is reported, not hidden;
- an ``httpx.AsyncClient`` for each node's admin port: its ``/stats``, and the key queries
  ``POST /v1/present`` and ``POST /v1/flush``.  The admin never speaks the data protocol (the
  import contracts keep it that way): owners come from the ring it builds from etcd's members
  with the cluster's contract, exactly as every client builds it.

The admin may start before etcd, before the cluster's contract exists, or before the first node:
each request reads what it needs then.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass

import httpx

from kvring.common.contract import Contract
from kvring.common.errors import KVRingError, NodeUnavailable
from kvring.common.protocol import MAX_KEYS_PER_REQUEST
from kvring.common.records import NodeRecord
from kvring.common.ring import HashRing
from kvring.common.types import LEFT_RING_STATES
from kvring.membership.etcd import Etcd

from .models import NodeView
from .settings import AdminSettings

logger = logging.getLogger(__name__)


class NoContract(KVRingError):
    """No node of the cluster has started yet, so there is no contract (chunk size, ring) to use."""


@dataclass(frozen=True)
class RingSnapshot:
    """The cluster's members and ring as the admin read them for one request."""

    contract: Contract
    members: dict[str, NodeRecord]
    ring: HashRing

    @property
    def epoch(self) -> int:
        return self.ring.epoch


class ClusterHandle:
    def __init__(self, settings: AdminSettings) -> None:
        self.settings = settings
        self.etcd = Etcd(settings.etcd)
        self.http = httpx.AsyncClient(timeout=settings.node_timeout)
        self._contract: Contract | None = None
        self._last: RingSnapshot | None = None

    async def start(self) -> None:
        try:
            await self.snapshot()
        except KVRingError as exc:
            logger.warning("cluster not readable yet (%s); will read it again on the next request", exc)

    async def close(self) -> None:
        await self.http.aclose()
        await self.etcd.close()

    async def contract(self) -> Contract:
        if self._contract is None:
            contract = await self.etcd.read_contract()
            if contract is None:
                raise NoContract(f"cluster {self.settings.etcd.cluster!r} has no contract in etcd yet: no "
                                 "node of it has started (check --cluster)")
            self._contract = contract
        return self._contract

    async def snapshot(self) -> RingSnapshot:
        """Members and ring read from etcd now; the ring (and its epoch) only changes when the
        members do, as in every client."""
        contract = await self.contract()
        members, revision = await self.etcd.members()
        last = self._last
        if last is not None and last.members == members:
            return last
        weights = {n: r.capacity for n, r in members.items() if r.state not in LEFT_RING_STATES}
        ring = HashRing(weights, vnodes=contract.vnodes, replication=contract.replication, epoch=revision)
        self._last = RingSnapshot(contract, members, ring)
        return self._last

    # ---- questions to the nodes' admin ports ------------------------------------------------

    async def _post(self, rec: NodeRecord, path: str, body: dict) -> dict:
        try:
            resp = await self.http.post(f"{rec.admin_addr}{path}", json=body)
            resp.raise_for_status()
            return resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise NodeUnavailable(f"node {rec.node_id}: {type(exc).__name__}: {exc}".rstrip(": ")) from None

    async def holders(self, snap: RingSnapshot, keys: list[bytes]) -> list[list[str]]:
        """Which members hold each key (every member asked, nothing leased), owners first."""
        async def one(rec: NodeRecord) -> tuple[str, list[bool]]:
            present: list[bool] = []
            for i in range(0, len(keys), MAX_KEYS_PER_REQUEST):
                part = keys[i:i + MAX_KEYS_PER_REQUEST]
                try:
                    present += (await self._post(rec, "/v1/present", {"keys": [k.hex() for k in part]}))["present"]
                except NodeUnavailable as exc:
                    logger.debug("%s", exc)
                    present += [False] * len(part)
            return rec.node_id, present

        if not keys:
            return []
        answers = dict(await asyncio.gather(*(one(rec) for rec in snap.members.values())))
        owners = snap.ring.owners_many(keys) if snap.ring.nodes else [[] for _ in keys]
        out = []
        for i, own in enumerate(owners):
            held = {n for n, present in answers.items() if present[i]}
            out.append([n for n in own if n in held] + sorted(held - set(own)))
        return out

    async def flush(self, snap: RingSnapshot, namespace: str) -> dict[str, int | str]:
        """Delete a namespace on every member: chunks deleted per node, or why it failed."""
        async def one(rec: NodeRecord) -> tuple[str, int | str]:
            try:
                return rec.node_id, int((await self._post(rec, "/v1/flush", {"namespace": namespace}))["deleted"])
            except NodeUnavailable as exc:
                return rec.node_id, str(exc)
        return dict(await asyncio.gather(*(one(rec) for rec in snap.members.values())))

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
        return self._last.epoch if self._last is not None else fallback


def states_of(views: list[NodeView]) -> dict[str, int]:
    return dict(sorted(Counter(v.state for v in views).items()))

