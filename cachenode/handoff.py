"""Handoff: a node moves the chunks it no longer owns to their owners.

After a ring change (a node joined, or this node is draining and left the ring) the chunks a
node holds but no longer owns would only be reachable through the clients' previous-owner
fallback, for a while.  The handoff thread of each node notices the new ring epoch, pages
through its own keys, and for every key it does not own any more reads the chunk from itself,
PUTs it to the key's owners and deletes its own copy once at least one owner stored it.

It talks to its own node over the data protocol like any client (the store stays owned by
the node's I/O thread) and never hands off while this node is missing from the ring without
draining (an etcd hiccup must not empty a node).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .client import ClusterClient
from .errors import KVRingError
from .membership import Contract, EtcdSettings
from .ring import HashRing

logger = logging.getLogger(__name__)


class Handoff:
    def __init__(self, node_id: str, etcd: EtcdSettings, contract: Contract, state: Callable[[], str],
                 interval: float = 1.0, batch: int = 32, page: int = 1024) -> None:
        self.node_id = node_id
        self.etcd = etcd
        self.contract = contract
        self.state = state
        self.interval = interval
        self.batch = batch
        self.page = page
        self.moved = 0
        self.done_epoch = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvring-handoff", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        client: ClusterClient | None = None
        try:
            while not self._stop.wait(self.interval):
                try:
                    if client is None:
                        client = ClusterClient(self.etcd, contract=self.contract, handoff_window=0,
                                               poll_interval=self.interval, timeout=2.0)
                    ring = client.ring
                    if ring.epoch == self.done_epoch or not ring.nodes:
                        continue
                    if self.node_id not in ring.nodes and self.state() != "draining":
                        continue
                    moved = self.pass_once(client, ring)
                    self.done_epoch = ring.epoch
                    if moved:
                        logger.info("handed off %d chunks after ring epoch %d", moved, ring.epoch)
                except KVRingError as exc:
                    logger.warning("handoff paused: %s", exc)
        finally:
            if client is not None:
                client.close()

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
                items = [(c.key, c.data, c.meta.shape, c.meta.dtype, c.meta.tokens) for c in chunks]
                stored = client.put_many(items) if items else []
                done = [item[0] for item, n in zip(items, stored) if n > 0]
                if done:
                    client.delete(done, node=self.node_id)
                moved += len(done)
        self.moved += moved
        return moved
