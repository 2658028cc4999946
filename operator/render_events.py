"""The pool's KV events as one stream for KV-aware routers: ``kvring events`` in a pod of its own.

``<name>-events`` is a Deployment of one pod (``Recreate``: one stream per cluster, its record in
etcd written under the running pod's lease) and a ClusterIP Service of the same name with the
ports ``events`` (ZMQ PUB) and ``events-replay`` (ZMQ ROUTER).  The relay binds 0.0.0.0 and
advertises the Service's DNS name (``<name>-events.<namespace>.svc``), so the record in etcd,
the admin API's ``/v1/cluster`` and the CacheCluster's ``status.poolEvents`` all give routers an
address they can reach.  It follows the nodes through etcd (their event ports, named in their
membership records) and needs no credentials: the event ports are plain ZMQ, and etcd is the
cluster's.  Image, command, user and security settings are the nodes' (``render_nodes``); its
scheduling is left to Kubernetes (a small pod, unlike the nodes tied to no host).
``spec.poolEvents.enabled: false`` renders nothing.
"""

from __future__ import annotations

import copy
from typing import Any

from .naming import (
    POOL_EVENTS_COMPONENT,
    cluster_key,
    etcd_endpoints,
    labels,
    pool_events_host,
    pool_events_name,
    selector_labels,
)
from .render_nodes import ENTRY, container_security_context, pod_security_context
from .spec import ClusterSpec


def pool_events_args(name: str, namespace: str, spec: ClusterSpec) -> list[str]:
    """``kvring events`` arguments of the relay pod."""
    events = spec.pool_events
    return [
        "events",
        "--etcd", ",".join(etcd_endpoints(name, namespace, spec)),
        "--cluster", cluster_key(name, namespace),
        "--host", "0.0.0.0",
        "--advertise-host", pool_events_host(name, namespace),
        "--port", str(events.port),
        "--replay-port", str(events.replay_port),
        *(("--topic", events.topic) if events.topic else ()),
    ]


def _ports(spec: ClusterSpec) -> list[dict[str, Any]]:
    return [{"name": "events", "port": spec.pool_events.port, "targetPort": "events", "protocol": "TCP"},
            {"name": "events-replay", "port": spec.pool_events.replay_port, "targetPort": "events-replay",
             "protocol": "TCP"}]


def _container(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    return {
        "name": "events",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(ENTRY),
        "args": pool_events_args(name, namespace, spec),
        "ports": [{"name": "events", "containerPort": spec.pool_events.port, "protocol": "TCP"},
                  {"name": "events-replay", "containerPort": spec.pool_events.replay_port, "protocol": "TCP"}],
        # Ready once it publishes (it binds before it reads etcd).
        "readinessProbe": {"tcpSocket": {"port": "events"}, "periodSeconds": 5, "timeoutSeconds": 3,
                           "failureThreshold": 2},
        "resources": copy.deepcopy(spec.pool_events.resources),
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


def render_pool_events(name: str, namespace: str, spec: ClusterSpec) -> list[dict[str, Any]]:
    """The Service, then the Deployment, of ``<name>-events``; ``[]`` with ``spec.poolEvents.enabled`` false."""
    if not spec.pool_events.enabled:
        return []
    def meta() -> dict[str, Any]:
        return {"name": pool_events_name(name), "namespace": namespace, "labels": labels(name, POOL_EVENTS_COMPONENT)}

    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(),
         "spec": {"type": "ClusterIP", "selector": selector_labels(name, POOL_EVENTS_COMPONENT), "ports": _ports(spec)}},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta(),
            "spec": {
                "replicas": 1,
                # Never two at once: each would write its own address under the cluster's one key.
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": selector_labels(name, POOL_EVENTS_COMPONENT)},
                "template": {
                    "metadata": {"labels": labels(name, POOL_EVENTS_COMPONENT)},
                    "spec": {
                        "automountServiceAccountToken": False,
                        "enableServiceLinks": False,
                        "securityContext": pod_security_context(),
                        "containers": [_container(name, namespace, spec)],
                        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],
                    },
                },
            },
        },
    ]


def pool_events_objects(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every object ``render_pool_events`` may have made (the operator
    deletes them when the spec turns the stream off)."""
    return [("apps/v1", "Deployment", pool_events_name(name)), ("v1", "Service", pool_events_name(name))]
