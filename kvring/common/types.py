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
    """

    JOINING = "joining"
    ACTIVE = "active"
    DRAINING = "draining"
    DRAINED = "drained"

    @property
    def on_ring(self) -> bool:
        return self not in LEFT_RING_STATES


LEFT_RING_STATES = frozenset({NodeState.DRAINING, NodeState.DRAINED})  # members that own no keys
