"""Create-or-patch of child objects (``kvring.operator.kube``) against the API emulator.

The API is kmock's emulator with the shim in ``kmock_shim`` (no Kubernetes API server can run
here); the client is the operator's own, over HTTP, as in a cluster.
"""

from __future__ import annotations

import asyncio

import pytest
from kmock_shim import EmulatorThread

from kvring.operator.kube import KubeClient, KubeError, OwnedElsewhere, contains, merge_owner_references, object_path

OWNER = {"apiVersion": "kvring.io/v1alpha1", "kind": "CacheCluster", "name": "c", "uid": "u-1",
         "controller": True, "blockOwnerDeletion": True}


def configmap(data: dict, owner: dict | None = OWNER) -> dict:
    meta = {"name": "c-config", "namespace": "ns", "labels": {"app": "kvring"}}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def test_contains_allows_server_side_extras_only():
    current = {"metadata": {"name": "a", "uid": "x", "labels": {"a": "1", "b": "2"}},
               "spec": {"ports": [{"port": 1, "protocol": "TCP"}], "replicas": 3}}
    assert contains(current, {"metadata": {"labels": {"a": "1"}}, "spec": {"ports": [{"port": 1}]}})
    assert not contains(current, {"spec": {"replicas": 4}})
    assert not contains(current, {"spec": {"ports": [{"port": 1}, {"port": 2}]}})
    assert not contains(current, {"spec": {"selector": {}}})


def test_merge_owner_references_keeps_other_non_controller_owners():
    other = {"apiVersion": "v1", "kind": "Thing", "name": "t", "uid": "u-9"}
    current = {"metadata": {"ownerReferences": [other, dict(OWNER, uid="u-old", controller=False)]}}
    assert merge_owner_references(current, configmap({})) == [other, dict(OWNER, uid="u-old", controller=False), OWNER]


def test_object_path():
    assert object_path("v1", "Service", "ns", "a") == "/api/v1/namespaces/ns/services/a"
    assert object_path("apps/v1", "StatefulSet", "ns") == "/apis/apps/v1/namespaces/ns/statefulsets"
    assert object_path("v1", "Pod", "ns", "p") == "/api/v1/namespaces/ns/pods/p"  # read by the disk clusters' roll
    with pytest.raises(ValueError, match="not a kind the operator manages"):
        object_path("v1", "Node", "ns", "n")


def test_apply_creates_then_leaves_alone_then_patches_and_refuses_a_foreign_owner(tmp_path, monkeypatch):
    with EmulatorThread(tmp_path) as emu:
        monkeypatch.setenv("KUBECONFIG", str(emu.kubeconfig()))

        async def scenario():
            kube = await KubeClient.connect()
            try:
                assert await kube.apply(configmap({"a": "1"})) == "created"
                assert await kube.apply(configmap({"a": "1"})) == "unchanged"
                assert await kube.apply(configmap({"a": "2"})) == "patched"
                got = await kube.get("v1", "ConfigMap", "ns", "c-config")
                assert got["data"] == {"a": "2"} and got["metadata"]["ownerReferences"] == [OWNER]
                with pytest.raises(OwnedElsewhere, match="belongs to CacheCluster c"):
                    await kube.apply(configmap({"a": "3"}, dict(OWNER, uid="u-2")))
                assert await kube.get("v1", "ConfigMap", "ns", "missing") is None
                # An object nobody controls is adopted.
                await kube.create({"apiVersion": "v1", "kind": "Service",
                                   "metadata": {"name": "orphan", "namespace": "ns"}, "spec": {"ports": []}})
                svc = {"apiVersion": "v1", "kind": "Service",
                       "metadata": {"name": "orphan", "namespace": "ns", "ownerReferences": [OWNER]},
                       "spec": {"ports": []}}
                assert await kube.apply(svc) == "patched"
                assert (await kube.get("v1", "Service", "ns", "orphan"))["metadata"]["ownerReferences"] == [OWNER]
            finally:
                await kube.close()

        asyncio.run(scenario())


def test_errors_say_what_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nothing-here"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeError, match="no Kubernetes credentials.*point KUBECONFIG at a kubeconfig"):
        asyncio.run(KubeClient.connect())
