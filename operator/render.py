"""Everything a CacheCluster consists of, as plain dicts: the handlers' one entry point.

The functions live in ``render_nodes`` (cache nodes), ``render_etcd`` (managed etcd),
``render_events`` (the pool's KV-event stream), ``render_policy`` (NetworkPolicies), ``naming``
and ``contract``; this module gathers them and gives the apply order.
"""

from __future__ import annotations

from typing import Any

from .contract import (
    ADMIN_SECRET_KEY,
    CONFIG_HASH_ANNOTATION,
    NODE_TOKEN_SECRET_KEY,
    TRANSFER_CONFIG_KEY,
    config_data,
    config_hash,
    connector_config,
    connector_json,
)
from .naming import (
    cluster_key,
    etcd_endpoints,
    labels,
    node_id,
    node_token_secret,
    nodes_service,
    selector,
    selector_labels,
    tls_secret,
)
from .render_etcd import render_etcd
from .render_events import pool_events_objects, render_pool_events
from .render_policy import network_policy_names, render_network_policies
from .render_nodes import (
    node_resources,
    pod_memory,
    render_client_service,
    render_configmap,
    render_headless_service,
    render_node_token_secret,
    render_pdb,
    render_statefulset,
    render_tls_secret,
    update_strategy,
)
from .spec import ClusterSpec, check_name

__all__ = [
    "ADMIN_SECRET_KEY", "CONFIG_HASH_ANNOTATION", "NODE_TOKEN_SECRET_KEY", "TRANSFER_CONFIG_KEY", "cluster_key",
    "config_data", "config_hash", "connector_config", "connector_json", "etcd_endpoints", "labels", "node_id",
    "network_policy_names", "node_resources", "node_token_secret", "nodes_service", "optional_children", "pod_memory",
    "render_children", "render_network_policies", "render_client_service", "render_pool_events",
    "render_configmap", "render_etcd", "render_headless_service", "render_node_token_secret", "render_pdb",
    "render_statefulset", "render_tls_secret", "selector", "selector_labels", "tls_secret", "update_strategy",
]


def render_children(name: str, namespace: str, spec: ClusterSpec, replicas: int | None = None,
                    partition: int = 0, operator_namespace: str | None = None) -> list[dict[str, Any]]:
    """All child objects in apply order: config, NetworkPolicies (before the pods they guard) and
    etcd first, then the event stream that follows the nodes through it, the nodes last (the
    StatefulSet is the last object).  ``operator_namespace``: where the operator's own pod runs,
    which the policies admit to the nodes' admin ports and to etcd."""
    check_name(name)
    return [
        render_configmap(name, namespace, spec),
        *render_network_policies(name, namespace, spec, operator_namespace),
        *render_etcd(name, namespace, spec),
        *render_pool_events(name, namespace, spec),
        render_headless_service(name, namespace, spec),
        render_client_service(name, namespace, spec),
        render_pdb(name, namespace, spec),
        render_statefulset(name, namespace, spec, replicas, partition),
    ]


def optional_children(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every child a spec may or may not want (NetworkPolicies, the
    event stream): the operator deletes those it made that ``render_children`` no longer renders."""
    return [*(("networking.k8s.io/v1", "NetworkPolicy", policy) for policy in network_policy_names(name)),
            *pool_events_objects(name)]
