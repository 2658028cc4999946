"""What each node's share of one read cost: the measurements a caller's cost model learns from.

A caller hands a ``ReadMeter`` to ``ClusterClient.lookup``, ``lookup_async`` or
``iter_layers``.  Per node, the read records when its first request went out, when the node's
first reply arrived, the payload bytes and the present keys it answered with, when its last
request was answered, and whether the node failed: it did not answer in time, could not be
reached or broke the connection (``NodeUnavailable``).  An error the node *answered* with is
an answer, not a failure of the node.

``transfers()`` turns that into one ``Transfer`` per node.  A load abandoned before its reads
ended (``transfers(abandoned=True)``) reports the nodes that had not finished as failed at that
moment: how long a stuck node made it wait is a failure of that node, never a measurement of
its speed.

Threading contract: the read records on its caller's thread; ``transfers`` may be called from
another thread (a load abandoned past its deadline).  Each record is a few attribute writes on
one object, atomic enough under the GIL for numbers a cost model only estimates from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Transfer:
    """One node's share of one read."""

    node_id: str
    nbytes: int  # payload bytes it sent
    seconds: float  # from its first request to its last answer (or its failure)
    first_reply_s: float  # from its first request to its first reply: the latency part
    hits: int  # keys it answered present (lookups)
    ok: bool  # False: the node failed (see the module docstring)


@dataclass(slots=True)
class _NodeRead:
    sent: float
    first: float | None = None
    last: float | None = None
    nbytes: int = 0
    hits: int = 0
    requests: int = 0
    answered: int = 0
    failed_at: float | None = None


class ReadMeter:
    """Per-node measurements of one read (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._nodes: dict[str, _NodeRead] = {}

    def sent(self, node_id: str) -> None:
        """A request went out to ``node_id``."""
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _NodeRead(self.clock())
        node.requests += 1

    def replied(self, node_id: str, nbytes: int = 0, hits: int = 0, last: bool = True, at: float | None = None) -> None:
        """``node_id`` answered (``last``: the last reply of one of its requests; ``at``: when,
        on ``clock``, if not now: a reply read on another thread and handed over later)."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        now = self.clock() if at is None else at
        if node.first is None:
            node.first = now
        node.nbytes += nbytes
        node.hits += hits
        if last:
            node.answered += 1
            node.last = now

    def failed(self, node_id: str, at: float | None = None) -> None:
        """``node_id`` did not answer (timed out, unreachable, connection broken)."""
        node = self._nodes.get(node_id)
        if node is not None and node.failed_at is None:
            node.failed_at = self.clock() if at is None else at

    def transfers(self, abandoned: bool = False) -> list[Transfer]:
        """One ``Transfer`` per node that finished: answered every request, or failed.  With
        ``abandoned``, a node still owing answers counts as failed now."""
        now = self.clock()
        out = []
        for node_id, node in list(self._nodes.items()):
            failed_at = node.failed_at
            if failed_at is None and node.answered < node.requests:
                if not abandoned:
                    continue
                failed_at = now
            end = failed_at if failed_at is not None else node.last
            first = node.first if node.first is not None else end
            out.append(Transfer(node_id, node.nbytes, max(0.0, end - node.sent), max(0.0, first - node.sent),
                                node.hits, failed_at is None))
        return out


class _NoMeter(ReadMeter):
    """What a read records when its caller measures nothing."""

    def sent(self, node_id: str) -> None:
        pass

    def replied(self, node_id: str, nbytes: int = 0, hits: int = 0, last: bool = True, at: float | None = None) -> None:
        pass

    def failed(self, node_id: str, at: float | None = None) -> None:
        pass


NO_METER: ReadMeter = _NoMeter()
