"""Keeps one node's record in etcd under a lease (the node's side of membership).

Registration is fenced: a node claims its id in one transaction that succeeds only if no record
holds it.  A record that does is either a live node -- which answers ``holder_alive`` (the
node's data port answering PING under that id): this node refuses to start (``NodeIdTaken``)
-- or a previous run of this node (crashed, or hung) whose lease has not run out yet: its
record is taken over, again in a transaction that fails if the record changed meanwhile.  While
running, every lease refresh also checks the record: one deleted behind the node's back is
written again; one that another node took over stops this node (``NodeIdTaken``).

State changes (a drain and its withdrawal, the self-check's verdicts) may come while an earlier
one is being written: each bumps ``_changes``, and a write counts for the changes made before it
was sent, never for one that came while it was in flight -- that one is written next turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from kvring.common.contract import Contract
from kvring.common.errors import ContractMismatch, MembershipError, NodeIdTaken
from kvring.common.records import NodeRecord
from kvring.common.types import NodeState

from .etcd import Etcd, Holder

logger = logging.getLogger(__name__)

CLAIM_ATTEMPTS = 5


def refresh_period(ttl: float) -> float:
    """Seconds between lease refreshes under a ``ttl``-second lease, and between retries while
    etcd cannot be reached."""
    return max(ttl / 3, 0.2)


async def _assume_alive(record: NodeRecord) -> bool:
    return True


class Registrar:
    """Keeps one node's record in etcd under a lease, re-registering after etcd outages."""

    def __init__(self, etcd: Etcd, record: NodeRecord, contract: Contract, ttl: int = 10,
                 holder_alive: Callable[[NodeRecord], Awaitable[bool]] = _assume_alive) -> None:
        self.etcd = etcd
        self.record = record
        self.contract = contract
        self.ttl = ttl
        self.holder_alive = holder_alive  # whether the node a record names is running and answers
        self.registered = asyncio.Event()
        self.registrations = 0
        self._lease = None
        self._changes = 1  # state changes so far (the first: the record itself)
        self._written = 0  # how many of them the record in etcd holds
        self._wake = asyncio.Event()

    @property
    def lease_id(self) -> int | None:
        """The lease the record lives under now (None while not registered)."""
        return self._lease.id if self._lease is not None else None

    def set_state(self, state: NodeState) -> None:
        """Change the recorded state; the record is rewritten at once, not at the next refresh."""
        self.record = msgspec.structs.replace(self.record, state=NodeState(state))
        self._changes += 1
        self._wake.set()

    async def register_once(self) -> None:
        """Check the contract and claim the node id under a fresh lease (raises
        ``ContractMismatch`` or ``NodeIdTaken``)."""
        await self.etcd.ensure_contract(self.contract)
        lease = await self.etcd.call(lambda c: c.lease(self.ttl))
        try:
            await self._claim(lease.id)
        except NodeIdTaken:
            await self._revoke(lease)
            raise
        self._lease = lease
        self.registrations += 1
        self.registered.set()

    async def _claim(self, lease_id: int) -> None:
        node_id = self.record.node_id
        replacing = None
        for _ in range(CLAIM_ATTEMPTS):
            holder = await self._write(lease_id, replacing)
            if holder is None:
                return
            # A record with this node's own address is a previous run's: this process holds the port now.
            if (holder.record is not None and holder.record.data_addr != self.record.data_addr
                    and await self.holder_alive(holder.record)):
                raise NodeIdTaken(
                    f"node id {node_id!r} is held by a running node at {holder.record.data_addr} "
                    f"(pid {holder.record.pid} there); give this node another --node-id, or stop that one first")
            if holder.record is not None:
                logger.warning("node id %s is still registered to %s, which does not answer (a previous run "
                               "of this node?): taking it over", node_id, holder.record.data_addr)
            replacing = holder
        raise MembershipError(f"could not claim node id {node_id!r}: its record kept changing")

    async def _check(self) -> None:
        """The record must still be this node's: written again if it was deleted, rewritten if
        its state changed; ``NodeIdTaken`` if another node holds it now."""
        lease_id = self._lease.id
        holder = await self._write(lease_id)  # writes it only if it is gone
        if holder is None:
            logger.warning("node %s: its record was deleted from etcd; registered again", self.record.node_id)
            self.registrations += 1
            return
        if holder.lease == lease_id:
            if self._written < self._changes:
                await self._write(lease_id, replacing=holder)  # (if it changed in between: next turn)
            return
        where = holder.record.data_addr if holder.record is not None else "an unreadable record"
        raise NodeIdTaken(f"node id {self.record.node_id!r} was taken over by the node at {where}; this node stops")

    async def _write(self, lease_id: int, replacing: Holder | None = None) -> Holder | None:
        """``Etcd.claim_node`` of the record as it is now; once written, the changes made before
        the write count as written (not one made while it was in flight)."""
        changes = self._changes
        holder = await self.etcd.claim_node(self.record, lease_id, replacing)
        if holder is None:
            self._written = changes
        return holder

    async def run(self) -> None:
        """Refresh the lease forever; on any etcd failure, retry and register anew."""
        period = refresh_period(self.ttl)
        while True:
            try:
                if self._lease is None:
                    await self.register_once()
                    logger.info("node %s registered (lease %ss)", self.record.node_id, self.ttl)
                reply = await self.etcd.call(lambda c: c.refresh_lease(self._lease.id))
                if reply is None or getattr(reply, "TTL", 1) <= 0:
                    raise MembershipError("lease expired")
                await self._check()
            except (ContractMismatch, NodeIdTaken):
                raise
            except MembershipError as exc:
                if self._lease is not None:
                    logger.warning("node %s lost etcd (%s); will re-register", self.record.node_id, exc)
                self._lease = None
                self.registered.clear()
            except Exception:  # a failure nothing above names: no reason to leave the ring for good
                logger.exception("node %s: unexpected failure keeping its etcd record; will re-register",
                                 self.record.node_id)
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
            await self._revoke(lease)

    async def _revoke(self, lease) -> None:
        try:
            await self.etcd.call(lambda c: c.revoke_lease(lease.id))
        except MembershipError:
            pass
