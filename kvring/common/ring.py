"""The consistent-hash ring: virtual nodes weighted by capacity, ``replication`` distinct owners.

Pure and deterministic: any two processes with the same membership (node ids and capacities)
and the same ``vnodes``/``replication`` compute the same owners for every key.  Virtual node
``j`` of node ``n`` sits at ``ring_position(b"<n>#<j>")``; a key sits at ``ring_position(key)``
and is owned by the first ``replication`` distinct nodes clockwise from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .hashing import ring_position, ring_positions

if TYPE_CHECKING:
    from .contract import Contract
    from .records import NodeRecord

DEFAULT_VNODES = 1024
_SPACE = float(2**64)


@dataclass(frozen=True)
class HashRing:
    """Immutable ring over ``weights`` (node id -> capacity in bytes, or any positive weight)."""

    weights: Mapping[str, int]
    vnodes: int = DEFAULT_VNODES
    replication: int = 1
    epoch: int = 0
    _points: np.ndarray = field(init=False, repr=False, compare=False)
    _owners: np.ndarray = field(init=False, repr=False, compare=False)
    _ids: tuple[str, ...] = field(init=False, repr=False, compare=False)

    @classmethod
    def of_members(cls, members: Mapping[str, NodeRecord], contract: Contract, epoch: int) -> HashRing:
        """The ring every process builds from a cluster's members: the ones on the ring, weighted
        by capacity, placed by the contract's virtual nodes and replication."""
        weights = {node_id: rec.capacity for node_id, rec in members.items() if rec.on_ring}
        return cls(weights, vnodes=contract.vnodes, replication=contract.replication, epoch=epoch)

    def __post_init__(self) -> None:
        if self.vnodes <= 0 or self.replication <= 0:
            raise ValueError("vnodes and replication must be positive")
        ids = tuple(sorted(self.weights))
        if any(self.weights[n] <= 0 for n in ids):
            raise ValueError("node weights must be positive")
        points: list[int] = []
        owners: list[int] = []
        if ids:
            mean = sum(self.weights.values()) / len(ids)
            for idx, node in enumerate(ids):
                count = max(1, round(self.vnodes * self.weights[node] / mean))
                points.extend(ring_position(f"{node}#{j}".encode()) for j in range(count))
                owners.extend([idx] * count)
        pts = np.array(points, dtype=np.uint64)
        own = np.array(owners, dtype=np.int32)
        order = np.argsort(pts, kind="stable")
        object.__setattr__(self, "_ids", ids)
        object.__setattr__(self, "_points", pts[order])
        object.__setattr__(self, "_owners", own[order])

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def owners(self, key: bytes) -> list[str]:
        """The distinct owners of ``key``, primary first (fewer if the ring has fewer nodes)."""
        if not self._ids:
            return []
        return self._walk(int(np.searchsorted(self._points, np.uint64(ring_position(key)), side="left")))

    def primaries(self, keys: Sequence[bytes]) -> list[str]:
        """The primary owner of each key, vectorised for large batches."""
        if not self._ids:
            return []
        idx = np.searchsorted(self._points, ring_positions(keys), side="left") % len(self._points)
        return [self._ids[i] for i in self._owners[idx]]

    def owners_many(self, keys: Sequence[bytes]) -> list[list[str]]:
        """``owners`` of many keys with one vectorised search."""
        if not self._ids:
            return [[] for _ in keys]
        if len(self._ids) == 1:
            return [[self._ids[0]] for _ in keys]
        idx = np.searchsorted(self._points, ring_positions(keys), side="left")
        if self.replication == 1 or len(self._ids) == 1:
            return [[self._ids[o]] for o in self._owners[idx % len(self._points)].tolist()]
        return [self._walk(i) for i in idx.tolist()]

    def _walk(self, start: int) -> list[str]:
        want = min(self.replication, len(self._ids))
        found: list[str] = []
        n = len(self._points)
        i = start
        while len(found) < want:
            node = self._ids[self._owners[i % n]]
            if node not in found:
                found.append(node)
            i += 1
        return found

    def shares(self) -> dict[str, float]:
        """Fraction of the hash space each node owns as primary (exact, from arc lengths)."""
        if not self._ids:
            return {}
        pts = self._points.astype(np.float64)
        # The arc ending at point i (from the previous point) belongs to point i's node.
        arcs = np.diff(pts, prepend=pts[-1] - _SPACE)
        out = np.zeros(len(self._ids))
        np.add.at(out, self._owners, arcs)
        out /= _SPACE
        return {node: float(out[i]) for i, node in enumerate(self._ids)}

    def balance(self) -> float:
        """Busiest node's share over the mean share (1.0 is perfect), weighted by capacity."""
        shares = self.shares()
        if not shares:
            return 0.0
        total = sum(self.weights.values())
        return max(shares[n] / (self.weights[n] / total) for n in shares)
