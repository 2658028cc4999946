"""A managed etcd for one CacheCluster: a real 1- or 3-member etcd cluster.

``<name>-etcd`` is a StatefulSet whose pods get stable peer names through the headless Service
``<name>-etcd-peer`` (``<name>-etcd-<i>.<name>-etcd-peer.<ns>.svc``); ``--initial-cluster``
lists every member by that name, so the members find each other on first start and a restarted
member rejoins under the same identity with its data volume.  The members start in parallel
(a 3-member etcd is not ready until a quorum is up, so ordered start would never finish), and
the peer Service publishes members before they are ready for the same reason.  Nodes and
connectors use the client Service ``<name>-etcd``.  An external etcd renders nothing.
"""

from __future__ import annotations

from typing import Any

from .naming import (
    ETCD_CLIENT_PORT,
    ETCD_METRICS_PORT,
    ETCD_PEER_PORT,
    etcd_name,
    etcd_peer_service,
    labels,
    selector_labels,
)
from .spec import ClusterSpec

ETCD_USER = 65532  # non-root; fsGroup makes the data volume writable for it
DATA_DIR = "/var/lib/etcd"


def _peer_url(name: str, namespace: str, member: str) -> str:
    return f"http://{member}.{etcd_peer_service(name)}.{namespace}.svc:{ETCD_PEER_PORT}"


def initial_cluster(name: str, namespace: str, members: int) -> str:
    """``--initial-cluster``: every member's name and stable peer URL."""
    return ",".join(f"{etcd_name(name)}-{i}={_peer_url(name, namespace, f'{etcd_name(name)}-{i}')}"
                    for i in range(members))


def _ports() -> list[dict[str, Any]]:
    return [{"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": "client", "protocol": "TCP"},
            {"name": "peer", "port": ETCD_PEER_PORT, "targetPort": "peer", "protocol": "TCP"}]


def _container(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    me = "$(POD_NAME)"
    return {
        "name": "etcd",
        "image": spec.etcd.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/usr/local/bin/etcd"],
        "args": [
            f"--name={me}",
            f"--data-dir={DATA_DIR}/data",
            f"--listen-client-urls=http://0.0.0.0:{ETCD_CLIENT_PORT}",
            f"--advertise-client-urls=http://{me}.{etcd_peer_service(name)}.{namespace}.svc:{ETCD_CLIENT_PORT}",
            f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
            f"--initial-advertise-peer-urls={_peer_url(name, namespace, me)}",
            f"--initial-cluster={initial_cluster(name, namespace, spec.etcd.members)}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={namespace}.{etcd_name(name)}",
            f"--listen-metrics-urls=http://0.0.0.0:{ETCD_METRICS_PORT}",
            # Membership keys are rewritten by every lease refresh; keep history short.
            "--auto-compaction-mode=periodic",
            "--auto-compaction-retention=1h",
        ],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "client", "containerPort": ETCD_CLIENT_PORT, "protocol": "TCP"},
                  {"name": "peer", "containerPort": ETCD_PEER_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ETCD_METRICS_PORT, "protocol": "TCP"}],
        # Ready only with a leader; alive as long as the process listens (a member must not be
        # restarted just because the quorum is gone).
        "readinessProbe": {"httpGet": {"path": "/health", "port": "metrics"}, "periodSeconds": 5,
                           "timeoutSeconds": 3, "failureThreshold": 3},
        "livenessProbe": {"tcpSocket": {"port": "client"}, "periodSeconds": 10, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "data", "mountPath": DATA_DIR}],
    }


def _statefulset(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": spec.etcd.storage}}}
    if spec.etcd.storage_class:
        claim["storageClassName"] = spec.etcd.storage_class
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": etcd_name(name), "namespace": namespace, "labels": labels(name, "etcd")},
        "spec": {
            "replicas": spec.etcd.members,
            "serviceName": etcd_peer_service(name),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(name, "etcd")},
            "template": {
                "metadata": {"labels": labels(name, "etcd")},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": ETCD_USER, "runAsGroup": ETCD_USER,
                                        "fsGroup": ETCD_USER, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [_container(name, namespace, spec)],
                },
            },
            "volumeClaimTemplates": [{"metadata": {"name": "data", "labels": labels(name, "etcd")}, "spec": claim}],
        },
    }


def render_etcd(name: str, namespace: str, spec: ClusterSpec) -> list[dict[str, Any]]:
    """The managed etcd's objects in apply order; ``[]`` for external endpoints."""
    if not spec.etcd.managed:
        return []
    meta = {"namespace": namespace, "labels": labels(name, "etcd")}
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": etcd_peer_service(name), **meta},
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                  "selector": selector_labels(name, "etcd"), "ports": _ports()}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": etcd_name(name), **meta},
         "spec": {"type": "ClusterIP", "selector": selector_labels(name, "etcd"), "ports": _ports()[:1]}},
        _statefulset(name, namespace, spec),
    ]
    if spec.etcd.members > 1:
        # A 3-member etcd keeps its quorum through one voluntary disruption at a time.
        objects.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                        "metadata": {"name": etcd_name(name), **meta},
                        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, "etcd")}}})
    return objects
