"""A node's record in etcd follows its state, with real etcd: a state change that comes while the
previous one is being written (a drain withdrawn at once, the self-check's verdict flipping) is
written too, not counted as written by the write it came during."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import pytest

from kvring.common.contract import Contract
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
