"""A CacheCluster's ``status`` from what the operator observed: pure functions on plain data.

The status timer gathers one ``Observation`` (the node StatefulSet, the members in etcd, the
nodes' ``/stats``, a scale-in in progress) and ``build_status`` turns it into the ``status``
object the CRD declares (``crds/cachecluster.yaml``).  Nothing here talks to Kubernetes or etcd,
so every rule below is tested on plain dicts.

Conditions (one of each type, replaced by type; ``lastTransitionTime`` kept while the status
stays the same, as Kubernetes conventions ask):

- ``Ready``: every desired node pod is ready and its node is ``active`` in etcd.
- ``Degraded``: etcd cannot be reached, or a cluster that had been ready lost nodes.  A cluster
  still coming up is not degraded, only not ready.
- ``Rebalancing``: chunks are moving: a scale-in is draining nodes, a node is joining,
  draining or drained, or a node is restoring copies its co-owners lack (after a node was lost
  or came back empty: its ``/stats`` ``repair.moving``).
- ``ConfigMismatch``: the spec cannot work (``invalid_status``), or cannot be applied to the
  running cluster (``spec.disk`` changed: ``rollout.disk_change``); the running cluster is left
  as it was.
- ``Progressing`` (clusters with a disk tier): a rolling update the operator drives is under way
  (``rollout.plan_roll``); ``status.rollout`` says which pod it waits for and why.

The ring epoch is the etcd revision at which the membership (node ids and states) last
changed, as clients number their rings; it stays put while the membership does.

``poolEvents`` says where the pool's KV events are published as one stream (the record the
relay keeps in etcd under its lease: ``events``, ``replay``, ``topic``); it is left out when no
stream is recorded (and removed from a status that had it), and kept as it was while etcd cannot
be read.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvring.common.records import PoolEventsRecord
from kvring.common.types import NodeState

CONDITION_TYPES = ("Ready", "Degraded", "Rebalancing", "ConfigMismatch", "Progressing")
# Status fields ``build_status`` leaves out when there is nothing to say.
OPTIONAL_FIELDS = ("poolEvents", "credentialsRotation")
MOVING_STATES = frozenset({NodeState.JOINING, NodeState.DRAINING, NodeState.DRAINED})


def iso_at(unix: float) -> str:
    """``now_iso`` of a Unix time."""
    return now_iso(datetime.datetime.fromtimestamp(unix, datetime.UTC))


def now_iso(at: datetime.datetime | None = None) -> str:
    """An RFC 3339 timestamp in UTC, second precision (the ``date-time`` Kubernetes writes)."""
    at = at or datetime.datetime.now(datetime.UTC)
    return at.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | None  # None: Unknown
    reason: str
    message: str = ""

    def __post_init__(self) -> None:
        if self.type not in CONDITION_TYPES:
            raise ValueError(f"unknown condition type {self.type!r}; one of {CONDITION_TYPES}")

    @property
    def status_text(self) -> str:
        return "Unknown" if self.status is None else str(self.status)


def merge_conditions(previous: Iterable[Mapping[str, Any]] | None, updates: Iterable[Condition],
                     generation: int, now: str) -> list[dict[str, Any]]:
    """Replace conditions by type; keep ``lastTransitionTime`` of those whose status did not change.

    Types not in ``updates`` are kept as they were.  The result is ordered as ``CONDITION_TYPES``.
    """
    by_type = {c["type"]: dict(c) for c in (previous or ()) if isinstance(c, Mapping) and "type" in c}
    for cond in updates:
        old = by_type.get(cond.type)
        changed = old is None or old.get("status") != cond.status_text
        by_type[cond.type] = {
            "type": cond.type,
            "status": cond.status_text,
            "reason": cond.reason,
            "message": cond.message,
            "observedGeneration": generation,
            "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
        }
    return [by_type[t] for t in CONDITION_TYPES if t in by_type]


def condition(status: Mapping[str, Any] | None, type_: str) -> dict[str, Any] | None:
    """The condition of ``type_`` in a status object, if any."""
    for c in (status or {}).get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == type_:
            return dict(c)
    return None


def _is_true(status: Mapping[str, Any] | None, type_: str) -> bool:
    c = condition(status, type_)
    return c is not None and c.get("status") == "True"


@dataclass(frozen=True)
class Member:
    """One node's record in etcd, as far as the status needs it."""

    node_id: str
    state: str
    capacity: int = 0
    admin_addr: str = ""  # the node's admin HTTP address (for /stats)


@dataclass(frozen=True)
class ScaleInView:
    """A scale-in in progress, as the status reports it (see ``scaling.ScaleIn``)."""

    target: int
    leaving: tuple[str, ...]


@dataclass(frozen=True)
class Observation:
    """What the status timer saw in one pass."""

    name: str
    generation: int
    desired: int  # spec.replicas
    statefulset: Mapping[str, Any] | None  # None: not created (yet)
    members: Mapping[str, Member] | None  # None: etcd could not be read
    revision: int = 0  # etcd revision the members were read at
    etcd_error: str = ""
    pool_events: PoolEventsRecord | None = None  # the event stream's record, read with the members
    stats: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # node id -> /stats
    scale_in: ScaleInView | None = None
    spec_problem: str = ""  # why the spec cannot be applied to the running cluster ("" if it can)
    rollout: Mapping[str, Any] | None = None  # status.rollout (clusters with a disk tier)
    progressing: Condition | None = None
    rotation: Mapping[str, Any] | None = None  # status.credentialsRotation (one in progress)


def ordinal(name: str, node_id: str) -> int | None:
    """The StatefulSet ordinal of ``node_id`` (``<name>-<ordinal>``), or None for another id."""
    suffix = node_id.removeprefix(f"{name}-") if node_id.startswith(f"{name}-") else ""
    return int(suffix) if suffix.isdigit() else None


def _sts_numbers(sts: Mapping[str, Any] | None) -> tuple[int, int, int]:
    """(spec.replicas, status.replicas, status.readyReplicas) of a StatefulSet (0s when absent)."""
    if not sts:
        return 0, 0, 0
    spec, status = sts.get("spec") or {}, sts.get("status") or {}
    return int(spec.get("replicas") or 0), int(status.get("replicas") or 0), int(status.get("readyReplicas") or 0)


def node_summaries(obs: Observation) -> list[dict[str, Any]]:
    """One entry per expected pod ordinal and per registered member, ordered by ordinal.

    ``state`` is the etcd state, or ``missing`` for an expected node with no record (or
    ``unknown`` while etcd cannot be read); ``ready`` means registered and ``active``.
    """
    sts_replicas = _sts_numbers(obs.statefulset)[0] if obs.statefulset else obs.desired
    ids = {f"{obs.name}-{i}" for i in range(sts_replicas)} | set(obs.members or {})
    out = []
    for node_id in sorted(ids, key=lambda n: (ordinal(obs.name, n) is None, ordinal(obs.name, n) or 0, n)):
        member = (obs.members or {}).get(node_id)
        stats = obs.stats.get(node_id) or {}
        entry: dict[str, Any] = {
            "id": node_id,
            "state": member.state if member else ("unknown" if obs.members is None else "missing"),
            "ready": bool(member and member.state == NodeState.ACTIVE),
        }
        capacity = stats.get("capacity", member.capacity if member else None)
        if isinstance(capacity, int) and capacity > 0:
            entry["capacityBytes"] = capacity
        if isinstance(stats.get("used"), int):
            entry["usedBytes"] = stats["used"]
        out.append(entry)
    return out


def repairs_in_progress(stats: Mapping[str, Mapping[str, Any]]) -> str:
    """Which nodes are restoring copies their co-owners lack (their ``/stats`` ``repair``), as a
    message; empty when none is."""
    parts = []
    for node_id in sorted(stats):
        repair = stats[node_id].get("repair")
        if isinstance(repair, Mapping) and repair.get("moving"):
            parts.append(f"{node_id} restored {repair.get('copied', 0)} of {repair.get('missing', 0)} missing copies "
                         f"so far")
    return "; ".join(parts)


def membership_epoch(previous: Mapping[str, Any] | None, nodes: list[dict[str, Any]], obs: Observation) -> int:
    """Keep the previous epoch while the registered ids and states are the ones it was given to."""
    prev_epoch = int((previous or {}).get("epoch") or 0)
    if obs.members is None:
        return prev_epoch

    def registered(entries: Iterable[Mapping[str, Any]]) -> set[tuple[str, str]]:
        return {(n.get("id"), n.get("state")) for n in entries
                if isinstance(n, Mapping) and n.get("state") not in ("missing", "unknown")}

    if prev_epoch and registered((previous or {}).get("nodes") or ()) == registered(nodes):
        return prev_epoch
    return obs.revision if registered(nodes) else prev_epoch


def observed_conditions(obs: Observation, nodes: list[dict[str, Any]],
                        previous: Mapping[str, Any] | None) -> list[Condition]:
    _, _, ready_pods = _sts_numbers(obs.statefulset)
    expected = [n for n in nodes if (o := ordinal(obs.name, n["id"])) is not None and o < obs.desired]
    active = [n for n in expected if n["state"] == NodeState.ACTIVE]
    lacking = [n for n in expected if n["state"] != NodeState.ACTIVE]
    not_active = ", ".join("{} ({})".format(n["id"], n["state"]) for n in lacking)
    unready = f"{len(active)} of {obs.desired} nodes active in etcd" + (
        f"; not active: {not_active}" if lacking else "")

    # Ready
    if obs.members is None:
        ready = Condition("Ready", False, "EtcdUnreachable", f"cannot read membership from etcd: {obs.etcd_error}")
    elif obs.statefulset is None:
        ready = Condition("Ready", False, "Creating", "the node StatefulSet does not exist yet")
    elif ready_pods < obs.desired:
        ready = Condition("Ready", False, "PodsNotReady", f"{ready_pods} of {obs.desired} node pods ready")
    elif lacking:
        ready = Condition("Ready", False, "NodesNotActive", unready)
    else:
        ready = Condition("Ready", True, "AllNodesReady", f"{obs.desired} of {obs.desired} nodes ready and active")

    # Degraded
    if obs.members is None:
        degraded = Condition("Degraded", True, "EtcdUnreachable", ready.message)
    elif ready.status:
        degraded = Condition("Degraded", False, "AsExpected", "")
    elif _is_true(previous, "Ready") or _is_true(previous, "Degraded"):
        message = unready if lacking else ready.message
        degraded = Condition("Degraded", True, "NodesUnavailable", message)
    else:
        degraded = Condition("Degraded", False, "Starting", "the cluster has not been ready yet")

    # Rebalancing
    moving = [n for n in nodes if n["state"] in MOVING_STATES]
    if obs.scale_in is not None:
        rebalancing = Condition("Rebalancing", True, "ScaleIn",
                                f"draining {', '.join(obs.scale_in.leaving)} before shrinking to "
                                f"{obs.scale_in.target} nodes")
    elif moving:
        rebalancing = Condition("Rebalancing", True, "NodesMoving",
                                ", ".join("{} {}".format(n["id"], n["state"]) for n in moving))
    elif repairing := repairs_in_progress(obs.stats):
        rebalancing = Condition("Rebalancing", True, "RestoringCopies", repairing)
    elif obs.members is None:
        rebalancing = Condition("Rebalancing", None, "EtcdUnreachable", ready.message)
    else:
        rebalancing = Condition("Rebalancing", False, "Stable", "")

    spec_ok = Condition("ConfigMismatch", True, "DiskImmutable", obs.spec_problem) if obs.spec_problem \
        else Condition("ConfigMismatch", False, "SpecValid", "")
    return [ready, degraded, rebalancing, spec_ok, *([obs.progressing] if obs.progressing is not None else [])]


def pool_events_status(obs: Observation, previous: Mapping[str, Any] | None) -> dict[str, str] | None:
    """``status.poolEvents``: the stream's endpoints from its record; the previous value while etcd
    cannot be read; None when no stream is recorded."""
    if obs.members is None:
        kept = (previous or {}).get("poolEvents")
        return dict(kept) if isinstance(kept, Mapping) else None
    record = obs.pool_events
    if record is None:
        return None
    return {"events": record.events_addr, "replay": record.replay_addr, "topic": record.topic}


def build_status(obs: Observation, previous: Mapping[str, Any] | None, *, selector: str, connector: str,
                 now: str) -> dict[str, Any]:
    """The whole ``status`` object for a valid spec (``OPTIONAL_FIELDS`` only when they say something)."""
    _, pods, ready_pods = _sts_numbers(obs.statefulset)
    nodes = node_summaries(obs)
    rollout = {"rollout": dict(obs.rollout)} if obs.rollout is not None else {}
    pool_events = pool_events_status(obs, previous)
    return {
        **rollout,
        **({"poolEvents": pool_events} if pool_events is not None else {}),
        **({"credentialsRotation": dict(obs.rotation)} if obs.rotation is not None else {}),
        "observedGeneration": obs.generation,
        "replicas": pods,
        "readyReplicas": ready_pods,
        "selector": selector,
        "epoch": membership_epoch(previous, nodes, obs),
        "nodes": nodes,
        "conditions": merge_conditions((previous or {}).get("conditions"),
                                       observed_conditions(obs, nodes, previous), obs.generation, now),
        "connector": connector,
    }


def invalid_status(previous: Mapping[str, Any] | None, generation: int, message: str, now: str) -> dict[str, Any]:
    """The status fields to set for a spec that cannot work; the rest of the status stays."""
    updates = [Condition("ConfigMismatch", True, "InvalidSpec", message),
               Condition("Ready", False, "InvalidSpec", "the spec cannot work; see the ConfigMismatch condition")]
    return {"observedGeneration": generation,
            "conditions": merge_conditions((previous or {}).get("conditions"), updates, generation, now)}


def changed_fields(current: Mapping[str, Any] | None, desired: Mapping[str, Any], *,
                   whole: bool = False) -> dict[str, Any]:
    """The top-level fields of ``desired`` that differ from ``current`` (a minimal status patch).
    ``whole``: ``desired`` is the whole status (``build_status``), so an ``OPTIONAL_FIELDS`` field
    it leaves out is removed (None in a merge patch)."""
    current = current or {}
    patch = {k: v for k, v in desired.items() if current.get(k) != v}
    if whole:
        patch.update({k: None for k in OPTIONAL_FIELDS if k not in desired and current.get(k) is not None})
    return patch
