"""A node's entry in its cluster's membership (JSON under ``nodes/<node-id>`` in etcd), and its
repair report (JSON under ``repair/<node-id>``)."""

from __future__ import annotations

import msgspec

from .types import NodeState


class NodeRecord(msgspec.Struct, frozen=True):
    node_id: str
    data_addr: str  # "tcp://host:port" of the data protocol
    admin_addr: str  # "http(s)://host:port" of /healthz, /readyz, /metrics, /stats, /drain (https: TLS)
    capacity: int  # the node's memory budget in bytes (its weight on the ring)
    state: NodeState = NodeState.ACTIVE
    pid: int = 0
    # Random per process start: a node restarted under its id (same pid 1 in a container, same
    # address) is a new incarnation, and its peers know it may have come back empty.
    incarnation: str = ""
    # The node's KV events (vLLM's wire format): PUB and replay ROUTER, "tcp://host:port"; "" if off.
    events_addr: str = ""
    events_replay_addr: str = ""

    @property
    def on_ring(self) -> bool:
        return self.state.on_ring


class RepairReport(msgspec.Struct, frozen=True):
    """Where a node's repair stands (JSON under ``repair/<node-id>``, attached to the node's lease,
    so it goes with the node).

    The node's registration thread writes it when it changes (``cachenode/registration.py``),
    from what the handoff thread's last pass found (``cachenode/repair.py``).  It lives beside
    the record, not in it: clients rebuild their ring on every change of a record, and a repair
    pass runs on every new ring.  The operator reads it to tell when repair has settled after a
    node came back (``kvring.operator.rollout``): every node has finished a pass, with nothing
    left to retry, on a ring at least as new as the returning node's record.
    """

    node_id: str
    incarnation: str  # the writing node's ``NodeRecord.incarnation``
    epoch: int = 0  # ring epoch of the last finished pass (0: none yet)
    running: bool = False  # a pass is running now
    pending: bool = False  # the last pass could not finish (an owner did not answer): it runs again soon
    missing: int = 0  # owner copies the last finished pass found missing
    copied: int = 0  # of those, restored
    passes: int = 0

    def settled(self, since: int) -> bool:
        """No pass running and none to retry, and the last one ran on a ring of epoch ``since`` or newer."""
        return not self.running and not self.pending and self.passes > 0 and self.epoch >= since


class PoolEventsRecord(msgspec.Struct, frozen=True):
    """Where the pool's KV events are published as one stream (JSON under ``events`` in etcd,
    attached to the lease of the process that publishes them: ``kvring events`` or ``kvring up``)."""

    events_addr: str  # ZMQ PUB (an XPUB: a new subscriber gets the pool's snapshot), "tcp://host:port"
    replay_addr: str  # ZMQ ROUTER replaying the stream's recent batches
    topic: str = ""


def split_data_addr(data_addr: str) -> tuple[str, int]:
    """``tcp://host:port`` (an IPv6 host in brackets) as ``(host, port)``; ``ValueError`` if it is not one."""
    host, _, port = data_addr.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"data address {data_addr!r} is not tcp://host:port")
    return host.strip("[]"), int(port)
