"""Names, labels and addresses that every object of one CacheCluster shares.

A node's id is its pod's name (``<name>-<ordinal>``): the StatefulSet gives each ordinal a
stable name, so a restarted pod takes back its old place on the ring.  The kvring cluster name
in etcd is ``<namespace>.<name>``, so two CacheClusters can share one etcd.
"""

from __future__ import annotations

from .spec import ClusterSpec

ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
ETCD_METRICS_PORT = 2381

# Labels (each with the value "true") that the NetworkPolicies admit (``render_policy``); the
# chart puts them on its vLLM, admin and operator pods.
CLIENT_LABEL = "kvring.io/client"  # a pod that uses the cache: vLLM with the connector, a KV-event router
ADMIN_LABEL = "kvring.io/admin"  # the admin API (``kvring admin``)
OPERATOR_LABEL = "kvring.io/operator"  # the operator (``kvring operator``)


def cluster_key(name: str, namespace: str) -> str:
    """The kvring cluster name in etcd (nodes run with ``--cluster <cluster_key>``)."""
    return f"{namespace}.{name}"


def node_id(name: str, ordinal: int) -> str:
    """The node id of the StatefulSet pod with this ordinal (its pod name)."""
    return f"{name}-{ordinal}"


def nodes_service(name: str) -> str:
    """The headless Service that gives each node pod its DNS name."""
    return f"{name}-nodes"


def config_map(name: str) -> str:
    return f"{name}-config"


def tls_secret(name: str) -> str:
    """``<name>-tls``: the cluster's data-plane credentials (``ca.crt``, ``tls.crt``, ``tls.key``)."""
    return f"{name}-tls"


def rotation_secret(name: str) -> str:
    """``<name>-tls-rotation``: the old credentials and the new while a rotation is in progress
    (``rotation.py``); deleted when it ends."""
    return f"{name}-tls-rotation"


TLS_MOUNT = "/etc/kvring/tls"  # where nodes (and the chart's vLLM pods) mount that Secret


def node_token_secret(name: str) -> str:
    """``<name>-node-token``: the cluster's node token (key ``token``), which the nodes' admin
    ports require for flush, drain and key queries; the nodes, their preStop hook and the admin
    API read it from the Secret's volume (``NODE_TOKEN_FILE``), following it as it changes."""
    return f"{name}-node-token"


NODE_TOKEN_MOUNT = "/etc/kvring/node-token"  # where node pods (and the chart's admin API) mount that Secret


NODE_TOKEN_KEY = "token"  # the key of the token in that Secret (one token per line during a rotation)
NODE_TOKEN_FILE = f"{NODE_TOKEN_MOUNT}/{NODE_TOKEN_KEY}"


def etcd_name(name: str) -> str:
    """The managed etcd's StatefulSet and client Service."""
    return f"{name}-etcd"


def etcd_peer_service(name: str) -> str:
    """The managed etcd's headless Service (stable peer names)."""
    return f"{name}-etcd-peer"


def pool_events_name(name: str) -> str:
    """``<name>-events``: the Deployment and Service of the pool's KV-event stream (``kvring events``),
    and its pods' NetworkPolicy."""
    return f"{name}-events"


def pool_events_host(name: str, namespace: str) -> str:
    """The stream's Service DNS name: what the relay advertises in etcd and routers connect to."""
    return f"{pool_events_name(name)}.{namespace}.svc"


POOL_EVENTS_COMPONENT = "events"  # the relay pods' app.kubernetes.io/component


def selector_labels(name: str, component: str = "cachenode") -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvring", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def labels(name: str, component: str = "cachenode") -> dict[str, str]:
    return {**selector_labels(name, component), "app.kubernetes.io/managed-by": "kvring-operator"}


def selector(name: str) -> str:
    """The node pods' label selector as a string (``status.selector``, for the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def node_host(name: str, namespace: str, pod: str) -> str:
    """The stable DNS name of the node pod ``pod`` (a pod name, or ``$(POD_NAME)`` in a template)."""
    return f"{pod}.{nodes_service(name)}.{namespace}.svc"


def etcd_endpoints(name: str, namespace: str, spec: ClusterSpec) -> list[str]:
    """The etcd endpoints ("host:port") the nodes and connectors use."""
    if not spec.etcd.managed:
        return [ep.removeprefix("http://") for ep in spec.etcd.endpoints]
    return [f"{etcd_name(name)}.{namespace}.svc:{ETCD_CLIENT_PORT}"]
