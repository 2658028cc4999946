"""The kopf handlers of ``kvring operator``, registered on a registry passed in.

Thin by design: the render functions (``render``) say what the children look like, ``scaling``
decides replicas and drains, ``status`` turns observations into the status object, ``kube``
creates or patches children, and etcd is reached only through ``kvring.membership``.

- ``reconcile`` (create, resume, spec update): parse the spec (an invalid one gets the
  ``ConfigMismatch`` condition and a warning event and is left there: no retry loop, the cluster
  keeps its last good objects; so does a changed ``spec.disk``, which a StatefulSet cannot take,
  for the StatefulSet alone); plan replicas (a scale-in keeps the StatefulSet's size and asks
  the leaving nodes to drain); create the Secrets made once per cluster if they are missing
  (``<name>-tls`` when TLS is on, ``<name>-node-token``), never rewriting them (a rotation, which
  the status pass drives, changes them in steps: ``rotation.py``); render, adopt and
  create-or-patch every other child; delete the optional children it made that the spec no
  longer wants (NetworkPolicies turned off, the event stream turned off).
- ``observe`` (timer): once ``reconcile`` is done with the current spec, create again any child
  deleted outside the operator, patch back the rendered fields of one edited outside it, and
  delete an optional one the spec does not want (a warning event says which); read the
  StatefulSet, the members and the event stream's record in etcd (one read) and the nodes'
  ``/stats``;
  finish a scale-in once its nodes are drained or its timeout passed; with a disk tier, step
  the rolling update on (``rollout``: restart markers in etcd, the StatefulSet's partition);
  start or carry on a credentials rotation (``rotator``); write ``status``.
- ``cleanup`` (deletion, behind the operator's finalizer): delete the cluster's keys from etcd.
  Children go by owner-reference garbage collection.

``register(registry, config)`` adds no global state: tests run it on a fresh
``kopf.OperatorRegistry`` in-process, and ``main`` does the same for the real command.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import secrets
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

from kvring.common.errors import MembershipError
from kvring.common.records import PoolEventsRecord
from kvring.common.tls import CA_FILE, admin_context, credentials_pem, verifying_context
from kvring.membership.etcd import Etcd
from kvring.membership.settings import EtcdSettings

from . import render, rollout, scaling
from . import status as st
from .config import OperatorConfig
from .kube import KubeClient, KubeError, OwnedElsewhere, contains, controlled_by, wanted_fields
from .metrics import OperatorMetrics
from .rotator import Rotator
from .spec import GROUP, PLURAL, VERSION, ClusterSpec, SpecError, check_name

logger = logging.getLogger(__name__)

FINALIZER = "kvring.io/cleanup"
ANNOTATION_PREFIX = "kvring.io"
STOP_WAIT_SECONDS = 2.0  # how long the operator's stop waits for a status pass to unwind


def parse(name: str, spec: Mapping[str, Any]) -> ClusterSpec:
    """The validated spec; raises ``SpecError`` for a spec (or name) that cannot work."""
    check_name(name)
    return ClusterSpec.from_dict(dict(spec))


def etcd_target(name: str, namespace: str, spec: ClusterSpec | None,
                status: Mapping[str, Any] | None) -> tuple[tuple[str, ...], str] | None:
    """(etcd endpoints, cluster key) of a CacheCluster: from its spec, or, for a spec that no
    longer parses, from the connector settings its status last published."""
    if spec is not None:
        return tuple(render.etcd_endpoints(name, namespace, spec)), render.cluster_key(name, namespace)
    try:
        extra = json.loads((status or {}).get("connector") or "")["kv_connector_extra_config"]
        return tuple(extra["etcd"].split(",")), extra["cluster"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def once_secrets(name: str, namespace: str, spec: ClusterSpec) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """The Secrets made once per cluster, each with the maker of its only version (fresh random
    content): ``<name>-tls`` when TLS is on, ``<name>-node-token``."""
    made: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if spec.tls:
        made.append((render.tls_secret(name),
                     lambda: render.render_tls_secret(name, namespace, credentials_pem(f"{namespace}/{name}"))))
    made.append((render.node_token_secret(name),
                 lambda: render.render_node_token_secret(name, namespace, secrets.token_hex(32))))
    return made


def held(cs: ClusterSpec, current: Mapping[str, Any] | None, rendered: dict[str, Any]) -> dict[str, Any]:
    """``rendered``, the node StatefulSet, as it is applied over ``current``: with a disk tier its
    rolling update's partition holds every pod when the pod template changes, so the controller
    replaces none and the status pass rolls them one at a time (``rollout``)."""
    if cs.disk is not None:
        rendered["spec"]["updateStrategy"] = render.update_strategy(cs, rollout.held_partition(current, rendered))
    return rendered


def reconciled(meta: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether ``reconcile`` has finished for the object's current spec and it is not being
    deleted: until then a child may be missing only because it is still to be made (or to go)."""
    generation = meta.get("generation")
    return (meta.get("deletionTimestamp") is None and generation is not None
            and status.get("observedGeneration") == generation)


class CacheClusterHandlers:
    """The handlers and what they share: the Kubernetes client, an HTTP session for node stats,
    and one ``Etcd`` connection per (endpoints, cluster)."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.kube: KubeClient | None = None
        self.rotator: Rotator | None = None
        self.http: aiohttp.ClientSession | None = None
        self._etcd: dict[tuple[tuple[str, ...], str], Etcd] = {}
        self.metrics = OperatorMetrics()
        # Children a status pass put back whose server copy still differs from the rendering
        # (the API server normalizes a field it renders otherwise): (kind, namespace, name) ->
        # that rendering, left alone until the rendering changes (``_put_back``).
        self._unsettled: dict[tuple[str, str, str], str] = {}
        # Status passes in flight, and whether ``shutdown`` has begun: it cancels the passes and
        # waits for them before it closes the clients they use.
        self._passes: set[asyncio.Future] = set()
        self._stopping = False
        # (namespace, name) -> (the CA of its ``<name>-tls`` Secret, a context verifying it): what
        # reads the nodes' ``/stats`` over TLS (a rotation changes the Secret, and a cluster made
        # again under its name has a new one).
        self._node_ca: dict[tuple[str, str], tuple[bytes, ssl.SSLContext]] = {}

    # ---- operator lifecycle ------------------------------------------------------------------

    async def startup(self, settings: kopf.OperatorSettings, **_: Any) -> None:
        # kopf's bookkeeping in annotations under our own prefix; the status schema is ours alone.
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
        # A status pass in flight when the operator stops unwinds on cancellation (``observe``):
        # wait that long for it rather than kopf's default of ten loop turns.
        settings.background.instant_exit_timeout = STOP_WAIT_SECONDS
        self.kube = await KubeClient.connect(timeout=self.config.api_timeout)
        self.rotator = Rotator(self.kube)
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.stats_timeout))

    async def shutdown(self, **_: Any) -> None:
        # kopf may start a timer's pass while it stops, and runs this beside it: a pass left
        # running would send its requests over the clients closed below.
        self._stopping = True
        for work in self._passes:
            work.cancel()
        if self._passes:
            await asyncio.wait(self._passes, timeout=STOP_WAIT_SECONDS)
        for etcd in self._etcd.values():
            await etcd.close()
        self._etcd.clear()
        if self.http is not None:
            await self.http.close()
        if self.kube is not None:
            await self.kube.close()

    @staticmethod
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        """In a pod: its service account; elsewhere: the current context of ``$KUBECONFIG``."""
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    def etcd(self, target: tuple[tuple[str, ...], str]) -> Etcd:
        if target not in self._etcd:
            endpoints, cluster = target
            self._etcd[target] = Etcd(EtcdSettings.parse(list(endpoints), cluster=cluster,
                                                         timeout=self.config.etcd_timeout))
        return self._etcd[target]

    async def forget_etcd(self, target: tuple[tuple[str, ...], str]) -> None:
        etcd = self._etcd.pop(target, None)
        if etcd is not None:
            await etcd.close()

    # ---- create / resume / update --------------------------------------------------------------

    async def reconcile(self, name: str, namespace: str, spec: Mapping[str, Any], meta: Mapping[str, Any],
                        status: Mapping[str, Any], body: kopf.Body, patch: kopf.Patch,
                        logger: logging.Logger, **_: Any) -> None:
        generation = int(meta.get("generation") or 0)
        try:
            cs = parse(name, spec)
        except SpecError as exc:
            logger.error("%s", exc)
            kopf.warn(body, reason="InvalidSpec", message=str(exc))
            patch.status.update(st.invalid_status(status, generation, str(exc), st.now_iso()))
            return  # nothing to retry until the spec changes; the running cluster is left alone

        assert self.kube is not None
        etcd = self.etcd(etcd_target(name, namespace, cs, None))
        sts = await self._get_statefulset(name, namespace)
        current = int(sts["spec"].get("replicas", 0)) if sts else None
        pending = scaling.ScaleIn.from_annotation(meta.get("annotations", {}).get(scaling.SCALE_IN_ANNOTATION))
        plan = scaling.plan_replicas(name, cs.replicas, current, pending, time.time())

        if sts is not None:
            await self._withdraw_stale_drains(etcd, name, plan, logger)
        if plan.request_drains:
            try:
                for node_id in plan.request_drains:
                    await etcd.request_drain(node_id)
            except MembershipError as exc:
                raise kopf.TemporaryError(f"cannot ask {', '.join(plan.request_drains)} to drain: {exc}",
                                          delay=self.config.retry_delay) from exc
            if plan.scale_in != pending:
                kopf.info(body, reason="ScaleIn", message=scaling.describe(plan.scale_in))

        results = []
        children = render.render_children(name, namespace, cs, replicas=plan.replicas,
                                          operator_namespace=self.config.own_namespace)
        problem = rollout.disk_change(sts, children[-1])
        if problem:  # the StatefulSet cannot take it: keep it as it runs, say so
            logger.error("%s", problem)
            kopf.warn(body, reason="DiskImmutable", message=problem)
            children = children[:-1]
        else:
            held(cs, sts, children[-1])
        for secret_name, make in once_secrets(name, namespace, cs):
            results.append(("Secret", secret_name, await self._ensure_secret(namespace, body, secret_name, make)))
        for child in children:
            kopf.adopt(child, owner=body)
            try:
                results.append((child["kind"], child["metadata"]["name"], await self.kube.apply(child)))
            except OwnedElsewhere as exc:
                kopf.warn(body, reason="NameTaken", message=str(exc))
                raise kopf.TemporaryError(str(exc), delay=60) from exc
            except KubeError as exc:
                raise kopf.TemporaryError(str(exc), delay=self.config.retry_delay) from exc
        try:
            results += [(kind, obj, "deleted") for kind, obj in await self._delete_unwanted(name, namespace, children, body)]
        except KubeError as exc:
            raise kopf.TemporaryError(str(exc), delay=self.config.retry_delay) from exc
        changed = [f"{kind} {obj} {what}" for kind, obj, what in results if what != "unchanged"]
        if changed:
            logger.info("children: %s", "; ".join(changed))

        annotations = scaling.annotations_patch(plan, meta.get("annotations", {}))
        if annotations:
            patch.metadata.annotations.update(annotations)
        patch.status.update({
            "observedGeneration": generation,
            "selector": render.selector(name),
            "connector": render.connector_json(name, namespace, cs),
            "conditions": st.merge_conditions(status.get("conditions"),
                                              [st.Condition("ConfigMismatch", True, "DiskImmutable", problem)
                                               if problem else st.Condition("ConfigMismatch", False, "SpecValid")],
                                              generation, st.now_iso()),
        })

    async def _delete_unwanted(self, name: str, namespace: str, wanted: list[dict[str, Any]],
                               body: kopf.Body) -> list[tuple[str, str]]:
        """Delete the children a spec may or may not want (NetworkPolicies turned off or for an
        etcd no longer managed, the event stream turned off) that ``wanted`` lacks, if they are
        the CacheCluster's own; (kind, name) of each one deleted."""
        assert self.kube is not None
        kept = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in wanted}
        deleted = []
        for api_version, kind, obj in render.optional_children(name):
            if ((api_version, kind, obj) not in kept
                    and await self.kube.delete_owned(api_version, kind, namespace, obj, body.metadata.uid)):
                deleted.append((kind, obj))
        return deleted

    async def _ensure_secret(self, namespace: str, body: kopf.Body, secret_name: str,
                             make: Callable[[], dict[str, Any]]) -> str:
        """Create the Secret ``secret_name`` from ``make()`` (fresh random content) if it does not
        exist; never rewrite it.  For ``<name>-tls``, new keys at once would cut the nodes off from
        the clients that have not taken them yet; for ``<name>-node-token``, a new token at once
        would lock the admin API and the preStop hooks out of the nodes that have not.  Only a
        rotation changes them, in steps each holder takes before the next (``rotator.py``)."""
        assert self.kube is not None
        try:
            if await self.kube.get("v1", "Secret", namespace, secret_name) is not None:
                return "unchanged"
        except KubeError as exc:
            raise kopf.TemporaryError(str(exc), delay=self.config.retry_delay) from exc
        return "created" if await self._create(body, make()) else "unchanged"

    async def _create(self, body: kopf.Body, obj: dict[str, Any]) -> bool:
        """Create ``obj``, owned by the CacheCluster; False if an object of its name was made
        meanwhile (by another reconcile or pass: that one stands).  Other failures raise
        ``kopf.TemporaryError``."""
        assert self.kube is not None
        kopf.adopt(obj, owner=body)
        try:
            await self.kube.create(obj)
            return True
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise kopf.TemporaryError(str(exc), delay=self.config.retry_delay) from exc

    async def _get_statefulset(self, name: str, namespace: str) -> dict[str, Any] | None:
        assert self.kube is not None
        try:
            return await self.kube.get("apps/v1", "StatefulSet", namespace, name)
        except KubeError as exc:
            raise kopf.TemporaryError(str(exc), delay=self.config.retry_delay) from exc

    async def _withdraw_stale_drains(self, etcd: Etcd, name: str, plan: scaling.ReplicaPlan,
                                     logger: logging.Logger) -> None:
        """Withdraw the drain requests of nodes that stay, before their pods are kept or added
        (a scale-out, or a smaller scale-in, that reverses part of a scale-in in progress)."""
        try:
            stale = scaling.stale_drains(name, await etcd.drain_requests(), plan.staying)
            for node_id in stale:
                await etcd.cancel_drain(node_id)
        except MembershipError as exc:
            if plan.scale_in is not None:
                raise kopf.TemporaryError(f"cannot read drain requests: {exc}", delay=self.config.retry_delay) from exc
            logger.warning("cannot check for drain requests to withdraw (etcd: %s)", exc)
            return
        if stale:
            logger.info("withdrew the drain requests of %s: they stay", ", ".join(stale))

    # ---- status timer --------------------------------------------------------------------------

    async def observe(self, name: str, namespace: str, spec: Mapping[str, Any], meta: Mapping[str, Any],
                      status: Mapping[str, Any], body: kopf.Body, patch: kopf.Patch,
                      logger: logging.Logger, stopped: kopf.DaemonStopped, **_: Any) -> None:
        """One status pass, dropped if the operator stops before it ends.

        kopf never cancels a timer: one still running when the operator stops (a pass waiting
        on an unreachable etcd or node) is left orphaned, outlives ``shutdown`` and may write
        status afterwards over a client kopf has already closed.  So the pass runs beside the
        stop flag; a stop cancels it and clears ``patch``, and nothing of it is written.  So does
        ``shutdown``, which kopf may run before it sets the flag; a pass that would start after
        ``shutdown`` began does not start."""
        if self._stopping:
            patch.clear()
            return
        work = asyncio.ensure_future(self._observe(name, namespace, spec, meta, status, body, patch, logger))
        self._passes.add(work)
        work.add_done_callback(self._passes.discard)
        stop = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait((work, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not work.done():
                work.cancel()
                await asyncio.wait((work,))
        if work.cancelled():
            patch.clear()
            logger.info("the operator is stopping: this status pass is dropped, nothing of it written")
            return
        work.result()

    async def _observe(self, name: str, namespace: str, spec: Mapping[str, Any], meta: Mapping[str, Any],
                       status: Mapping[str, Any], body: kopf.Body, patch: kopf.Patch,
                       logger: logging.Logger) -> None:
        generation = int(meta.get("generation") or 0)
        try:
            cs = parse(name, spec)
        except SpecError as exc:
            new = st.invalid_status(status, generation, str(exc), st.now_iso())
            self.metrics.observe(namespace, name, None, {**status, **new})
            update = st.changed_fields(status, new)
            if update:
                patch.status.update(update)
            return

        assert self.kube is not None
        pending = scaling.ScaleIn.from_annotation(meta.get("annotations", {}).get(scaling.SCALE_IN_ANNOTATION))
        sts = await self._converge_children(name, namespace, cs, body, generation, pending is not None, logger) \
            if reconciled(meta, status) else None
        if sts is None:  # not reconciled yet, or made again just now
            sts = await self._get_statefulset(name, namespace)
        target = etcd_target(name, namespace, cs, None)
        members, revision, pool_events, etcd_error = await self._members(self.etcd(target))
        if pending is not None and sts is not None and members is not None:
            sts, pending = await self._advance_scale_in(name, namespace, cs, sts, pending, members, body, patch, logger)

        problem = rollout.disk_change(sts, render.render_statefulset(name, namespace, cs))
        roll = None
        if cs.disk is not None and sts is not None and not problem:
            roll = await self._advance_roll(name, namespace, cs, sts, pending is not None, meta, body, patch, logger)

        stats = await self._stats(name, namespace, cs, members)
        assert self.rotator is not None
        rotating = await self.rotator.advance(name, namespace, cs, meta.get("annotations", {}), body, patch, members,
                                              stats)
        obs = st.Observation(
            name=name, generation=generation, desired=cs.replicas, statefulset=sts, members=members,
            revision=revision, etcd_error=etcd_error, pool_events=pool_events, stats=stats,
            rotation=rotating.as_dict(st.iso_at) if rotating is not None else None,
            scale_in=pending.view if pending is not None else None, spec_problem=problem,
            rollout=roll.status if roll is not None else None, progressing=roll.condition if roll is not None else None)
        new = st.build_status(obs, status, selector=render.selector(name),
                              connector=render.connector_json(name, namespace, cs), now=st.now_iso())
        self.metrics.observe(namespace, name, cs.replicas, new)
        update = st.changed_fields(status, new, whole=True)
        if update:
            patch.status.update(update)

    async def _converge_children(self, name: str, namespace: str, cs: ClusterSpec, body: kopf.Body,
                                 generation: int, scaling_in: bool, logger: logging.Logger) -> dict[str, Any] | None:
        """Put back what was changed outside the operator (by hand, or by a tool): create the
        children the spec wants that are gone, as ``reconcile`` would make them anew; patch back
        the fields it renders of the ones it owns that were edited (``_put_back``); delete the
        optional ones it no longer wants.  A warning event says what it did.  Returns the node
        StatefulSet as its GET found it or the patch back left it (the pass reads its status off
        it), or None if it was missing or the API did not answer.

        A spec update's ``reconcile`` may be running beside this pass, which read the spec
        before: a create cannot undo its patches (whichever creates first stands, the other
        gets a conflict and the update's patch follows), and a patch back is sent only while the
        CacheCluster is still at the generation this pass read, and only over the version of
        the child this pass read (else a conflict, and the next pass looks again).  A pass that
        read the spec before such an update may recreate an optional child the update has just
        deleted; the next pass, reading the new spec, deletes it again.  A child of that name
        that another owner holds is neither missing nor patched (``reconcile`` reports it as
        ``NameTaken``).  The node StatefulSet is put back as ``reconcile`` applies it: with its
        rolling partition held (``held``) and, while a scale-in is in progress (``scaling_in``), its
        replicas as they are (the scale-in shrinks it once its nodes have drained); not while
        ``spec.disk`` asks for claims it cannot take (``rollout.disk_change``).  A recreated
        ``<name>-tls`` or ``<name>-node-token`` holds new content (pods started before keep what
        they read then until they restart); an edited one is left as it is (``_ensure_secret``).
        One GET per child and pass."""
        assert self.kube is not None
        wanted = render.render_children(name, namespace, cs, operator_namespace=self.config.own_namespace)
        made_once = once_secrets(name, namespace, cs)
        recreated: list[str] = []
        corrected: list[str] = []
        deleted: list[tuple[str, str]] = []
        sts = None
        try:
            found = await asyncio.gather(
                *(self.kube.get("v1", "Secret", namespace, secret_name) for secret_name, _ in made_once),
                *(self.kube.get(c["apiVersion"], c["kind"], namespace, c["metadata"]["name"]) for c in wanted))
            for (secret_name, make), obj in zip(made_once, found):
                if obj is None and await self._create(body, make()):
                    recreated.append(f"Secret {secret_name}")
            for child, obj in zip(wanted, found[len(made_once):]):
                what = f"{child['kind']} {child['metadata']['name']}"
                node_sts = child["kind"] == "StatefulSet" and child["metadata"]["name"] == name
                if node_sts:
                    sts = obj
                if obj is None:
                    if await self._create(body, child):
                        recreated.append(what)
                    continue
                if node_sts:
                    if rollout.disk_change(obj, child):
                        continue
                    if scaling_in:
                        child["spec"]["replicas"] = obj["spec"].get("replicas")
                    held(cs, obj, child)
                patched = await self._put_back(body, generation, child, obj, logger)
                if patched is not None:
                    corrected.append(what)
                    if node_sts:
                        sts = patched
            deleted = await self._delete_unwanted(name, namespace, wanted, body)
        except (KubeError, kopf.TemporaryError) as exc:  # the API did not answer: the next pass goes on
            logger.warning("cannot check or restore the children now: %s", exc)
        message = "; ".join(
            [*([f"recreated {', '.join(recreated)} (deleted outside the operator)"] if recreated else []),
             *([f"put back {', '.join(corrected)} (changed outside the operator)"] if corrected else []),
             *([f"deleted {', '.join(f'{k} {o}' for k, o in deleted)} (not in the spec)"] if deleted else [])])
        if message:
            logger.warning("%s", message)
            kopf.warn(body, reason="ChildrenRestored", message=message)
            self.metrics.children_restored(namespace, name, len(recreated) + len(corrected) + len(deleted))
        return sts

    async def _put_back(self, body: kopf.Body, generation: int, child: dict[str, Any], current: dict[str, Any],
                        logger: logging.Logger) -> dict[str, Any] | None:
        """Patch ``current`` (this pass's GET of an existing child) back to the fields ``child``
        renders, if it is the CacheCluster's own and differs; the server's answer to the patch,
        or None if none was sent or it was refused.  The patch carries ``current``'s
        resourceVersion, so a change made since (``reconcile`` applying a newer spec) wins: a
        conflict, and nothing is patched.  If the server's copy still differs after the patch,
        the server normalizes what was rendered (a quantity, a default): that child is left alone
        until its rendering changes, rather than patched every pass."""
        assert self.kube is not None
        meta = child["metadata"]
        if not controlled_by(current, body.metadata.uid):
            return None
        kopf.adopt(child, owner=body)
        wanted = wanted_fields(current, child)
        if contains(current, wanted):
            return None
        key = (child["kind"], meta["namespace"], meta["name"])
        rendering = json.dumps(wanted, sort_keys=True)
        if self._unsettled.get(key) == rendering:
            return None
        if int(body.metadata.get("generation") or 0) != generation:  # a newer spec is being applied
            return None
        precondition = {**wanted, "metadata": {**wanted["metadata"],
                                               "resourceVersion": current["metadata"]["resourceVersion"]}}
        try:
            patched = await self.kube.patch(child["apiVersion"], child["kind"], meta["namespace"], meta["name"],
                                            precondition)
        except KubeError as exc:
            if exc.status in (404, 409):  # deleted or changed since this pass read it: the next pass looks
                return None
            raise
        if not contains(patched, wanted):
            self._unsettled[key] = rendering
            logger.warning("%s %s: the API server keeps it otherwise than rendered after a patch (it normalizes a "
                           "field); not patched again until its rendering changes", child["kind"], meta["name"])
        return patched

    async def _members(self, etcd: Etcd) -> tuple[dict[str, st.Member] | None, int, PoolEventsRecord | None, str]:
        """(members, revision, the event stream's record, error) from one read of the cluster's
        keys; members None and the error's text when etcd cannot be read."""
        try:
            snap = await etcd.snapshot()
        except MembershipError as exc:
            return None, 0, None, str(exc)
        members = {n: st.Member(node_id=n, state=r.state, capacity=r.capacity, admin_addr=r.admin_addr)
                   for n, r in snap.members.items()}
        return members, snap.revision, snap.pool_events, ""

    async def _advance_scale_in(self, name: str, namespace: str, cs: ClusterSpec, sts: dict[str, Any],
                                pending: scaling.ScaleIn, members: Mapping[str, st.Member], body: kopf.Body,
                                patch: kopf.Patch, logger: logging.Logger) -> tuple[dict[str, Any], scaling.ScaleIn | None]:
        """Shrink the StatefulSet once the leaving nodes are drained (or the timeout passed)."""
        assert self.kube is not None
        progress = scaling.drain_progress(pending, members, time.time(), cs.drain_timeout_seconds)
        if not progress.done:
            return sts, pending
        if int(sts["spec"].get("replicas", 0)) > pending.target:
            try:
                sts = await self.kube.patch("apps/v1", "StatefulSet", namespace, name,
                                            {"spec": {"replicas": pending.target}})
            except KubeError as exc:
                logger.warning("cannot shrink the StatefulSet yet: %s", exc)
                return sts, pending
        message = scaling.describe(pending, progress)
        logger.info("%s", message)
        if progress.timed_out:
            kopf.warn(body, reason="DrainTimeout", message=message)
        else:
            kopf.info(body, reason="ScaledIn", message=message)
        patch.metadata.annotations[scaling.SCALE_IN_ANNOTATION] = None
        return sts, None

    async def _advance_roll(self, name: str, namespace: str, cs: ClusterSpec, sts: dict[str, Any], scale_in: bool,
                            meta: Mapping[str, Any], body: kopf.Body, patch: kopf.Patch,
                            logger: logging.Logger) -> rollout.RollPlan:
        """One step of a disk cluster's rolling update (``rollout``): gather, plan, carry out."""
        assert self.kube is not None
        etcd = self.etcd(etcd_target(name, namespace, cs, None))
        try:
            view = await etcd.restart_view()
        except MembershipError as exc:
            logger.warning("rolling update: cannot read etcd: %s", exc)
            view = None
        replicas = int(sts["spec"].get("replicas") or 0)
        pods: dict[int, rollout.PodView] = {}
        for k in range(replicas):
            try:
                pod = await self.kube.get("v1", "Pod", namespace, render.node_id(name, k))
            except KubeError as exc:
                raise kopf.TemporaryError(f"cannot read the node pods: {exc}", delay=self.config.retry_delay) from exc
            if pod is not None:
                pods[k] = rollout.PodView.of(pod)
        annotations = meta.get("annotations", {})
        strategy = sts["spec"].get("updateStrategy") or {}
        inp = rollout.RollInput(
            name=name, replicas=replicas,
            partition=int((strategy.get("rollingUpdate") or {}).get("partition") or 0),
            update_revision=rollout.update_revision(sts), pods=pods,
            nodes=None if view is None else {n: rollout.NodeView(r.state, r.incarnation, view.written.get(n, 0))
                                             for n, r in view.members.items()},
            reports=view.repair if view is not None else {},
            restarting=frozenset(view.restarting) if view is not None else frozenset(),
            replication=cs.replication, step=rollout.Step.from_annotation(annotations.get(rollout.ROLLOUT_ANNOTATION)),
            now=time.time(), repair_timeout=float(cs.drain_timeout_seconds), scale_in=scale_in)
        plan = rollout.plan_roll(inp)

        for node_id in plan.unmark:
            try:
                await etcd.cancel_restart(node_id)
                logger.info("rolling update: removed the restart marker of %s", node_id)
            except MembershipError as exc:
                logger.warning("rolling update: cannot remove the restart marker of %s yet: %s", node_id, exc)
        try:
            if plan.mark:  # the marker first: the pod must find it when its preStop hook runs
                await etcd.request_restart(plan.mark, inp.update_revision or "")
            if plan.partition is not None:
                await self.kube.patch("apps/v1", "StatefulSet", namespace, name, {
                    "metadata": {"resourceVersion": sts["metadata"].get("resourceVersion")},
                    "spec": {"updateStrategy": {"rollingUpdate": {"partition": plan.partition}}}})
        except (MembershipError, KubeError) as exc:
            logger.warning("rolling update: cannot let %s go yet: %s", plan.mark or "the partition", exc)
            return rollout.RollPlan(status={**plan.status, "reason": "Retrying", "message": str(exc)[:300]},
                                    condition=plan.condition, step=inp.step)
        for kind, reason, message in plan.events:
            logger.info("rolling update: %s", message)
            (kopf.warn if kind == "Warning" else kopf.info)(body, reason=reason, message=message)
        patch.metadata.annotations.update(rollout.annotation_patch(plan, annotations))
        return plan

    async def _stats(self, name: str, namespace: str, cs: ClusterSpec,
                     members: Mapping[str, st.Member] | None) -> dict[str, dict[str, Any]]:
        """Each registered node's ``/stats`` from its admin address (over TLS, checked against the
        cluster's CA, for a TLS cluster's nodes); unreachable ones are left out."""
        if not members or self.http is None:
            return {}
        http = self.http
        tls = await self._cluster_ca(name, namespace) if cs.tls else None

        async def fetch(member: st.Member) -> tuple[str, Any]:
            url = member.admin_addr if "://" in member.admin_addr else f"http://{member.admin_addr}"
            try:
                context = admin_context(url, tls)
                async with http.get(f"{url.rstrip('/')}/stats", ssl=context if context is not None else True) as resp:
                    return member.node_id, (await resp.json() if resp.status == 200 else None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # CredentialsError included
                logger.debug("no /stats from %s at %s: %s", member.node_id, url, exc)
                return member.node_id, None

        got = await asyncio.gather(*(fetch(m) for m in members.values() if m.admin_addr))
        return {node_id: stats for node_id, stats in got if isinstance(stats, dict)}

    async def _cluster_ca(self, name: str, namespace: str) -> ssl.SSLContext | None:
        """A context that verifies the cluster's nodes, from its ``<name>-tls`` Secret's CA; None
        (its nodes' stats are left out) while the Secret cannot be read."""
        assert self.kube is not None
        try:
            secret = await self.kube.get("v1", "Secret", namespace, render.tls_secret(name))
            ca = base64.b64decode((secret or {}).get("data", {}).get(CA_FILE, ""), validate=True)
        except (KubeError, binascii.Error) as exc:
            logger.warning("cannot read the CA of %s/%s for its nodes' /stats: %s", namespace, name, exc)
            return None
        known = self._node_ca.get((namespace, name))
        if known is not None and known[0] == ca:
            return known[1]
        try:
            context = verifying_context(ca)
        except (ssl.SSLError, ValueError) as exc:  # no Secret yet (empty), or not a certificate
            logger.warning("no usable CA in %s/%s for its nodes' /stats: %s", namespace, render.tls_secret(name), exc)
            return None
        self._node_ca[(namespace, name)] = (ca, context)
        return context

    # ---- deletion ------------------------------------------------------------------------------

    async def cleanup(self, name: str, namespace: str, spec: Mapping[str, Any], status: Mapping[str, Any],
                      body: kopf.Body, retry: int, logger: logging.Logger, **_: Any) -> None:
        self.metrics.forget(namespace, name)
        self._node_ca.pop((namespace, name), None)
        try:
            cs: ClusterSpec | None = parse(name, spec)
        except SpecError:
            cs = None
        target = etcd_target(name, namespace, cs, status)
        if target is None:
            logger.info("no valid spec was ever applied: nothing of this cluster is in etcd")
            return
        try:
            deleted = await self.etcd(target).delete_cluster()
        except MembershipError as exc:
            if retry < self.config.cleanup_retries:
                raise kopf.TemporaryError(f"cannot remove the cluster's keys from etcd yet: {exc}",
                                          delay=self.config.retry_delay) from exc
            kopf.warn(body, reason="CleanupSkipped",
                      message=f"gave up removing the keys of cluster {target[1]!r} from etcd after "
                              f"{retry} tries ({exc}); remove the prefix /kvring/{target[1]}/ by hand")
            return
        finally:
            await self.forget_etcd(target)
        logger.info("removed %d keys of cluster %r from etcd", deleted, target[1])


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> CacheClusterHandlers:
    """Register every handler of the operator on ``registry``; returns the handler object."""
    h = CacheClusterHandlers(config)
    resource = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)
    kopf.on.login(registry=registry)(h.login)
    kopf.on.startup(registry=registry)(h.startup)
    kopf.on.cleanup(registry=registry)(h.shutdown)
    kopf.on.create(**resource, id="reconcile", backoff=config.retry_delay)(h.reconcile)
    kopf.on.resume(**resource, id="reconcile", backoff=config.retry_delay)(h.reconcile)
    kopf.on.update(**resource, id="reconcile", field="spec", backoff=config.retry_delay)(h.reconcile)
    kopf.timer(**resource, id="observe", interval=config.status_interval)(h.observe)
    kopf.on.delete(**resource, id="cleanup", backoff=config.retry_delay)(h.cleanup)
    return h
