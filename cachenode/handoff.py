"""Handoff and repair: a node's thread that keeps every chunk it holds where the ring wants it.

After a ring change (a node joined, left, came back empty under its id, or this node is
draining and left the ring) chunks can be on the wrong nodes (the node no longer owns them) or
missing from some of their owners (an owner was lost or restarted empty).  This thread notices
the change (a new ring epoch; a restarted node writes a new incarnation into its record, which
makes one), and runs a ``repair.RepairPass`` over this node's keys: copies go to the owners
that lack them, and copies this node no longer owns leave once their owners hold them.  It
also runs a pass every ``repair_interval`` seconds (a PUT that missed a replica), and again
after ``retry`` seconds while a pass could not finish (an owner did not answer).

It talks to its own node over the data protocol like any client (the store stays owned by
the node's I/O thread) and never hands off while this node is missing from the ring without
draining (an etcd hiccup must not empty a node).

Draining: a node whose state is ``draining`` or ``drained`` owns nothing, so every chunk it
holds leaves.  Once the ring this thread sees no longer has the node, it runs a pass every
interval until the node holds no chunk, then calls ``on_drained`` (the node reports
``drained``).  It keeps looking afterwards: a client that had not yet seen the new ring may
still have put a chunk here, and the next pass moves it on.  A drain that cannot finish keeps
its chunks (nothing is deleted before an owner stored it) and says why in
``DrainProgress`` (``reason`` for programs, ``waiting`` for people): the ring has no other node
to take them (the single-node case; they stay here until a node joins or the drain is
cancelled), their owners refused them or did not answer, or etcd is unreachable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvring.common.contract import Contract
from kvring.common.errors import KVRingError
from kvring.common.ring import HashRing
from kvring.common.tls import ClusterCredentials
from kvring.common.types import LEFT_RING_STATES, NodeState
from kvring.membership.settings import EtcdSettings

from .client import ClusterClient
from .repair import RateLimit, RepairPass, RepairProgress, full_nodes

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
                 batch: int = 32, page: int = 1024, repair_rate: int = 64 << 20, repair_interval: float = 60.0,
                 retry: float = 5.0, tls: ClusterCredentials | None = None) -> None:
        self.node_id = node_id
        self.etcd = etcd
        self.contract = contract
        self.state = state
        self.held = held
        self.on_drained = on_drained
        self.interval = interval
        self.batch = batch
        self.page = page
        self.repair_interval = repair_interval
        self.retry = retry
        self.tls = tls
        self.moved = 0
        self.done_epoch = 0
        self.next_pass = 0.0  # monotonic time of the next pass without a ring change, and why
        self.next_trigger = "periodic"
        self.drain = DrainProgress()
        self.repair = RepairProgress(rate_limit=repair_rate)
        self._stop = threading.Event()
        self._limit = RateLimit(repair_rate, self._stop)
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
                        client = ClusterClient(self.etcd, contract=self.contract, handoff_window=0, timeout=2.0,
                                               tls=self.tls)
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
        if not ring.nodes or self.node_id not in ring.nodes:
            return
        if ring.epoch != self.done_epoch:
            trigger = f"ring epoch {ring.epoch}"
        elif time.monotonic() >= self.next_pass:
            trigger = self.next_trigger
        else:
            return
        avoid = full_nodes(client.stats()) if trigger == "periodic" else frozenset()
        moved = self.pass_once(client, ring, trigger, avoid=avoid)
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
            moved = self.pass_once(client, ring, draining=True)
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

    def pass_once(self, client: ClusterClient, ring: HashRing, trigger: str = "", draining: bool = False,
                  avoid: frozenset[str] = frozenset()) -> int:
        """Run one repair pass on ``ring``; returns how many chunks left this node."""
        progress = self.repair
        progress.begin(trigger or "drain", epoch=ring.epoch)
        repair = RepairPass(client, self.node_id, ring, progress, self._limit, self._stop, draining=draining,
                            page=self.page, batch=self.batch, avoid=avoid)
        try:
            moved = repair.run()
        except KVRingError:
            repair.incomplete = True
            raise
        finally:
            progress.end(incomplete=repair.incomplete or self._stop.is_set())
            self.next_trigger = "retry" if repair.incomplete else "periodic"
            self.next_pass = time.monotonic() + (self.retry if repair.incomplete else self.repair_interval)
        if progress.copied:
            logger.info("repair (%s): restored %d copies (%.1f MiB) in %.1fs", progress.trigger, progress.copied,
                        progress.copied_bytes / (1 << 20), progress.last_pass_s)
        self.moved += moved
        return moved
