"""A node's drain state machine: who asked, when it began and ended, and what ``/drain`` shows.

``active`` --request--> ``draining`` --every chunk handed off--> ``drained``; withdrawing every
request (from ``draining`` or ``drained``) goes back to ``active``.  Requests come from etcd
(``Etcd.request_drain``, which the node's registration thread follows) and from ``POST /drain``
on the admin port; each source is remembered, and the node stays out of the ring while any
remains.

Restart: a node whose pod the operator rolls to a new revision on a cluster with a disk tier is
marked restarting in etcd (``Etcd.request_restart``).  Its preStop ``POST /drain`` then asks
``keep_for_restart`` first: with the marker there (and no drain under way), the node does not
drain -- it keeps its chunks, which are on its disk, stays on the ring until SIGTERM stops it,
and takes them back when it returns.  A drain requested through etcd (scale-in, ``kvring drain
--node``) is never turned into a restart.

Threading contract: called from the registration thread, the HTTP threads and the handoff
thread; one lock guards the transitions.  ``set_state`` (the node's) must not block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvring.common.types import LEFT_RING_STATES, NodeState

from .handoff import DrainProgress, Handoff

logger = logging.getLogger(__name__)


class Drain:
    def __init__(self, node_id: str, state: Callable[[], NodeState], set_state: Callable[[NodeState], None],
                 held: Callable[[], int]) -> None:
        self.node_id = node_id
        self._state = state
        self._set_state = set_state
        self._held = held
        self.handoff: Handoff | None = None  # set by the node once it hands off
        self._lock = threading.Lock()
        self.requests: set[str] = set()  # who asked: "etcd", "http"
        self.started: float | None = None
        self.finished: float | None = None
        # Whether the operator marked this node as restarting (set by ``Registration``: a fresh read
        # of the marker in etcd); without etcd, never.
        self.restart_marked: Callable[[], bool] = lambda: False
        self.kept_for_restart: float | None = None  # when a POST /drain kept the chunks for a restart

    def keep_for_restart(self) -> bool:
        """Whether a ``POST /drain`` should keep the chunks for a restart instead of draining: the
        operator marked this node restarting and no drain is under way or asked for."""
        if self.requests or self._state() in LEFT_RING_STATES or not self.restart_marked():
            return False
        with self._lock:
            if self.requests or self._state() in LEFT_RING_STATES:
                return False
            self.kept_for_restart = time.time()
        logger.info("node %s is marked restarting: keeping its %d chunks for its return, not draining",
                    self.node_id, self._held())
        return True

    def request(self, source: str) -> None:
        """Start draining (idempotent); ``source`` ("etcd" or "http") records who asked."""
        with self._lock:
            new = source not in self.requests
            self.requests.add(source)
            if self._state() in LEFT_RING_STATES:
                return
            self.started, self.finished = time.time(), None
            if self.handoff is not None:
                self.handoff.reset_drain()
            self._set_state(NodeState.DRAINING)
        if new:
            logger.info("node %s draining (asked through %s)", self.node_id, source)

    def cancel(self, source: str) -> None:
        """Withdraw ``source``'s request; with none left the node goes back to ``active``."""
        with self._lock:
            if source not in self.requests:
                return
            self.requests.discard(source)
            if self.requests or self._state() not in LEFT_RING_STATES:
                return
            self.started = self.finished = None
            self._set_state(NodeState.ACTIVE)
        logger.info("node %s: drain cancelled, active again", self.node_id)

    def drained(self) -> None:
        """Every chunk is handed off (the handoff thread calls this)."""
        with self._lock:
            if self._state() != NodeState.DRAINING:
                return
            self.finished = time.time()
            self._set_state(NodeState.DRAINED)
        logger.info("node %s drained: every chunk handed off", self.node_id)

    def status(self) -> dict:
        progress = self.handoff.drain if self.handoff is not None else DrainProgress()
        state = self._state()
        left = state in LEFT_RING_STATES
        reason, waiting = (progress.reason, progress.waiting) if left else ("", "")
        if state == NodeState.DRAINING and self.handoff is None:
            reason, waiting = "no_handoff", ("this node runs without handoff (--no-handoff or no etcd): its chunks "
                                             "stay here; restart it with handoff to drain")
        return {
            "state": state,
            "requested_by": sorted(self.requests),
            "started_at": self.started,
            "finished_at": self.finished,
            "handed_off": progress.handed_off,
            "remaining": self._held() if left else None,
            "reason": reason,
            "waiting": waiting,
            "kept_for_restart_at": self.kept_for_restart,
        }

    def restart_status(self) -> dict:
        """The answer to a ``POST /drain`` that kept the chunks for a restart."""
        held = self._held()
        return {**self.status(), "restart": True, "kept": held,
                "message": f"{self.node_id} is marked restarting: it keeps its {held} chunks for its return "
                           "(on its disk) and does not hand them off; it stops on SIGTERM"}
