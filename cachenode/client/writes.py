"""Writes and node-level requests: PUT to every owner, DELETE, FLUSH, and one-node calls.

Threading contract: every function runs on its caller's thread (an ``Exchange`` per call), and
may be called from many threads at once.

PUT sends each chunk to all its live owners (``replication`` of them) in parallel, pipelined on
one connection per node; a chunk stored by at least one owner counts as stored.  A node that
times out is marked failed; a refusal that no node would accept (checksum, sizes) is raised.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence

from kvring.common import protocol as P
from kvring.common.chunk import ChunkItem
from kvring.common.errors import ChunkRejected, KVRingError, NodeUnavailable, NoOwners

from .ringview import FailureMarks, Membership
from .transport import Exchange, Failure, Links, next_rid

logger = logging.getLogger(__name__)


class Writes:
    def __init__(self, links: Links, membership: Membership, marks: FailureMarks, timeout: float,
                 cluster: str) -> None:
        self.links = links
        self.membership = membership
        self.marks = marks
        self.timeout = timeout
        self.cluster = cluster

    def put_many(self, items: Sequence[ChunkItem]) -> list[int]:
        """Store every item on all its owners; returns the replicas stored per item."""
        stored = [0] * len(items)
        if not self.membership.usable:  # not reached yet, or its contract changed: store nothing under ours
            return stored
        ring = self.membership.view.ring
        if not ring.nodes:
            raise NoOwners(f"no active node in cluster {self.cluster!r}; is `kvring up` running?")
        errors: list[KVRingError] = []
        asked: dict[int, int] = {}
        with Exchange(self.links, self.timeout) as ex:
            for i, (item, owners) in enumerate(zip(items, ring.owners_many([it.key for it in items]))):
                live = [n for n in owners if self.marks.alive(n) and n in self.links] or \
                       [n for n in owners if n in self.links]
                for node_id in live:
                    msg = P.Put(rid=next_rid(), epoch=ring.epoch, key=item.key, meta=item.meta)
                    asked[ex.request(node_id, msg, [item.payload])] = i
            for event in ex.events():
                if isinstance(event, Failure):
                    self.marks.failed(event.node_id, event.error)
                    errors.append(event.error)
                    continue
                stored[asked[event.rid]] += 1
        rejected = [e for e in errors if isinstance(e, ChunkRejected)]
        if rejected and not any(stored):
            raise rejected[0]
        if errors and not any(stored):
            raise KVRingError(f"no replica stored: {errors[0]}")
        if errors:
            logger.debug("%d replica writes failed, first: %s", len(errors), errors[0])
        return stored

    def put_to(self, copies: Mapping[str, Sequence[ChunkItem]]) -> dict[str, list[bool]]:
        """Store each node's items on that node, whoever owns them (repair, handoff); returns,
        per node, which items it stored.  Failures are logged and count as not stored."""
        ring = self.membership.view.ring
        stored = {node_id: [False] * len(items) for node_id, items in copies.items()}
        if not self.membership.usable:
            return stored
        asked: dict[int, tuple[str, int]] = {}
        with Exchange(self.links, self.timeout) as ex:
            for node_id, items in copies.items():
                for i, item in enumerate(items):
                    msg = P.Put(rid=next_rid(), epoch=ring.epoch, key=item.key, meta=item.meta)
                    asked[ex.request(node_id, msg, [item.payload])] = (node_id, i)
            for event in ex.events():
                if isinstance(event, Failure):
                    self.marks.failed(event.node_id, event.error)
                    logger.debug("copy to %s failed: %s", event.node_id, event.error)
                    continue
                node_id, i = asked[event.rid]
                stored[node_id][i] = True
        return stored

    def delete(self, keys: list[bytes], node: str | None) -> int:
        """Delete keys from all their owners (or from ``node`` only); returns copies removed."""
        ring = self.membership.view.ring
        groups: dict[str, list[bytes]] = defaultdict(list)
        for key, owners in zip(keys, ring.owners_many(keys) if node is None else [[node]] * len(keys)):
            for node_id in owners:
                groups[node_id].append(key)
        deleted = 0
        with Exchange(self.links, self.timeout) as ex:
            for node_id, ks in groups.items():
                for i in range(0, len(ks), P.MAX_KEYS_PER_REQUEST):
                    ex.request(node_id, P.Delete(rid=next_rid(), keys=ks[i:i + P.MAX_KEYS_PER_REQUEST]))
            for event in ex.events():
                if not isinstance(event, Failure):
                    deleted += event.msg.deleted
        return deleted

    def each_member(self, make_msg) -> dict[str, object]:
        """One request to every member (draining ones included): its reply, or the error."""
        out: dict[str, object] = {}
        asked: dict[int, str] = {}
        with Exchange(self.links, self.timeout) as ex:
            for node_id in sorted(self.membership.view.members):
                asked[ex.request(node_id, make_msg())] = node_id
            for event in ex.events():
                if isinstance(event, Failure):
                    for rid in event.rids:
                        out[asked[rid]] = event.error
                else:
                    out[asked[event.rid]] = event.msg
        return out

    def call(self, node_id: str, msg):
        """One request to one node and its reply (raises its error)."""
        with Exchange(self.links, self.timeout) as ex:
            ex.request(node_id, msg)
            for event in ex.events():
                if isinstance(event, Failure):
                    self.marks.failed(node_id, event.error)
                    raise event.error
                return event.msg
        raise NodeUnavailable(f"node {node_id} did not answer")
