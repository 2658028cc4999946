"""Names for look-alike values, and the states a node goes through."""

from __future__ import annotations

import enum
from typing import NewType

ChunkHash = NewType("ChunkHash", bytes)  # a chunk's key: 16 bytes of the chained hash
NodeId = NewType("NodeId", str)  # a node's name in its cluster (no '/')


class NodeState(enum.StrEnum):
    """A member's state, as recorded in etcd and shown by ``/stats`` and the admin API.

    ``joining`` and ``active`` nodes are on the ring.  ``draining`` and ``drained`` nodes stay
    members (their records and addresses remain, reads may still reach them) but own no keys.
    ``unhealthy``: the node's data plane failed its own check (``cachenode/selfcheck.py``); it
    owns no keys until it answers again, and keeps its chunks.
    """

    JOINING = "joining"
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"
    UNHEALTHY = "unhealthy"

    @property
    def on_ring(self) -> bool:
        return self not in OFF_RING_STATES


LEFT_RING_STATES = frozenset({NodeState.DRAINING, NodeState.DRAINED})  # leaving: their chunks move away
OFF_RING_STATES = LEFT_RING_STATES | {NodeState.UNHEALTHY}  # members that own no keys
