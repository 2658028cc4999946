"""NetworkPolicies of a CacheCluster: who may reach its nodes, its event stream and its managed etcd.

Ingress only (what the pods may send is left alone), one policy per set of pods, each rule a
set of ports and the peers that may use them:

- ``<name>`` (the node pods): the data port and the two KV-event ports from this cluster's
  nodes (repair, drain handoff, the id probe), from pods labelled ``kvring.io/client=true`` in
  the cluster's namespace and in ``spec.networkPolicy.clientNamespaces`` (vLLM with the
  connector, a router reading the events) and from the admin API (``kvring.io/admin=true``);
  the two KV-event ports, not the data port, also from this cluster's event stream (the relay
  pods, ``<name>-events``, which follow every node); the admin HTTP port (``/metrics``,
  ``/stats``, flush and drain behind the node token) from the admin API, the operator
  (``kvring.io/operator=true`` in the operator's namespace) and every pod of
  ``spec.networkPolicy.monitoringNamespace``.
- ``<name>-events`` (the relay pods, with ``spec.poolEvents.enabled``): the stream's two ports
  from pods labelled ``kvring.io/client=true`` in the cluster's namespace and in
  ``clientNamespaces`` (the routers).
- ``<name>-etcd`` (the managed etcd, when there is one): the client port from kvring's own pods
  (the nodes, the relay, clients, the admin API, the operator), the peer port from its members,
  the metrics port from the monitoring namespace.

Namespaces are selected by ``kubernetes.io/metadata.name``, the label the API server puts on
every namespace.  The kubelet's probes need no rule: a NetworkPolicy always admits traffic from
the pod's own node.  ``spec.networkPolicy.enabled: false`` renders nothing.
"""

from __future__ import annotations

from typing import Any

from .naming import (
    ADMIN_LABEL,
    CLIENT_LABEL,
    ETCD_CLIENT_PORT,
    ETCD_METRICS_PORT,
    ETCD_PEER_PORT,
    OPERATOR_LABEL,
    POOL_EVENTS_COMPONENT,
    etcd_name,
    labels,
    pool_events_name,
    selector_labels,
)
from .spec import ClusterSpec

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def namespace_peer(namespace: str, pod_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A peer: every pod of ``namespace``, or those of its pods carrying ``pod_labels``."""
    peer: dict[str, Any] = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}}
    if pod_labels is not None:
        peer["podSelector"] = {"matchLabels": dict(pod_labels)}
    return peer


def _pods(pod_labels: dict[str, str]) -> dict[str, Any]:
    """A peer: the pods carrying ``pod_labels`` in the policy's own namespace."""
    return {"podSelector": {"matchLabels": dict(pod_labels)}}


def _clients(spec: ClusterSpec) -> list[dict[str, Any]]:
    client = {CLIENT_LABEL: "true"}
    return [_pods(client), *(namespace_peer(ns, client) for ns in spec.network_policy.client_namespaces)]


def _operator(operator_namespace: str | None) -> dict[str, Any]:
    """The operator's pods: in its own namespace when it knows it (``POD_NAMESPACE``), else in the
    cluster's (an operator run outside the cluster reaches no pod anyway)."""
    operator = {OPERATOR_LABEL: "true"}
    return _pods(operator) if operator_namespace is None else namespace_peer(operator_namespace, operator)


def _relay(name: str, spec: ClusterSpec) -> list[dict[str, Any]]:
    """A peer list: this cluster's relay pods, when it runs them."""
    return [_pods(selector_labels(name, POOL_EVENTS_COMPONENT))] if spec.pool_events.enabled else []


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _policy(name: str, namespace: str, obj_labels: dict[str, str], pods: dict[str, str],
            ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": obj_labels},
        "spec": {"podSelector": {"matchLabels": dict(pods)}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def render_node_policy(name: str, namespace: str, spec: ClusterSpec,
                       operator_namespace: str | None = None) -> dict[str, Any]:
    """``<name>``: who may reach the node pods, port by port (see the module docstring)."""
    admin = _pods({ADMIN_LABEL: "true"})
    relay = _relay(name, spec)
    return _policy(name, namespace, labels(name), selector_labels(name), [
        {"ports": _tcp(spec.data_port, spec.events_port, spec.events_replay_port),
         "from": [_pods(selector_labels(name)), *_clients(spec), admin]},
        {"ports": _tcp(spec.admin_port),
         "from": [admin, _operator(operator_namespace), namespace_peer(spec.network_policy.monitoring_namespace)]},
        *([{"ports": _tcp(spec.events_port, spec.events_replay_port), "from": relay}] if relay else []),
    ])


def render_pool_events_policy(name: str, namespace: str, spec: ClusterSpec) -> dict[str, Any]:
    """``<name>-events``: who may reach the relay pods (the routers)."""
    return _policy(pool_events_name(name), namespace, labels(name, POOL_EVENTS_COMPONENT),
                   selector_labels(name, POOL_EVENTS_COMPONENT), [
                       {"ports": _tcp(spec.pool_events.port, spec.pool_events.replay_port), "from": _clients(spec)},
                   ])


def render_etcd_policy(name: str, namespace: str, spec: ClusterSpec,
                       operator_namespace: str | None = None) -> dict[str, Any]:
    """``<name>-etcd``: who may reach the managed etcd's members."""
    members = selector_labels(name, "etcd")
    return _policy(etcd_name(name), namespace, labels(name, "etcd"), members, [
        {"ports": _tcp(ETCD_CLIENT_PORT),
         "from": [_pods(selector_labels(name)), *_relay(name, spec), *_clients(spec), _pods({ADMIN_LABEL: "true"}),
                  _operator(operator_namespace)]},
        {"ports": _tcp(ETCD_PEER_PORT), "from": [_pods(members)]},
        {"ports": _tcp(ETCD_METRICS_PORT), "from": [namespace_peer(spec.network_policy.monitoring_namespace)]},
    ])


def render_network_policies(name: str, namespace: str, spec: ClusterSpec,
                            operator_namespace: str | None = None) -> list[dict[str, Any]]:
    """The cluster's NetworkPolicies; ``[]`` when ``spec.networkPolicy.enabled`` is false."""
    if not spec.network_policy.enabled:
        return []
    policies = [render_node_policy(name, namespace, spec, operator_namespace)]
    if spec.pool_events.enabled:
        policies.append(render_pool_events_policy(name, namespace, spec))
    if spec.etcd.managed:
        policies.append(render_etcd_policy(name, namespace, spec, operator_namespace))
    return policies


def network_policy_names(name: str) -> list[str]:
    """Every NetworkPolicy name a cluster may have had (the operator deletes them when turned off)."""
    return [name, pool_events_name(name), etcd_name(name)]
