"""Rolling upgrades that keep the cache: the operator rolls a disk cluster's pods one at a time.

Without a disk tier, the StatefulSet controller rolls the node pods by itself and each pod's
preStop hook drains its node: the chunks go to other nodes, since the pod comes back empty.  With
``spec.disk`` the pod comes back with its chunks (its volume stays, and the node rebuilds its
index from it before it reports ready), so handing them off would be wasted work, and with one
copy per chunk a roll would move the whole cache around.  So the operator drives the roll:

1. A change of the pod template (image, settings) is applied with the StatefulSet's
   ``updateStrategy.rollingUpdate.partition`` at the number of pods (``held_partition``): the
   controller makes the new revision and replaces no pod.
2. Each status pass (``plan_roll``) picks the highest ordinal still on the old revision, once
   every pod is Ready: it marks that node restarting in etcd (``Etcd.request_restart``) and only
   then lowers the partition to its ordinal.  The controller deletes the pod; its preStop
   ``POST /drain`` finds the marker, so the node keeps its chunks and stops on SIGTERM.
3. The next pod goes only when this one is back: Ready on the new revision (which implies its
   index was rebuilt from disk), active in etcd, and -- with ``replication >= 2`` -- repair
   has settled: every node has reported (``RepairReport``, under ``repair/<id>`` in etcd) a
   finished pass with nothing left to retry on a ring at least as new as the returning node's
   record.  Then the marker goes (``cancel_restart``) and step 2 repeats.  Repair that has not
   settled within ``drainTimeoutSeconds`` of the pod's return lets the roll go on, with a
   warning event.
4. When every pod runs the new revision the partition goes back to 0.

Why a partition rather than ``OnDelete`` with the operator deleting pods: the controller keeps
doing what it does well (replacing the pod, re-attaching its volume, the revision bookkeeping,
``kubectl rollout status``), the operator needs no right to delete pods, and an operator that
stops in the middle leaves a StatefulSet that simply holds at its partition.  Even a partition
lowered too far by mistake would not take several pods down at once: the controller's rolling
update replaces one pod at a time and waits for it to be Ready.

The step in progress (which node, since when, the etcd revision it came back at) is kept in an
annotation of the CacheCluster (``ROLLOUT_ANNOTATION``), so an operator that restarts picks the
roll up where it was.  Everything here is pure: the handlers gather a ``RollInput`` and carry
out the ``RollPlan``.  ``status.rollout`` and the ``Progressing`` condition show where it stands.

A scale-in in progress holds the roll (its leaving nodes drain and hand off, as always).  A
``spec.disk`` that changes on an existing cluster cannot be applied (a StatefulSet's claim
templates are immutable): ``disk_change`` says so, and the handlers leave the StatefulSet alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvring.common.records import RepairReport
from kvring.common.types import NodeState

from .kube import contains
from .spec import parse_bytes
from .status import Condition, ordinal

logger = logging.getLogger(__name__)

ROLLOUT_ANNOTATION = "kvring.io/rollout"
REVISION_LABEL = "controller-revision-hash"  # the StatefulSet controller's label on each pod


@dataclass(frozen=True)
class PodView:
    """One node pod, as far as the roll needs it."""

    revision: str  # its controller-revision-hash ("" if none)
    ready: bool  # its Ready condition (the node's /readyz: registered, index rebuilt)
    deleting: bool = False  # it has a deletionTimestamp

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> PodView:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
        return cls(revision=(meta.get("labels") or {}).get(REVISION_LABEL, ""), ready=ready,
                   deleting=bool(meta.get("deletionTimestamp")))


@dataclass(frozen=True)
class NodeView:
    """One member in etcd: its state, its incarnation and the revision its record was written at."""

    state: str
    incarnation: str
    written: int


@dataclass(frozen=True)
class Step:
    """The pod the roll let go last and is waiting for (``ROLLOUT_ANNOTATION``)."""

    node: str  # node id (= pod name)
    revision: str  # the StatefulSet revision it rolls to
    started: float  # unix time it was let go
    back_revision: int = 0  # etcd revision of its record when first seen back (0: not back yet)
    back_at: float = 0.0  # unix time it was first seen back

    def to_annotation(self) -> str:
        return json.dumps({"node": self.node, "revision": self.revision, "started": round(self.started, 3),
                           "backRevision": self.back_revision, "backAt": round(self.back_at, 3)},
                          separators=(",", ":"))

    @classmethod
    def from_annotation(cls, raw: str | None) -> Step | None:
        """Read the annotation; a malformed one is ignored (the roll picks its next pod afresh)."""
        if not raw:
            return None
        try:
            data = json.loads(raw)
            return cls(node=str(data["node"]), revision=str(data["revision"]), started=float(data["started"]),
                       back_revision=int(data.get("backRevision", 0)), back_at=float(data.get("backAt", 0.0)))
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring a malformed %s annotation %r: %s", ROLLOUT_ANNOTATION, raw, exc)
            return None


@dataclass(frozen=True)
class RollInput:
    """What one status pass saw of a disk cluster's roll."""

    name: str
    replicas: int  # the StatefulSet's spec.replicas
    partition: int  # its rollingUpdate.partition
    update_revision: str | None  # its status.updateRevision, None until the controller saw the spec
    pods: Mapping[int, PodView]  # by ordinal; missing: no such pod (being replaced)
    nodes: Mapping[str, NodeView] | None  # None: etcd could not be read
    reports: Mapping[str, RepairReport] = field(default_factory=dict)
    restarting: frozenset[str] = frozenset()  # node ids with a restart marker
    replication: int = 1
    step: Step | None = None
    now: float = 0.0
    repair_timeout: float = 120.0
    scale_in: bool = False


@dataclass(frozen=True)
class RollPlan:
    """What the handlers do: markers first, then the partition, then the annotation and status."""

    status: dict[str, Any]  # status.rollout
    condition: Condition  # Progressing
    step: Step | None  # the annotation to keep (None: remove it)
    mark: str | None = None  # node to mark restarting before the partition is lowered
    unmark: tuple[str, ...] = ()  # restart markers to remove
    partition: int | None = None  # the partition to set (None: leave it)
    events: tuple[tuple[str, str, str], ...] = ()  # (type, reason, message): Normal/Warning

    @property
    def waiting_for(self) -> str:
        return self.status.get("waitingFor", "")


def held_partition(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> int:
    """The partition to apply a rendered StatefulSet with: 0 for a new one; the current one when
    the pod template does not change; every pod held (the current pod count) when it does, so that
    the controller replaces nothing and the operator rolls the pods one by one."""
    if current is None:
        return 0
    spec = current.get("spec") or {}
    partition = int(((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition") or 0)
    if contains(spec.get("template"), (desired.get("spec") or {}).get("template")):
        return partition
    return int(spec.get("replicas") or 0)


def update_revision(sts: Mapping[str, Any]) -> str | None:
    """The revision the controller rolls to, once it has seen the StatefulSet's latest spec."""
    meta, status = sts.get("metadata") or {}, sts.get("status") or {}
    if int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return None
    return status.get("updateRevision") or None


def _claims(sts: Mapping[str, Any]) -> list[tuple[str, int, str, tuple[str, ...]]]:
    out = []
    for t in (sts.get("spec") or {}).get("volumeClaimTemplates") or ():
        spec = t.get("spec") or {}
        size = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "0")
        try:
            size_bytes = parse_bytes(str(size))
        except ValueError:
            size_bytes = -1
        out.append(((t.get("metadata") or {}).get("name", ""), size_bytes, spec.get("storageClassName") or "",
                    tuple(spec.get("accessModes") or ())))
    return sorted(out)


def disk_change(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> str:
    """Why ``desired`` cannot be applied over ``current`` ("" if it can): their claim templates
    differ (spec.disk added, removed or resized, or another storage class), which a StatefulSet
    does not allow to change.  The storage class of a claim the cluster's default filled in
    counts as unchanged."""
    if current is None:
        return ""
    now, wanted = _claims(current), _claims(desired)
    if len(now) == len(wanted) and all(a[:2] == b[:2] and a[3] == b[3] and (not b[2] or a[2] == b[2])
                                       for a, b in zip(now, wanted)):
        return ""

    def describe(claims):
        return ", ".join(f"{n} {s} bytes" + (f" ({c})" if c else "") for n, s, c, _ in claims) or "no volume"
    return (f"spec.disk cannot change on an existing cluster: its nodes run with {describe(now)}, the spec asks for "
            f"{describe(wanted)}, and a StatefulSet's volume claim templates are immutable. Set spec.disk back, or "
            "delete the CacheCluster and create it again (its volumes and their chunks go with it). The nodes "
            "keep running as they are; other changes are not applied to them until then.")


def _progress(inp: RollInput, updated: int, **fields: Any) -> dict[str, Any]:
    return {"revision": inp.update_revision or "", "updated": updated, "total": inp.replicas,
            "partition": min(inp.partition, inp.replicas), **fields}


def plan_roll(inp: RollInput) -> RollPlan:
    """Decide one status pass of a disk cluster's roll (see the module docstring)."""
    rev = inp.update_revision
    if rev is None:
        return RollPlan(status=_progress(inp, 0, waitingFor="", reason="WaitingForController",
                                         message="the StatefulSet controller has not seen the latest spec yet"),
                        condition=Condition("Progressing", None, "WaitingForController"), step=inp.step)
    n = inp.replicas
    updated = [k for k in range(n) if (p := inp.pods.get(k)) is not None and p.revision == rev and not p.deleting]
    step = inp.step if inp.step is not None and inp.step.revision == rev else None
    events: list[tuple[str, str, str]] = []

    def plan(reason: str, message: str, waiting: str = "", *, condition: Condition | None = None,
             **kw: Any) -> RollPlan:
        keep = {kw.get("mark"), step.node if step is not None else None}
        unmark = tuple(sorted(m for m in inp.restarting if m not in keep and _settled_pod(inp, m)))
        status = _progress(inp, len(updated), waitingFor=waiting, reason=reason, message=message)
        if kw.get("partition") is not None:
            status["partition"] = kw["partition"]
        cond = condition or Condition("Progressing", True, reason, message)
        return RollPlan(status=status, condition=cond, unmark=unmark, events=tuple(events),
                        **{"step": step, **kw})

    # The pod let go last: wait until it is back, and (with copies) repair has settled.
    if step is not None:
        k = ordinal(inp.name, step.node)
        pod = inp.pods.get(k) if k is not None else None
        if k is None or k >= n:
            step = None  # its ordinal is gone (scaled in): nothing to wait for
        elif pod is None or pod.revision != rev or pod.deleting or not pod.ready:
            return plan("PodRestarting", f"waiting for {step.node} to come back Ready on revision {rev} "
                                         "(its node rebuilds its index from disk first)", step.node)
        elif inp.nodes is None:
            return plan("EtcdUnreachable", f"{step.node} is back; cannot read etcd to check it is active", step.node)
        elif (node := inp.nodes.get(step.node)) is None or node.state != NodeState.ACTIVE:
            state = node.state if node is not None else "missing"
            return plan("NodeNotActive", f"{step.node} is Ready but {state} in etcd", step.node)
        else:
            if step.back_revision == 0:
                step = replace(step, back_revision=node.written, back_at=inp.now)
            if inp.replication >= 2:
                unsettled = _unsettled(inp.nodes, inp.reports, step.back_revision)
                if unsettled and inp.now - step.back_at < inp.repair_timeout:
                    return plan("RepairInProgress", f"{step.node} is back; waiting for repair to settle on "
                                                    f"{', '.join(unsettled)}", step.node)
                if unsettled:
                    events.append(("Warning", "RepairTimeout",
                                   f"repair did not settle within {inp.repair_timeout:g}s of {step.node}'s return "
                                   f"(still running or retrying on {', '.join(unsettled)}); rolling on"))
            events.append(("Normal", "PodRolled", f"{step.node} is back on revision {rev} with its chunks "
                                                  f"({len(updated)} of {n} pods updated)"))
            step = None

    outdated = [k for k in range(n) if k not in updated]
    if not outdated:
        if events:
            events.append(("Normal", "RolloutComplete", f"all {n} pods run revision {rev}; none handed off its chunks"))
        return plan("Complete", f"all {n} pods run revision {rev}",
                    condition=Condition("Progressing", False, "RolloutComplete", f"all {n} pods run revision {rev}"),
                    partition=0 if inp.partition != 0 else None)
    if inp.scale_in:
        return plan("ScaleIn", "held while a scale-in drains its nodes")
    if inp.nodes is None:
        return plan("EtcdUnreachable", "cannot read etcd to mark the next node restarting")
    unready = [f"{inp.name}-{k}" for k in range(n) if (p := inp.pods.get(k)) is None or not p.ready or p.deleting]
    if unready:
        return plan("PodsNotReady", f"waiting for {', '.join(unready)} to be Ready before letting the next pod go",
                    unready[0])
    k = max(outdated)
    node = f"{inp.name}-{k}"
    step = Step(node=node, revision=rev, started=inp.now)
    events.append(("Normal", "RollingPod", f"restarting {node} into revision {rev}; it keeps its chunks on disk "
                                           f"({len(updated)} of {n} pods updated)"))
    return plan("PodRestarting", f"marked {node} restarting and let it go", node, mark=node,
                partition=min(k, inp.partition))


def _settled_pod(inp: RollInput, node_id: str) -> bool:
    """Whether ``node_id``'s restart marker may go: its pod is up and Ready (on whichever revision),
    or the StatefulSet has no such pod.  A pod on its way out keeps its marker until it is back."""
    k = ordinal(inp.name, node_id)
    if k is None or k >= inp.replicas:
        return True
    pod = inp.pods.get(k)
    return pod is not None and pod.ready and not pod.deleting


def _unsettled(nodes: Mapping[str, NodeView], reports: Mapping[str, RepairReport], since: int) -> list[str]:
    """Active nodes whose repair report does not show a finished pass, with nothing to retry, on a
    ring at least as new as etcd revision ``since`` (from the node as it runs now)."""
    out = []
    for node_id in sorted(nodes):
        node = nodes[node_id]
        if node.state != NodeState.ACTIVE:
            continue
        report = reports.get(node_id)
        if report is None or report.incarnation != node.incarnation or not report.settled(since):
            out.append(node_id)
    return out


def annotation_patch(plan: RollPlan, annotations: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata.annotations change that records ``plan.step`` (empty if none is needed)."""
    wanted = plan.step.to_annotation() if plan.step is not None else None
    return {} if annotations.get(ROLLOUT_ANNOTATION) == wanted else {ROLLOUT_ANNOTATION: wanted}
