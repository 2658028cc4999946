"""Scale-in through draining: the decisions, as pure functions over plain data.

Removing a node pod outright would lose every chunk it owns.  So when ``spec.replicas`` drops
below the StatefulSet's size, the operator first asks each leaving node (the highest ordinals)
to drain (``Etcd.request_drain``): the node leaves the ring, hands its chunks to their new owners
and reports ``drained`` in its etcd record.  Meanwhile the StatefulSet keeps its size.  Once
every leaving node is drained (or gone), or ``drainTimeoutSeconds`` has passed, the StatefulSet
shrinks to the target.  A node that exits after draining deletes its own drain request, so a pod
that later comes back under the same id starts active; a scale-out that reverses a scale-in still
in progress withdraws the requests of the nodes that stay (``cancel_drain``) before growing.

The scale-in in progress is kept in an annotation of the CacheCluster (``SCALE_IN_ANNOTATION``),
not in memory and not in ``status`` (whose schema the API server prunes to the declared fields),
so an operator that restarts picks it up where it was, with its original start time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvring.common.types import NodeState

from .status import Member, ScaleInView, ordinal

logger = logging.getLogger(__name__)

SCALE_IN_ANNOTATION = "kvring.io/scale-in"


@dataclass(frozen=True)
class ScaleIn:
    """A scale-in in progress: from ``source`` pods down to ``target``, draining ``leaving`` first."""

    source: int
    target: int
    leaving: tuple[str, ...]  # node ids, highest ordinal first
    started: float  # unix time the drains were first requested

    def to_annotation(self) -> str:
        return json.dumps({"from": self.source, "to": self.target, "leaving": list(self.leaving),
                           "started": round(self.started, 3)}, separators=(",", ":"))

    @classmethod
    def from_annotation(cls, raw: str | None) -> ScaleIn | None:
        """Read the annotation; a malformed one is ignored (the next reconcile writes a fresh one)."""
        if not raw:
            return None
        try:
            data = json.loads(raw)
            leaving = data["leaving"]
            if not isinstance(leaving, list) or not all(isinstance(n, str) for n in leaving):
                raise TypeError("leaving must be a list of node ids")
            return cls(source=int(data["from"]), target=int(data["to"]), leaving=tuple(leaving),
                       started=float(data["started"]))
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring a malformed %s annotation %r: %s", SCALE_IN_ANNOTATION, raw, exc)
            return None

    @property
    def view(self) -> ScaleInView:
        return ScaleInView(target=self.target, leaving=self.leaving)


@dataclass(frozen=True)
class ReplicaPlan:
    """What a reconcile does about replicas."""

    replicas: int  # the StatefulSet's replicas to render
    scale_in: ScaleIn | None  # the scale-in to record (None: remove the annotation)
    request_drains: tuple[str, ...] = ()  # node ids to ask to drain

    @property
    def staying(self) -> int:
        """How many nodes (the lowest ordinals) stay: their drain requests, if any, are stale."""
        return self.scale_in.target if self.scale_in is not None else self.replicas


def leaving_nodes(name: str, target: int, source: int) -> tuple[str, ...]:
    """Node ids of ordinals ``target .. source-1``, highest first."""
    return tuple(f"{name}-{i}" for i in range(source - 1, target - 1, -1))


def plan_replicas(name: str, desired: int, current: int | None, pending: ScaleIn | None, now: float) -> ReplicaPlan:
    """Decide the StatefulSet size for a reconcile.

    ``current`` is the StatefulSet's ``spec.replicas`` (None if it does not exist yet).  Below
    it, the StatefulSet keeps its size and the leaving nodes are asked to drain; a scale-in to
    the same target that is already under way keeps its start time.  Otherwise the StatefulSet
    takes ``desired`` and any scale-in in progress is dropped.
    """
    if current is None or desired >= current:
        return ReplicaPlan(replicas=desired, scale_in=None)
    leaving = leaving_nodes(name, desired, current)
    same = pending is not None and pending.target == desired and pending.source == current
    scale_in = ScaleIn(source=current, target=desired, leaving=leaving,
                       started=pending.started if same else now)
    return ReplicaPlan(replicas=current, scale_in=scale_in, request_drains=leaving)


def stale_drains(name: str, requested: Iterable[str], staying: int) -> list[str]:
    """Drain requests of nodes that are to stay (ordinal below ``staying``): withdraw them."""
    return sorted(n for n in requested if (o := ordinal(name, n)) is not None and o < staying)


@dataclass(frozen=True)
class DrainProgress:
    done: bool  # shrink the StatefulSet now
    timed_out: bool
    waiting: tuple[str, ...]  # leaving nodes not drained yet


def drain_progress(pending: ScaleIn, members: Mapping[str, Member], now: float, timeout: float) -> DrainProgress:
    """Whether the leaving nodes are drained (or gone), or the drain timeout has passed."""
    waiting = tuple(n for n in pending.leaving if n in members and members[n].state != NodeState.DRAINED)
    if not waiting:
        return DrainProgress(done=True, timed_out=False, waiting=())
    timed_out = now - pending.started >= timeout
    return DrainProgress(done=timed_out, timed_out=timed_out, waiting=waiting)


def describe(pending: ScaleIn, progress: DrainProgress | None = None) -> str:
    """A one-line account for events and logs."""
    if progress is not None and progress.timed_out:
        return (f"{', '.join(progress.waiting)} did not report drained in time; shrinking from "
                f"{pending.source} to {pending.target} nodes anyway (their chunks not yet handed off are lost)")
    if progress is not None and progress.done:
        return f"{', '.join(pending.leaving)} drained; shrinking from {pending.source} to {pending.target} nodes"
    return f"draining {', '.join(pending.leaving)} before shrinking from {pending.source} to {pending.target} nodes"


def annotations_patch(plan: ReplicaPlan, annotations: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata.annotations change that records ``plan.scale_in`` (empty if none is needed)."""
    current = annotations.get(SCALE_IN_ANNOTATION)
    wanted = plan.scale_in.to_annotation() if plan.scale_in is not None else None
    return {} if current == wanted else {SCALE_IN_ANNOTATION: wanted}
