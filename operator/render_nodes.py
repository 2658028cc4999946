"""The objects that run a CacheCluster's cache nodes: StatefulSet, Services, ConfigMap, PDB, and
the two Secrets the operator makes once per cluster (data-plane credentials, node token).

Pure functions from a validated ``ClusterSpec`` to plain dicts (no owner references; the
handlers add those).  Memory rule: the node's cache budget is ``memoryPerNode`` (``--memory``,
bytes of chunk payload); the pod's memory request and limit are both
``budget x 1.25 + 256Mi`` (rounded up to a MiB).  256Mi covers the process itself (measured at
~70 MiB: interpreter, NumPy, the admin server); the 25% covers the freed payload buffers a
node keeps for reuse (at most an eighth of the budget), bytes in flight that the store does not
count yet (frames being received, handoff buffers) and allocator slack.
Request = limit keeps the pods in the Guaranteed class for memory, so a busy neighbour cannot
get them evicted.

Disk tier (``spec.disk``): each node gets a volume of its own from a claim template (``disk``,
ReadWriteOnce, mounted at ``DISK_MOUNT``), runs with ``--disk-dir <mount>/disk --disk-capacity
<bytes>``, and the StatefulSet's rolling update is held by a ``partition`` that the operator
steps down one pod at a time (``rollout.py``); without a disk, the StatefulSet controller rolls
the pods by itself and each one drains on its way out.
"""

from __future__ import annotations

import base64
import copy
import math
from typing import Any

from .contract import CONFIG_HASH_ANNOTATION, config_data, config_hash
from .naming import (
    NODE_TOKEN_FILE,
    NODE_TOKEN_KEY,
    NODE_TOKEN_MOUNT,
    TLS_MOUNT,
    cluster_key,
    config_map,
    etcd_endpoints,
    labels,
    node_host,
    node_token_secret,
    nodes_service,
    selector_labels,
    tls_secret,
)
from .spec import DISK_MOUNT, ClusterSpec, DiskSpec

MiB = 1 << 20
MEMORY_HEADROOM = 1.25
MEMORY_OVERHEAD = 256 * MiB
DEFAULT_CPU_REQUEST = "500m"
GRACE_MARGIN_SECONDS = 30  # after the drain: the process's own shutdown and leaving etcd
RUN_AS = 10001  # the image's kvring user
ENTRY = ["python", "-P", "-m", "kvring.cli"]  # -P: no cwd on sys.path (see the Dockerfile)


def pod_memory(budget: int) -> str:
    """Memory request and limit of a node pod for a cache budget in bytes."""
    return f"{math.ceil(budget * MEMORY_HEADROOM / MiB) + MEMORY_OVERHEAD // MiB}Mi"


def node_resources(spec: ClusterSpec) -> dict[str, dict[str, Any]]:
    """The node container's resources: derived memory, plus the spec's extras (cpu, ...)."""
    requests = dict(spec.resources.get("requests", {}))
    limits = dict(spec.resources.get("limits", {}))
    if "cpu" not in requests and "cpu" not in limits:
        requests["cpu"] = DEFAULT_CPU_REQUEST
    requests["memory"] = limits["memory"] = pod_memory(spec.memory_per_node)
    return {"requests": requests, "limits": limits}


def node_args(name: str, namespace: str, spec: ClusterSpec) -> list[str]:
    """``kvring node`` arguments; ``$(POD_NAME)`` is expanded by the kubelet from the env."""
    return [
        "node",
        "--node-id", "$(POD_NAME)",
        "--etcd", ",".join(etcd_endpoints(name, namespace, spec)),
        "--cluster", cluster_key(name, namespace),
        "--memory", str(spec.memory_per_node),
        "--host", "0.0.0.0",
        "--advertise-host", node_host(name, namespace, "$(POD_NAME)"),
        "--data-port", str(spec.data_port),
        "--admin-port", str(spec.admin_port),
        "--events-port", str(spec.events_port),
        "--events-replay-port", str(spec.events_replay_port),
        "--chunk-size", str(spec.chunk_size),
        "--vnodes", str(spec.vnodes),
        "--replication", str(spec.replication),
        "--lease-ttl", str(spec.lease_ttl),
        "--policy", spec.policy,
        *(("--tls-dir", TLS_MOUNT) if spec.tls else ()),
        "--node-token-file", NODE_TOKEN_FILE,
        *(_disk_args(spec.disk) if spec.disk else ()),
    ]


def _disk_args(disk: DiskSpec) -> list[str]:
    """The node's disk-tier flags; a scrub or eviction setting the spec leaves out is the node's default."""
    return ["--disk-dir", f"{DISK_MOUNT}/disk", "--disk-capacity", str(disk.capacity),
            *(("--disk-scrub-rate", str(disk.scrub_rate)) if disk.scrub_rate is not None else ()),
            *(("--disk-scrub-interval", str(disk.scrub_interval_seconds))
              if disk.scrub_interval_seconds is not None else ()),
            *(("--disk-eviction", disk.eviction) if disk.eviction is not None else ())]


def node_env(name: str) -> list[dict[str, Any]]:
    """The node container's environment: its pod's name and namespace.  (The node token is a file
    of the Secret's volume, ``--node-token-file``: a variable would not follow a rotation.)"""
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def pod_security_context() -> dict[str, Any]:
    """A kvring pod's ``securityContext``: the image's non-root user, the runtime's seccomp profile."""
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    """A kvring container's ``securityContext``: read-only root, no privilege escalation, no capabilities."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def _container(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    # With TLS the admin port serves HTTPS: the kubelet's probes do not check its certificate,
    # the preStop drain does (and shows the client certificate its guarded POST needs).
    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "admin", "scheme": admin_scheme(spec).upper()},
                "periodSeconds": period, "timeoutSeconds": 3, "failureThreshold": failures}

    drain = [*ENTRY, "drain", "--admin", f"{admin_scheme(spec)}://127.0.0.1:{spec.admin_port}",
             *(("--tls-dir", TLS_MOUNT) if spec.tls else ()), "--node-token-file", NODE_TOKEN_FILE,
             "--wait", str(spec.drain_timeout_seconds)]
    return {
        "name": "cachenode",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(ENTRY),
        "args": node_args(name, namespace, spec),
        "env": node_env(name),
        "ports": [{"name": "data", "containerPort": spec.data_port, "protocol": "TCP"},
                  {"name": "admin", "containerPort": spec.admin_port, "protocol": "TCP"},
                  {"name": "events", "containerPort": spec.events_port, "protocol": "TCP"},
                  {"name": "events-replay", "containerPort": spec.events_replay_port, "protocol": "TCP"}],
        # Ready = registered in etcd and not draining; alive = the process answers.
        "startupProbe": probe("/healthz", 2, 60),
        "readinessProbe": probe("/readyz", 5, 2),
        "livenessProbe": probe("/healthz", 10, 3),
        "lifecycle": {"preStop": {"exec": {"command": drain}}},
        "resources": node_resources(spec),
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         *([{"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True}] if spec.tls else []),
                         {"name": "node-token", "mountPath": NODE_TOKEN_MOUNT, "readOnly": True},
                         *([{"name": DISK_VOLUME, "mountPath": DISK_MOUNT}] if spec.disk else [])],
    }


def _scheduling(name: str, spec: ClusterSpec) -> dict[str, Any]:
    """nodeSelector, tolerations, affinity and spread; copies, so renders never share state."""
    out: dict[str, Any] = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = copy.deepcopy(list(spec.tolerations))
    if spec.affinity is not None:
        out["affinity"] = copy.deepcopy(spec.affinity)
    else:
        # Replicas of a chunk are worth little on one machine: prefer one node pod per host.
        out["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": selector_labels(name)}}}]}}
    if spec.topology_spread:
        spread = copy.deepcopy(list(spec.topology_spread))
        for c in spread:
            c.setdefault("labelSelector", {"matchLabels": selector_labels(name)})
        out["topologySpreadConstraints"] = spread
    return out


DISK_VOLUME = "disk"  # the claim template's name: the PVCs are disk-<name>-<ordinal>


def claim_templates(name: str, spec: ClusterSpec) -> list[dict[str, Any]]:
    """The node StatefulSet's ``volumeClaimTemplates``: one volume per node with a disk tier."""
    if spec.disk is None:
        return []
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": spec.disk.size}}}
    if spec.disk.storage_class:
        claim["storageClassName"] = spec.disk.storage_class
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": DISK_VOLUME, "labels": labels(name)}, "spec": claim}]


def update_strategy(spec: ClusterSpec, partition: int) -> dict[str, Any]:
    """Without a disk the controller rolls (each pod drains on its way out); with one the operator
    steps ``partition`` down, one pod at a time, and the pods keep their chunks (``rollout.py``)."""
    if spec.disk is None:
        return {"type": "RollingUpdate"}
    return {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}}


def render_statefulset(name: str, namespace: str, spec: ClusterSpec, replicas: int | None = None,
                       partition: int = 0) -> dict[str, Any]:
    """The node StatefulSet; ``replicas`` overrides ``spec.replicas`` (kept higher while draining),
    ``partition`` is the rolling update's (with a disk tier; see ``update_strategy``)."""
    pod_labels = labels(name)
    disk: dict[str, Any] = {}
    if spec.disk is not None:
        # The volumes go with the CacheCluster, and stay through a scale-in (a node that comes back
        # finds its chunks).
        disk = {"volumeClaimTemplates": claim_templates(name, spec),
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"}}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "serviceName": nodes_service(name),
            # Nodes find each other through etcd, not through ordinal order: start them together.
            "podManagementPolicy": "Parallel",
            "updateStrategy": update_strategy(spec, partition),
            "selector": {"matchLabels": selector_labels(name)},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {CONFIG_HASH_ANNOTATION: config_hash(config_data(name, namespace, spec)),
                                    **scrape_annotations(spec.admin_port, admin_scheme(spec))},
                },
                "spec": {
                    "terminationGracePeriodSeconds": spec.drain_timeout_seconds + GRACE_MARGIN_SECONDS,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": pod_security_context(),
                    "containers": [_container(name, namespace, spec)],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                                *([{"name": "tls", "secret": {"secretName": tls_secret(name), "defaultMode": 0o440}}]
                                  if spec.tls else []),
                                {"name": "node-token",
                                 "secret": {"secretName": node_token_secret(name), "defaultMode": 0o440}}],
                    **_scheduling(name, spec),
                },
            },
            **disk,
        },
    }


def admin_scheme(spec: ClusterSpec) -> str:
    """How the nodes serve their admin port: ``https`` with the cluster's credentials."""
    return "https" if spec.tls else "http"


def scrape_annotations(port: int, scheme: str = "http") -> dict[str, str]:
    """The ``prometheus.io/*`` annotations a Prometheus that discovers pods by annotation reads (the
    nodes' ``/metrics`` is on their admin port, open without a token or client certificate); the
    chart's PodMonitor, where the Prometheus operator runs, selects the pods by their labels and
    takes the scheme from ``prometheus.io/scheme``."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics",
            "prometheus.io/scheme": scheme}


def _ports(spec: ClusterSpec) -> list[dict[str, Any]]:
    return [{"name": "data", "port": spec.data_port, "targetPort": "data", "protocol": "TCP"},
            {"name": "admin", "port": spec.admin_port, "targetPort": "admin", "protocol": "TCP"},
            {"name": "events", "port": spec.events_port, "targetPort": "events", "protocol": "TCP"},
            {"name": "events-replay", "port": spec.events_replay_port, "targetPort": "events-replay",
             "protocol": "TCP"}]


def render_headless_service(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    """``<name>-nodes``: a DNS name per node pod, published before the pod is ready (nodes
    advertise that name in etcd while they are still joining)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": nodes_service(name), "namespace": namespace, "labels": labels(name)},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": selector_labels(name), "ports": _ports(spec)},
    }


def render_client_service(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    """``<name>``: one address for the nodes' admin HTTP (/metrics, /stats) and data ports."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {"type": "ClusterIP", "selector": selector_labels(name), "ports": _ports(spec)},
    }


def render_tls_secret(name: str, namespace: str, files: dict[str, bytes]) -> dict[str, Any]:
    """``<name>-tls``: the cluster's data-plane credentials (``kvring.common.tls.credentials_pem``),
    made once when the Secret does not exist.  Replaced at once, it would cut nodes off from
    clients until each had taken the new set; the operator changes it only in a rotation's
    steps (``rotation.py``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": tls_secret(name), "namespace": namespace, "labels": labels(name)},
        "type": "kubernetes.io/tls",
        "data": {key: base64.b64encode(value).decode() for key, value in sorted(files.items())},
    }


def render_node_token_secret(name: str, namespace: str, token: str) -> dict[str, Any]:
    """``<name>-node-token``: the token the nodes' admin ports require (key ``token``), made once
    when the Secret does not exist; the operator changes it only in a rotation (``rotation.py``),
    in steps the nodes and the admin API follow from the Secret's volume."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": node_token_secret(name), "namespace": namespace, "labels": labels(name)},
        "type": "Opaque",
        "data": {NODE_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def render_configmap(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    """``<name>-config``: connector settings (key ``kv-transfer-config``) and the contract."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map(name), "namespace": namespace, "labels": labels(name)},
        "data": config_data(name, namespace, spec),
    }


def render_pdb(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    """At most one node pod down through voluntary disruptions (each one drains first)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }
