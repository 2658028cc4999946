"""The pool's KV events as one stream: a ``PoolRelay`` (``kvring.events.relay``) that follows the
cluster's membership in etcd.

``PoolEvents(etcd, cluster, settings)`` starts the relay and a task on the process's etcd loop
that reads the members every ``interval`` seconds and hands the relay their event endpoints (a
node restarted under its id shows up as a new incarnation; one whose lease ran out, as gone).
It also says where the stream is, under ``events`` in etcd (a ``PoolEventsRecord`` attached to a
lease of its own, refreshed on the same task), so the admin API's ``/v1/cluster`` can show it.
While etcd is away the relay keeps following the nodes it knows.  It runs inside ``kvring up``
and as ``kvring events`` (a process of its own beside the nodes; on Kubernetes the operator's
Deployment ``<name>-events``, which records its Service's name: ``RelaySettings.advertise_host``);
a router registers its ``events_addr`` and ``replay_addr`` as one worker.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvring.common.errors import KVRingError
from kvring.common.records import PoolEventsRecord
from kvring.events.relay import PoolRelay, RelaySettings, Source
from kvring.membership.etcd import Etcd
from kvring.membership.loop import etcd_loop
from kvring.membership.settings import EtcdSettings

logger = logging.getLogger(__name__)


class PoolEvents:
    def __init__(self, etcd: str, cluster: str = "default", settings: RelaySettings | None = None,
                 interval: float = 0.5, prefix: str | None = None, lease_ttl: int = 10) -> None:
        extra = {"prefix": prefix} if prefix else {}
        self._etcd = Etcd(EtcdSettings.parse(etcd, cluster=cluster, **extra))
        self.interval = interval
        self.lease_ttl = lease_ttl
        self._lease = None
        self._refreshed = 0.0
        self.relay = PoolRelay(settings or RelaySettings())
        self._failing: str | None = None
        self._task = asyncio.run_coroutine_threadsafe(self._follow(), etcd_loop())

    @property
    def events_addr(self) -> str:
        return self.relay.events_addr

    @property
    def replay_addr(self) -> str:
        return self.relay.replay_addr

    def stats(self) -> dict:
        return self.relay.stats()

    async def _register(self) -> None:
        """Keep the stream's record in etcd: refresh its lease every third of its TTL, or write the
        record under a new lease when there is none (first time, or the lease ran out)."""
        if self._lease is not None:
            if time.monotonic() - self._refreshed < self.lease_ttl / 3:
                return
            try:
                reply = await self._etcd.call(lambda c: c.refresh_lease(self._lease.id))
                if reply is not None and getattr(reply, "TTL", 1) > 0:
                    self._refreshed = time.monotonic()
                    return
            except KVRingError:
                pass
            self._lease = None
        lease = await self._etcd.call(lambda c: c.lease(self.lease_ttl))
        topic = self.relay.settings.publisher.topic
        await self._etcd.put_pool_events(PoolEventsRecord(self.events_addr, self.replay_addr, topic), lease.id)
        self._lease, self._refreshed = lease, time.monotonic()

    async def _follow(self) -> None:
        while True:
            try:
                await self._register()
                members, _ = await self._etcd.members()
            except KVRingError as exc:
                if str(exc) != self._failing:
                    logger.warning("kvring: pool events: cannot read the members (%s); following the nodes "
                                   "known", exc)
                    self._failing = str(exc)
            else:
                if self._failing is not None:
                    logger.info("kvring: pool events: reading the members again")
                    self._failing = None
                self.relay.set_sources({node: Source(node, r.incarnation, r.events_addr, r.events_replay_addr)
                                        for node, r in members.items()})
            await asyncio.sleep(self.interval)

    def close(self) -> None:
        self._task.cancel()
        asyncio.run_coroutine_threadsafe(self._unregister(), etcd_loop()).result(10)
        self.relay.close()

    async def _unregister(self) -> None:
        if self._lease is not None:
            try:
                await self._etcd.call(lambda c: c.revoke_lease(self._lease.id))
            except KVRingError:
                pass  # it runs out within its TTL
        await self._etcd.close()

    def __enter__(self) -> PoolEvents:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
