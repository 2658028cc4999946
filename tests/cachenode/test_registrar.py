"""A node's record in etcd follows its state, with real etcd: a state change that comes while the
previous one is being written (a drain withdrawn at once, the self-check's verdict flipping) is
written too, not counted as written by the write it came during."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import msgspec
import pytest

from kvring.common.contract import Contract
from kvring.common.errors import MembershipError
from kvring.common.records import NodeRecord
from kvring.common.types import NodeState
from kvring.membership.etcd import Etcd, Holder
from kvring.membership.loop import etcd_loop
from kvring.membership.registrar import Registrar
from kvring.membership.settings import EtcdSettings

_clusters = itertools.count()


class _ChangeDuringWrite(Etcd):
    """The real etcd client, which runs ``during`` (once) while the write of a record in state
    ``at`` is in flight: after etcd took it, before the registrar hears back -- where a change
    lands when the node's HTTP thread hands it to the registration loop at that moment."""

    def __init__(self, settings: EtcdSettings, at: NodeState) -> None:
        super().__init__(settings)
        self.at = at
        self.during = lambda: None
        self.writes: list[NodeState] = []  # the states written, in turn

    async def claim_node(self, record: NodeRecord, lease_id: int, replacing: Holder | None = None) -> Holder | None:
        holder = await super().claim_node(record, lease_id, replacing)
        if holder is not None:  # not written (a check that the record is still there, say)
            return holder
        self.writes.append(record.state)
        if record.state == self.at:
            during, self.during = self.during, lambda: None
            during()
        return holder


async def _recorded(etcd: Etcd, node_id: str) -> NodeState | None:
    got = await etcd.call(lambda c: c.get(etcd.settings.key("nodes", node_id)))
    return msgspec.json.decode(got.value, type=NodeRecord).state if got is not None else None


async def _until(etcd: Etcd, node_id: str, state: NodeState, timeout: float) -> NodeState | None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (now := await _recorded(etcd, node_id)) != state and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return now


@pytest.mark.parametrize("first, then", [
    (NodeState.DRAINING, NodeState.ACTIVE),  # POST /drain, then DELETE /drain at once
    (NodeState.UNHEALTHY, NodeState.ACTIVE),  # the self-check's PING missed, then answered
    (NodeState.ACTIVE, NodeState.DRAINING),  # registering, and asked to drain meanwhile
], ids=["drain-withdrawn", "unhealthy-recovered", "drain-while-registering"])
def test_a_state_change_made_while_the_last_one_is_written_reaches_etcd(etcd_server, first, then):
    settings = EtcdSettings.parse(etcd_server.endpoint, cluster=f"registrar-{next(_clusters)}", timeout=2.0)
    record = NodeRecord("node-0", "tcp://127.0.0.1:1", "http://127.0.0.1:2", 1 << 20)

    async def run() -> tuple[NodeState | None, list[NodeState]]:
        etcd = _ChangeDuringWrite(settings, at=first)
        registrar = Registrar(etcd, record, Contract(), ttl=3)
        registrar.set_state(NodeState.ACTIVE)
        first_written = asyncio.Event()

        def change() -> None:
            first_written.set()
            registrar.set_state(then)

        etcd.during = change
        task = asyncio.ensure_future(registrar.run())
        try:
            await asyncio.wait_for(registrar.registered.wait(), 10)
            if first != NodeState.ACTIVE:
                registrar.set_state(first)
            await asyncio.wait_for(first_written.wait(), 10)
            # The change that came mid-write is written at the next turn: at once (it woke the
            # loop), and within a lease refresh (1 s) at the latest.
            return await _until(etcd, "node-0", then, timeout=3.0), etcd.writes
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await registrar.deregister()
            await etcd.close()

    recorded, writes = asyncio.run_coroutine_threadsafe(run(), etcd_loop()).result(30)
    assert first in writes  # the first change was written, and the second came during that write
    assert recorded == then, f"etcd holds {recorded} after the writes {writes}; the node is {then}"


class _ClosedUnderRefresh(Etcd):
    """The real etcd client, whose connection is closed (once) while a lease refresh is in flight
    -- what another call on the same ``Etcd`` does when it fails (the repair report's write while
    etcd is down): gRPC then ends the refresh with ``CancelledError``."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.armed = False
        self.closed_under = 0

    async def call(self, fn):
        if not self.armed:
            return await super().call(fn)
        self.armed = False

        async def closed_under_it(client):
            refresh = asyncio.ensure_future(fn(client))
            await asyncio.sleep(0)  # the call is on the wire
            await self._drop(client)
            self.closed_under += 1
            return await refresh

        return await super().call(closed_under_it)


def test_a_call_whose_connection_another_call_closes_fails_as_etcd_and_a_cancelled_task_still_stops(etcd_server):
    """The cause of a node that never came back after etcd was wiped: its registration thread had
    died of a ``CancelledError`` out of the lease refresh.  Such a call fails as an etcd failure
    (``MembershipError``) and the next call connects again; a task that is itself cancelled in the
    middle of a call still ends cancelled."""
    settings = EtcdSettings.parse(etcd_server.endpoint, cluster=f"registrar-{next(_clusters)}", timeout=2.0)

    async def run() -> tuple[str, bool, bool]:
        etcd = _ClosedUnderRefresh(settings)
        try:
            lease = await etcd.call(lambda c: c.lease(5))
            etcd.armed = True
            with pytest.raises(MembershipError) as failed:
                await etcd.call(lambda c: c.refresh_lease(lease.id))
            again = await etcd.call(lambda c: c.refresh_lease(lease.id))  # a new connection
            stalled = asyncio.Event()
            task = asyncio.ensure_future(etcd.call(lambda c: stalled.wait()))
            await asyncio.sleep(0.1)
            task.cancel()
            done = await asyncio.gather(task, return_exceptions=True)
            return str(failed.value), again.TTL > 0, isinstance(done[0], asyncio.CancelledError)
        finally:
            await etcd.close()

    message, refreshed, cancelled = asyncio.run_coroutine_threadsafe(run(), etcd_loop()).result(30)
    assert "cancelled under it" in message
    assert refreshed
    assert cancelled


def _through(etcd: Etcd, arm: Callable[[Registrar], Callable[[], bool]]) -> tuple[Registrar, bool, NodeState | None]:
    """A registrar of ``node-0`` on ``etcd``: once it is registered, ``arm(registrar)`` sets a
    failure up and returns when the registrar is back from it, which is waited for (10 s), its
    task never ending meanwhile.  The registrar, whether its task ended, and the state etcd holds."""
    record = NodeRecord("node-0", "tcp://127.0.0.1:1", "http://127.0.0.1:2", 1 << 20)

    async def run() -> tuple[Registrar, bool, NodeState | None]:
        registrar = Registrar(etcd, record, Contract(), ttl=2)
        registrar.set_state(NodeState.ACTIVE)
        task = asyncio.ensure_future(registrar.run())
        try:
            await asyncio.wait_for(registrar.registered.wait(), 10)
            back = arm(registrar)
            deadline = asyncio.get_running_loop().time() + 10
            while not back():
                assert not task.done(), f"the registrar ended: {task.exception()!r}"
                assert asyncio.get_running_loop().time() < deadline, "not registered again within 10 s"
                await asyncio.sleep(0.05)
            return registrar, task.done(), await _recorded(etcd, "node-0")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await registrar.deregister()
            await etcd.close()

    return asyncio.run_coroutine_threadsafe(run(), etcd_loop()).result(30)


def test_the_registrar_registers_again_after_its_refresh_is_cancelled_under_it(etcd_server):
    settings = EtcdSettings.parse(etcd_server.endpoint, cluster=f"registrar-{next(_clusters)}", timeout=2.0)
    etcd = _ClosedUnderRefresh(settings)

    def arm(registrar: Registrar) -> Callable[[], bool]:
        first_lease = registrar.lease_id
        etcd.armed = True  # the next refresh (within 1 s, a third of the TTL)
        return lambda: bool(etcd.closed_under and registrar.registered.is_set() and registrar.lease_id != first_lease)

    _, ended, recorded = _through(etcd, arm)
    assert etcd.closed_under == 1 and not ended
    assert recorded == NodeState.ACTIVE  # registered again, under a new lease


def test_tasks_sharing_a_client_while_it_connects_use_one_connection(etcd_server):
    """The registrar, the repair report and the restart-marker read share one ``Etcd``: after an
    outage they reconnect together, and each connection made beside another was left open."""
    settings = EtcdSettings.parse(etcd_server.endpoint, cluster=f"registrar-{next(_clusters)}", timeout=2.0)

    async def run() -> set[int]:
        etcd = Etcd(settings)
        used: list[int] = []

        async def get(client):
            used.append(id(client))
            return await client.get(settings.key("contract"))

        try:
            await asyncio.gather(*(etcd.call(get) for _ in range(4)))
            return set(used)
        finally:
            await etcd.close()

    assert len(asyncio.run_coroutine_threadsafe(run(), etcd_loop()).result(30)) == 1


class _FailsOnce(Etcd):
    """The real etcd client, whose record check fails once with an error no etcd failure names
    (a bug, a client library's surprise)."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.armed = False

    async def claim_node(self, record: NodeRecord, lease_id: int, replacing: Holder | None = None) -> Holder | None:
        if self.armed:
            self.armed = False
            raise RuntimeError("an unforeseen failure")
        return await super().claim_node(record, lease_id, replacing)


def test_an_unforeseen_failure_does_not_end_the_registrar(etcd_server, caplog):
    settings = EtcdSettings.parse(etcd_server.endpoint, cluster=f"registrar-{next(_clusters)}", timeout=2.0)
    etcd = _FailsOnce(settings)

    def arm(registrar: Registrar) -> Callable[[], bool]:
        etcd.armed = True  # the record check after the next refresh
        return lambda: not etcd.armed and registrar.registrations >= 2

    registrar, ended, recorded = _through(etcd, arm)
    assert registrar.registrations == 2 and not ended and recorded == NodeState.ACTIVE
    assert "unforeseen failure" in caplog.text  # logged with its traceback
