"""A node's entry in its cluster's membership (JSON under ``nodes/<node-id>`` in etcd)."""

from __future__ import annotations

import msgspec

from .types import NodeState


class NodeRecord(msgspec.Struct, frozen=True):
    node_id: str
    data_addr: str  # "tcp://host:port" of the data protocol
    admin_addr: str  # "http://host:port" of /healthz, /readyz, /metrics, /stats, /drain
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


def split_data_addr(data_addr: str) -> tuple[str, int]:
    """``tcp://host:port`` (an IPv6 host in brackets) as ``(host, port)``; ``ValueError`` if it is not one."""
    host, _, port = data_addr.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"data address {data_addr!r} is not tcp://host:port")
    return host.strip("[]"), int(port)
