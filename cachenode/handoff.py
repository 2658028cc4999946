"""Handoff: a node moves the chunks it no longer owns to their owners; a draining node, all.

After a ring change (a node joined, or this node is draining and left the ring) the chunks a
node holds but no longer owns would only be reachable through the clients' previous-owner
fallback, for a while.  The handoff thread of each node notices the new ring epoch, pages
through its own keys, and for every key it does not own any more reads the chunk from itself,
PUTs it to the key's owners (namespace kept) and deletes its own copy once at least one owner
stored it.

It talks to its own node over the data protocol like any client (the store stays owned by
the node's I/O thread) and never hands off while this node is missing from the ring without
draining (an etcd hiccup must not empty a node).

Draining: a node whose state is ``draining`` or ``drained`` owns nothing, so every chunk it
holds leaves.  Once the ring this thread sees no longer has the node, it runs a pass every
interval until the node holds no chunk, then calls ``on_drained`` (the node reports
``drained``).  It keeps looking afterwards: a client that had not yet seen the new ring may
still have put a chunk here, and the next pass moves it on.  A drain that cannot finish keeps
its chunks (nothing is deleted before an owner stored it) and says why in
``DrainProgress`` (``reason`` for programs, ``waiting`` for people): the ring has no other node to take them (the single-node case;
they stay here until a node joins or the drain is cancelled), their owners refused them or
did not answer, or etcd is unreachable.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract
from kvring.common.errors import KVRingError
from kvring.common.ring import HashRing
from kvring.common.types import LEFT_RING_STATES, NodeState
from kvring.membership.settings import EtcdSettings

from .client import ClusterClient

logger = logging.getLogger(__name__)


@dataclass
class DrainProgress:
    """What a drain has done so far (read by the node's ``/stats``; written by the handoff thread)."""

    handed_off: int = 0  # chunks moved away since the drain began
    passes: int = 0
    # Why the drain has not finished ("" once nothing is left): "starting", "ring_update" (the
    # ring still has this node), "no_owners" (no active node to take the chunks), "retrying"
    # (owners refused or did not answer), "paused" (etcd or the cluster unreachable).
    reason: str = ""
    waiting: str = ""  # the same, for people


class Handoff:
    def __init__(self, node_id: str, etcd: EtcdSettings, contract: Contract, state: Callable[[], str],
                 held: Callable[[], int], on_drained: Callable[[], None], interval: float = 1.0,
                 batch: int = 32, page: int = 1024) -> None:
        self.node_id = node_id
        self.etcd = etcd
        self.contract = contract
        self.state = state
        self.held = held
        self.on_drained = on_drained
        self.interval = interval
        self.batch = batch
        self.page = page
        self.moved = 0
        self.done_epoch = 0
        self.drain = DrainProgress()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvring-handoff", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def reset_drain(self) -> None:
        """A new drain begins (the node calls this when it enters ``draining``)."""
        self.drain = DrainProgress(reason="starting", waiting="starting")

    def _run(self) -> None:
        client: ClusterClient | None = None
        try:
            while not self._stop.wait(self.interval):
                draining = self.state() in LEFT_RING_STATES
                try:
                    if client is None:
                        client = ClusterClient(self.etcd, contract=self.contract, handoff_window=0,
                                               poll_interval=self.interval, timeout=2.0)
                    if draining:
                        self._drain_step(client)
                    else:
                        self._rebalance_step(client)
                except KVRingError as exc:
                    logger.warning("handoff paused: %s", exc)
                    if draining:
                        self._blocked("paused", f"paused, will retry: {exc}")
        finally:
            if client is not None:
                client.close()

    def _rebalance_step(self, client: ClusterClient) -> None:
        ring = client.ring
        if ring.epoch == self.done_epoch or not ring.nodes or self.node_id not in ring.nodes:
            return
        moved = self.pass_once(client, ring)
        self.done_epoch = ring.epoch
        if moved:
            logger.info("handed off %d chunks after ring epoch %d", moved, ring.epoch)

    def _drain_step(self, client: ClusterClient) -> None:
        ring = client.ring
        if self.node_id in ring.nodes:
            self._blocked("ring_update", "waiting for the ring to drop this node")
            return
        held = self.held()
        if held and not ring.nodes:
            self._blocked("no_owners", f"no active node is left in the ring to take this node's {held} chunks; "
                                       "they stay here (add a node, or cancel the drain)")
            return
        if held:
            moved = self.pass_once(client, ring)
            self.drain.handed_off += moved
            self.drain.passes += 1
            held = self.held()
            if moved:
                logger.info("draining: handed off %d chunks, %d left", moved, held)
        if held:
            self._blocked("retrying", f"{held} chunks not handed off yet (their owners refused them or did not "
                                      "answer); retrying")
            return
        self._blocked("", "")
        if self.state() == NodeState.DRAINING:
            self.on_drained()

    def _blocked(self, reason: str, waiting: str) -> None:
        self.drain.reason, self.drain.waiting = reason, waiting

    def pass_once(self, client: ClusterClient, ring: HashRing) -> int:
        """Move every chunk this node holds but does not own on ``ring``; returns how many."""
        moved, after = 0, b""
        while not self._stop.is_set():
            keys = client.list_keys(self.node_id, after, self.page)
            if not keys:
                break
            after = keys[-1]
            leaving = [k for k, owners in zip(keys, ring.owners_many(keys)) if self.node_id not in owners]
            for i in range(0, len(leaving), self.batch):
                chunks = [c for c in client.get(leaving[i:i + self.batch], node=self.node_id) if c is not None]
                items = [ChunkItem(c.key, c.data, c.meta) for c in chunks]
                stored = client.put_many(items) if items else []
                done = [item.key for item, n in zip(items, stored) if n > 0]
                if done:
                    client.delete(done, node=self.node_id)
                moved += len(done)
        self.moved += moved
        return moved
