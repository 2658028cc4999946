"""Keeps one node's record in etcd under a lease (the node's side of membership)."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from kvring.common.contract import Contract
from kvring.common.errors import ContractMismatch, MembershipError
from kvring.common.records import NodeRecord
from kvring.common.types import NodeState

from .etcd import Etcd

logger = logging.getLogger(__name__)


class Registrar:
    """Keeps one node's record in etcd under a lease, re-registering after etcd outages."""

    def __init__(self, etcd: Etcd, record: NodeRecord, contract: Contract, ttl: int = 10) -> None:
        self.etcd = etcd
        self.record = record
        self.contract = contract
        self.ttl = ttl
        self.registered = asyncio.Event()
        self.registrations = 0
        self._lease = None
        self._dirty = True
        self._wake = asyncio.Event()

    def set_state(self, state: NodeState) -> None:
        """Change the recorded state; the record is rewritten at once, not at the next refresh."""
        self.record = msgspec.structs.replace(self.record, state=NodeState(state))
        self._dirty = True
        self._wake.set()

    async def register_once(self) -> None:
        """Check the contract and write the record under a fresh lease (raises on mismatch)."""
        await self.etcd.ensure_contract(self.contract)
        self._lease = await self.etcd.call(lambda c: c.lease(self.ttl))
        await self._put()
        self.registrations += 1
        self.registered.set()

    async def _put(self) -> None:
        key = self.etcd.settings.key("nodes", self.record.node_id)
        value = msgspec.json.encode(self.record)
        await self.etcd.call(lambda c: c.put(key, value, lease=self._lease))
        self._dirty = False

    async def run(self) -> None:
        """Refresh the lease forever; on any etcd failure, retry and register anew."""
        period = max(self.ttl / 3, 0.2)
        while True:
            try:
                if self._lease is None:
                    await self.register_once()
                    logger.info("node %s registered (lease %ss)", self.record.node_id, self.ttl)
                reply = await self.etcd.call(lambda c: c.refresh_lease(self._lease.id))
                if reply is None or getattr(reply, "TTL", 1) <= 0:
                    raise MembershipError("lease expired")
                if self._dirty:
                    await self._put()
            except ContractMismatch:
                raise
            except MembershipError as exc:
                if self._lease is not None:
                    logger.warning("node %s lost etcd (%s); will re-register", self.record.node_id, exc)
                self._lease = None
                self.registered.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), period)
            except TimeoutError:
                pass
            self._wake.clear()

    async def deregister(self) -> None:
        if self._lease is not None:
            lease, self._lease = self._lease, None
            try:
                await self.etcd.call(lambda c: c.revoke_lease(lease.id))
            except MembershipError:
                pass
