"""A Kubernetes API emulator the real kopf operator runs against: kmock 0.8 plus a small shim.

No Kubernetes API server can run on the CI machines, so the operator tests run kopf against
kmock's ``KubernetesEmulator`` (an in-memory object store behind the Kubernetes REST paths, by
kopf's author).  Unpatched, kopf does not work against it; ``KopfEmulator`` fixes exactly this:

1. objects get ``metadata.resourceVersion`` (one counter for the whole server, as etcd's
   revision), ``uid``, ``creationTimestamp`` and ``generation`` (bumped when anything but
   metadata and status changes), and names from ``generateName`` (kopf's events use it);
2. a failed JSON-patch ``test`` op (kopf's optimistic finalizer patch) answers 422, not 500;
3. a watch with ``?resourceVersion=N`` replays only the events after N (kmock replays every
   object as ADDED and ignores it, so kopf patched with a stale version and waited forever);
4. a watch subscribes before it replays, under the same lock as writes, so nothing is lost
   between the two;
5. ``/api/v1`` discovery says ``groupVersion: v1`` (kmock says ``/v1``);
6. list responses carry ``kind``, ``apiVersion`` and the current ``resourceVersion``;
7. ``/api/v1/namespaces[/<name>]`` is the Namespace resource (kmock's path parser takes it for a
   namespace prefix with no resource and answers 500; kopf lists namespaces when it serves
   ``--namespace`` patterns).  This one is a patch of kmock's module function, applied on import.

It also isolates the ``status`` subresource (a PATCH of ``.../status`` changes only ``status``;
a PATCH of the object leaves ``status`` alone), as the real API server does for kinds that
have one, so the operator is held to writing status the way a real cluster requires.

Not emulated, and tests that need them create the effect themselves and say so: owner-reference
garbage collection, label/field selectors, schema validation and defaults, server-side apply,
the StatefulSet controller (nothing sets a StatefulSet's ``status`` but the test).

Tests can also hold requests (``Hold``): a matching request waits unanswered until the test
releases it, as a hung API server would, so a test can stop the operator while a call is in flight.
They can count the requests that name one object (``requests``), and have the server keep a field
otherwise than written (``normalize``), as a real one does with a quantity it writes canonically.

``EmulatorThread`` runs the emulator on a loopback port in a thread of its own (kopf's
``KopfRunner`` runs the operator in another), writes a kubeconfig for it, and gives tests a small
synchronous JSON client, ``KubeAPI``.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import gzip
import importlib.resources
import json
import secrets
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import enums, parsing, rendering  # kmock 0.8 exports none of these

_CREATE, _UPDATE, _DELETE = enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE


_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock's path parser, except that ``/api/v1/namespaces[/<name>[/status]]`` is the Namespace kind."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (len(parts) <= 4 or parts[4:] in (["status"], ["finalize"])):
        return parsing.ParsedPath("", "v1", "namespaces", None, *(parts[3:] + [None, None])[:2])
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, ``None`` deletes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _essence(obj: dict) -> dict:
    """What a change of bumps ``metadata.generation``: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define
class Hold:
    """Requests for which ``match(method, path)`` holds wait unanswered until ``release()``;
    ``caught`` is set once the first one arrives.  Set from the test's thread, waited on in
    the emulator's."""

    match: Callable[[str, str], bool]
    caught: threading.Event = attrs.field(factory=threading.Event, init=False)
    _released: threading.Event = attrs.field(factory=threading.Event, init=False)

    def release(self) -> None:
        self._released.set()

    async def wait(self) -> None:
        self.caught.set()
        while not self._released.is_set():
            await asyncio.sleep(0.02)


@attrs.define(kw_only=True)
class KopfEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the fixes kopf needs (see the module docstring)."""

    _revision: int = attrs.field(default=0, init=False)
    _journal: dict = attrs.field(factory=lambda: collections.defaultdict(list), init=False)
    holds: list[Hold] = attrs.field(factory=list, init=False)
    # Requests naming one object, by (method, path): what the operator asked of it.
    requests: collections.Counter = attrs.field(factory=collections.Counter, init=False)
    # A server that keeps a field otherwise than written (as an API server normalizes a quantity):
    # each object a create or an update stores passes through this.
    normalize: Callable[[dict], dict] | None = attrs.field(default=None, init=False)

    # ---- writes ------------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        for hold in list(self.holds):
            if hold.match(request.method.value, request.url.path):
                await hold.wait()
        if request.name:
            self.requests[request.method.value, request.url.path] += 1
        writes = request.action == _CREATE or (request.action in (_UPDATE, _DELETE) and request.name)
        if request.resource is None or not writes:
            # Reads, discovery and anything else: kmock's own dispatch, minus its write logic.
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        async with self._lock:
            if request.action == _CREATE:
                status, body = await self._create(request)
            elif request.action == _UPDATE:
                status, body = await self._update(request)
            else:
                status, body = await self._delete(request)
        return aiohttp.web.json_response(body, status=status)

    def _info(self, resource) -> kmock.ResourceInfo | None:
        return self.resources[resource] if resource in self.resources else None

    async def _publish(self, resource, event_type: str, obj: dict) -> None:
        """Record an event in the resource's journal (for watch resumption) and stream it."""
        event = {"type": event_type, "object": copy.deepcopy(obj)}
        self._journal[resource].append((self._revision, event))
        await self._buses[resource].put(event)

    def _bump(self, obj: dict) -> None:
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)

    async def _create(self, request: rendering.Request) -> tuple[int, dict]:
        obj = copy.deepcopy(request.data) if isinstance(request.data, dict) else None
        if obj is None:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="the body is not a JSON object")
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if not meta.get("name"):
            raise kmock.KubernetesError(status=422, reason="Invalid", message="metadata.name: Required value")
        namespace = request.namespace or meta.get("namespace")
        if namespace:
            meta["namespace"] = namespace
        key = (request.resource, namespace, meta["name"])
        if key in self.objects and not self.objects[key].deleted:
            raise kmock.KubernetesError(status=409, reason="AlreadyExists",
                                        message=f"{request.resource.plural} {meta['name']!r} already exists")
        info = self._info(request.resource)
        if info is not None and info.kind and "kind" not in obj:
            group, version = request.resource.group, request.resource.version
            obj["apiVersion"] = f"{group}/{version}" if group else version
            obj["kind"] = info.kind
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        meta.pop("deletionTimestamp", None)
        if self.normalize is not None:
            obj = self.normalize(obj)
        self._bump(obj)
        if key in self.objects:
            self.objects[key].create(obj)  # a new life after a soft deletion
        else:
            self.objects[key] = obj
        await self._publish(request.resource, "ADDED", obj)
        return 201, obj

    def _current(self, request: rendering.Request) -> tuple[tuple, dict]:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return key, copy.deepcopy(self.objects[key].raw)

    async def _update(self, request: rendering.Request) -> tuple[int, dict]:
        key, old = self._current(request)
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
        try:
            if ctype == "application/json-patch+json" or isinstance(request.data, list):
                new = jsonpatch.apply_patch(old, request.data, in_place=False)
            else:  # merge-patch, and strategic-merge treated as merge (lists replace)
                new = merge_patch(old, request.data)
        except jsonpatch.JsonPatchTestFailed as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=f"the JSON-patch test failed: {exc}")
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=f"cannot apply the patch: {exc}")
        if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
            raise kmock.KubernetesError(status=422, reason="Invalid", message="the patch removes the metadata")

        info = self._info(request.resource)
        if request.subresource == "status":
            new = dict(old, status=new.get("status")) if new.get("status") is not None else \
                {k: v for k, v in old.items() if k != "status"}
        elif request.subresource is not None:
            raise kmock.KubernetesError(status=404, reason="NotFound",
                                        message=f"subresource {request.subresource!r} is not emulated")
        elif info is not None and "status" in info.subresources:
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]

        sent_rv = (request.data or {}).get("metadata", {}).get("resourceVersion") \
            if isinstance(request.data, dict) else None
        if sent_rv is not None and sent_rv != old["metadata"]["resourceVersion"]:
            raise kmock.KubernetesError(status=409, reason="Conflict",
                                        message="the object has been modified; apply your changes to the latest version")
        for immutable in ("name", "namespace", "uid", "creationTimestamp", "generation", "resourceVersion"):
            if immutable in old["metadata"]:
                new["metadata"][immutable] = old["metadata"][immutable]
        if self.normalize is not None:
            new = self.normalize(new)
        if new == old:
            return 200, old  # a no-op patch changes nothing, not even the resourceVersion
        if _essence(new) != _essence(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        self._bump(new)
        self.objects[key].history.append(new)
        await self._publish(request.resource, "MODIFIED", new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            await self._remove(key, new)
        return 200, new

    async def _delete(self, request: rendering.Request) -> tuple[int, dict]:
        key, obj = self._current(request)
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return 200, obj
        if meta.get("finalizers"):
            meta["deletionTimestamp"] = _now()
            meta["deletionGracePeriodSeconds"] = 0
            self._bump(obj)
            self.objects[key].history.append(obj)
            await self._publish(request.resource, "MODIFIED", obj)
            return 200, obj
        await self._remove(key, obj)
        return 200, obj

    async def _remove(self, key: tuple, obj: dict) -> None:
        self._bump(obj)
        self.objects[key].delete()
        await self._publish(key[0], "DELETED", obj)

    # ---- reads -------------------------------------------------------------------------------

    def _matching(self, request: rendering.Request) -> list[dict]:
        out = []
        for (resource, namespace, name), obj in self.objects.items():
            if resource == request.resource and not obj.deleted and self._selects(request, namespace, name):
                out.append(copy.deepcopy(obj.raw))
        return out

    @staticmethod
    def _selects(request: rendering.Request, namespace: str | None, name: str | None) -> bool:
        return ((request.namespace is None or namespace == request.namespace)
                and (request.name is None or name == request.name))

    def _known(self, request: rendering.Request) -> None:
        if not any(resource == request.resource for resource in self._get_resources()):
            raise kmock.KubernetesResourceNotFoundError()

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        self._known(request)
        async with self._lock:
            items = self._matching(request)
            revision = self._revision
        info = self._info(request.resource)
        group, version = request.resource.group, request.resource.version
        return {
            "apiVersion": f"{group}/{version}" if group else version,
            "kind": f"{info.kind}List" if info is not None and info.kind else "List",
            "metadata": {"resourceVersion": str(revision)},
            "items": items,
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # send the headers now: the stream may stay quiet for a long time
        bus = self._buses[request.resource]
        since = request.params.get("resourceVersion") or ""
        async with self._lock:  # every write publishes under this lock: nothing slips between
            marker = await bus.mark()
            if since.isdigit() and int(since) > 0:
                backlog = [event for rv, event in self._journal[request.resource] if rv > int(since)]
            else:
                backlog = [{"type": "ADDED", "object": obj} for obj in self._matching(request)]
        try:
            for event in backlog:
                meta = event["object"].get("metadata", {})
                if self._selects(request, meta.get("namespace"), meta.get("name")):
                    yield event
            async for event in bus.stream(since=marker):
                meta = event["object"].get("metadata", {})
                if self._selects(request, meta.get("namespace"), meta.get("name")):
                    yield event
        finally:
            await bus.unmark(marker)

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_version(request)
        if request.resource.group == "":
            payload["groupVersion"] = request.resource.version  # "v1", not "/v1"
        return payload


def declare_crd(emulator: kmock.KubernetesEmulator, crd: dict) -> str:
    """Serve a CustomResourceDefinition's resource (discovery only); returns "group/version/plural"."""
    spec = crd["spec"]
    names = spec["names"]
    version = next(v for v in spec["versions"] if v.get("storage", v.get("served", True)))
    key = f"{spec['group']}/{version['name']}/{names['plural']}"
    emulator.resources[key] = kmock.ResourceInfo(
        namespaced=spec.get("scope", "Namespaced") == "Namespaced", kind=names["kind"],
        singular=names.get("singular", names["kind"].lower()),
        verbs={"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"},
        shortnames=set(names.get("shortNames", [])), categories=set(names.get("categories", [])),
        subresources=set(version.get("subresources", {})))
    return key


class KubeAPIError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


class KubeAPI:
    """A minimal synchronous JSON client for the tests (any thread, no shared event loop)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    @staticmethod
    def path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
        parts = ["/api/v1" if api_version == "v1" else f"/apis/{api_version}"]
        if namespace:
            parts += ["namespaces", namespace]
        parts.append(plural)
        parts += [p for p in (name, subresource) if p]
        return "/".join(parts)

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise KubeAPIError(exc.code, exc.read().decode(errors="replace")) from None

    def get(self, path: str) -> dict | None:
        try:
            return self.request("GET", path)
        except KubeAPIError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, path: str, body: dict) -> dict:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Any) -> dict:
        ctype = "application/json-patch+json" if isinstance(body, list) else "application/merge-patch+json"
        return self.request("PATCH", path, body, ctype)

    def delete(self, path: str) -> dict:
        return self.request("DELETE", path)

    def list(self, path: str) -> list[dict]:
        return self.request("GET", path)["items"]


class EmulatorThread:
    """``KopfEmulator`` on a loopback port, served from a thread with its own event loop."""

    def __init__(self, workdir: Path, crds: list[dict] = ()) -> None:
        self.workdir = Path(workdir)
        self.crds = list(crds)
        self.emulator: KopfEmulator | None = None
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(15) or self._error is not None:
            raise RuntimeError(f"the API emulator did not start: {self._error!r}")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by __enter__
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.emulator = KopfEmulator()
        # The built-in kinds, as kmock's load_bundled() reads them minus its deprecated
        # importlib.resources.read_binary call (a DeprecationWarning, an error under pytest here).
        bundled = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
        self.emulator.resources.load_data(gzip.decompress(bundled))
        for crd in self.crds:
            declare_crd(self.emulator, crd)
        async with self.emulator, kmock.Server(self.emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    @property
    def api(self) -> KubeAPI:
        return KubeAPI(self.url)

    def hold(self, match: Callable[[str, str], bool]) -> Hold:
        """From now on, hold the requests ``match(method, path)`` picks (see ``Hold``)."""
        hold = Hold(match)
        self.emulator.holds.append(hold)
        return hold

    def kubeconfig(self) -> Path:
        """A kubeconfig file pointing at this emulator (plain HTTP on loopback, a dummy token)."""
        path = self.workdir / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        }))
        return path
