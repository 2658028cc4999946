"""The operator's Kubernetes client: get, create and merge-patch of the kinds a CacheCluster owns.

kopf talks to the API for the CacheCluster itself; the children (StatefulSets, Services, the
ConfigMap, PodDisruptionBudgets, NetworkPolicies) go through ``KubeClient``, a thin layer over
``kubernetes_asyncio``'s ``ApiClient`` that sends and receives plain dicts, the same dicts the
render functions build.  ``apply`` is create-or-patch: it creates a missing object, leaves one
that already holds every rendered field alone, and merge-patches one that differs, so re-running
a handler is harmless.  It adopts a child only if no other controller owns it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

logger = logging.getLogger(__name__)

# The kinds the render functions produce, and their REST names.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Pod"): "pods",  # read only: the rolling update of a disk cluster watches its pods
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",  # the pool's KV-event stream (<name>-events)
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
}


class KubeError(Exception):
    """An API request failed; ``status`` is the HTTP status (0 if none came back)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class OwnedElsewhere(KubeError):
    """The child's name is taken by an object another controller owns."""


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    plural = PLURALS.get((api_version, kind))
    if plural is None:
        raise ValueError(f"{api_version} {kind} is not a kind the operator manages; known: "
                         + ", ".join(f"{v} {k}" for v, k in PLURALS))
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def contains(current: Any, desired: Any) -> bool:
    """Whether ``current`` already holds every field of ``desired`` (extra server fields allowed)."""
    if isinstance(desired, Mapping):
        return isinstance(current, Mapping) and all(k in current and contains(current[k], v)
                                                    for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(current, list) and len(current) == len(desired)
                and all(contains(c, d) for c, d in zip(current, desired)))
    return current == desired


# The spec fields an update of a StatefulSet may change; the API server refuses a change of any
# other (the selector, service name, claim templates and pod management policy are set at creation).
STATEFULSET_UPDATABLE = frozenset({"replicas", "ordinals", "template", "updateStrategy",
                                   "persistentVolumeClaimRetentionPolicy", "minReadySeconds"})


def wanted_fields(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """What ``current`` must hold to be ``desired``, as a merge patch would write it: every
    rendered field but the status (of a StatefulSet's spec, those an update may change), and the
    owner references of both."""
    wanted = {k: v for k, v in desired.items() if k != "status"}
    wanted["metadata"] = dict(desired["metadata"], ownerReferences=merge_owner_references(current, desired))
    if desired.get("kind") == "StatefulSet":
        wanted["spec"] = {k: v for k, v in desired["spec"].items() if k in STATEFULSET_UPDATABLE}
    return wanted


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether ``obj``'s controller (owner reference) is the object ``uid``."""
    owner = _controller(obj)
    return owner is not None and owner.get("uid") == uid


def _controller(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return ref
    return None


def merge_owner_references(current: Mapping[str, Any], desired: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``desired``'s owner references plus the current ones that point at other owners."""
    ours = list((desired.get("metadata") or {}).get("ownerReferences") or ())
    uids = {ref.get("uid") for ref in ours}
    others = [ref for ref in (current.get("metadata") or {}).get("ownerReferences") or ()
              if ref.get("uid") not in uids and not ref.get("controller")]
    return others + ours


async def load_configuration(kubeconfig: str | None = None) -> k8s_client.Configuration:
    """In-cluster service account if there is one, else the kubeconfig (``kubeconfig``,
    ``$KUBECONFIG`` or ``~/.kube/config``).  The path is read here, not when the library was
    imported, so tests can point ``$KUBECONFIG`` at an emulator."""
    configuration = k8s_client.Configuration()
    if kubeconfig is None:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
            return configuration
        except k8s_config.ConfigException:
            pass
    path = kubeconfig or (os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep)[0]
    try:
        await k8s_config.load_kube_config(config_file=os.path.expanduser(path), client_configuration=configuration)
    except (k8s_config.ConfigException, OSError) as exc:
        raise KubeError(f"no Kubernetes credentials: not in a cluster, and the kubeconfig {path!r} "
                        f"cannot be used ({exc}); point KUBECONFIG at a kubeconfig with a current context") from exc
    return configuration


class KubeClient:
    """Plain-dict CRUD for the kinds in ``PLURALS``; every method raises ``KubeError`` on failure."""

    def __init__(self, api: k8s_client.ApiClient, timeout: float | None = None) -> None:
        self.api = api
        self.timeout = timeout  # seconds per request (None: no limit)

    @classmethod
    async def connect(cls, kubeconfig: str | None = None, timeout: float | None = None) -> KubeClient:
        return cls(k8s_client.ApiClient(await load_configuration(kubeconfig)), timeout)

    async def close(self) -> None:
        await self.api.close()

    async def _call(self, method: str, path: str, body: Any = None,
                    content_type: str = "application/json") -> dict[str, Any]:
        try:
            return await self.api.call_api(
                path, method, header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body, response_types_map={200: "object", 201: "object"},
                auth_settings=["BearerToken"], _return_http_data_only=True, _request_timeout=self.timeout)
        except ApiException as exc:
            raise KubeError(f"{method} {path}: HTTP {exc.status} {exc.reason}: {str(exc.body)[:300]}",
                            exc.status or 0) from exc
        except OSError as exc:  # aiohttp's connection errors and timeouts are OSErrors
            if isinstance(exc, TimeoutError) and self.timeout is not None:  # past ``timeout``
                raise KubeError(f"{method} {path}: no answer within {self.timeout:g} s") from None
            raise KubeError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", object_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self._call("POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), dict(obj))

    async def patch(self, api_version: str, kind: str, namespace: str, name: str,
                    patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386): maps merge, lists are replaced, ``None`` deletes."""
        return await self._call("PATCH", object_path(api_version, kind, namespace, name), dict(patch),
                                "application/merge-patch+json")

    async def delete_owned(self, api_version: str, kind: str, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the object if it exists and its controller is ``owner_uid`` (a child the spec no
        longer wants); an object of that name that is someone else's is left alone.  Returns
        whether one was deleted."""
        current = await self.get(api_version, kind, namespace, name)
        if current is None or not controlled_by(current, owner_uid):
            return False
        try:
            await self._call("DELETE", object_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status != 404:
                raise
            return False
        return True

    async def apply(self, desired: Mapping[str, Any]) -> str:
        """Create or patch ``desired`` (with its owner references); returns what was done:
        ``created``, ``patched`` or ``unchanged``.  Raises ``OwnedElsewhere`` for a name taken
        by another controller's object."""
        api_version, kind, meta = desired["apiVersion"], desired["kind"], desired["metadata"]
        current = await self.get(api_version, kind, meta["namespace"], meta["name"])
        if current is None:
            try:
                await self.create(desired)
                return "created"
            except KubeError as exc:
                if exc.status != 409:
                    raise
                current = await self.get(api_version, kind, meta["namespace"], meta["name"])
                if current is None:
                    raise
        owner, ours = _controller(current), _controller(desired)
        if owner is not None and ours is not None and owner.get("uid") != ours.get("uid"):
            raise OwnedElsewhere(f"{kind} {meta['namespace']}/{meta['name']} exists and belongs to "
                                 f"{owner.get('kind')} {owner.get('name')}; delete or rename it")
        wanted = wanted_fields(current, desired)
        if contains(current, wanted):
            return "unchanged"
        await self.patch(api_version, kind, meta["namespace"], meta["name"], wanted)
        return "patched"
