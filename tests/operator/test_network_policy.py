"""Who may reach what, read from the rendered NetworkPolicies: the operator's (nodes, managed etcd)
and the chart's (operator, admin API, etcd), rendered by the real render functions and the real
``helm template``.

No API server or network plugin runs here, so ``allowed`` below evaluates the policies the way
Kubernetes defines them (a pod no ingress policy selects accepts everything; a selected pod
accepts what some rule of some selecting policy admits; a peer with only a ``podSelector`` means
that policy's namespace; namespaces carry ``kubernetes.io/metadata.name``).  Its sources and
destinations are the pods the chart and the operator actually render (their template labels,
their container ports by name), so a label or port that drifts apart fails here.  Every policy
is also validated against the Kubernetes 1.35 schemas (strict).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import kubernetes_validate
import pytest
from test_chart import K8S_VERSION, NAMESPACE, by_kind, template

from kvring.operator.naming import CLIENT_LABEL
from kvring.operator.render import render_children, render_network_policies
from kvring.operator.spec import ClusterSpec, SpecError

CLUSTER_NS = NAMESPACE  # the chart's release namespace, where its CacheCluster lives
OPERATOR_NS = "kvring-system"  # the operator runs apart from the cluster in the operator tests


# ---- the evaluator ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # container ports by name

    def port(self, name: str) -> int:
        return self.ports[name]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector; the empty one selects everything."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_admits(peer: dict[str, Any], policy_ns: str, src: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pods are not addressed by IP block here
    if "namespaceSelector" in peer:
        in_ns = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src.namespace})
    else:
        in_ns = src.namespace == policy_ns
    return in_ns and selects(peer.get("podSelector") or {}, src.labels)


def port_admits(ports: list[dict[str, Any]] | None, dst: Pod, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        want = p.get("port")
        if want is None:
            return True
        number = dst.ports.get(want) if isinstance(want, str) else want
        if number is not None and number <= port <= p.get("endPort", number):
            return True
    return False


def allowed(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int) -> bool:
    """Whether a TCP connection from ``src`` to ``dst``'s ``port`` is admitted."""
    selecting = [p for p in policies
                 if p["metadata"]["namespace"] == dst.namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selects(p["spec"]["podSelector"], dst.labels)]
    if not selecting:
        return True
    return any(port_admits(rule.get("ports"), dst, port)
               and (not rule.get("from") or any(peer_admits(peer, p["metadata"]["namespace"], src)
                                                for peer in rule["from"]))
               for p in selecting for rule in p["spec"].get("ingress") or ())


def pod_of(workload: dict[str, Any], namespace: str) -> Pod:
    """The pod a Deployment or StatefulSet runs: its template's labels and named container ports."""
    template_ = workload["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for c in template_["spec"]["containers"] for p in c.get("ports", ())}
    return Pod(namespace, dict(template_["metadata"]["labels"]), ports)


def policies_of(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for policy in found:
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    return found


def test_the_evaluator_follows_kubernetes_semantics():
    """Guards for the evaluator itself, on hand-written policies."""
    dst = Pod("a", {"app": "db"}, {"sql": 5432})
    src = Pod("a", {"app": "web"})
    deny_all = {"metadata": {"namespace": "a"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert allowed([], src, dst, 5432)  # selected by nothing: open
    assert not allowed([deny_all], src, dst, 5432)
    web_only = copy.deepcopy(deny_all)
    web_only["spec"]["ingress"] = [{"ports": [{"port": "sql"}], "from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]
    assert allowed([web_only], src, dst, 5432)
    assert not allowed([web_only], src, dst, 22)  # another port
    assert not allowed([web_only], Pod("b", {"app": "web"}), dst, 5432)  # podSelector alone: same namespace
    assert allowed([deny_all, web_only], src, dst, 5432)  # policies add up
    other_ns = copy.deepcopy(deny_all)
    other_ns["metadata"]["namespace"] = "b"
    assert allowed([other_ns], src, dst, 5432)  # a policy applies in its own namespace only


# ---- the operator's policies ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def chart_pods() -> dict[str, Pod]:
    """The chart's own pods as it renders them: the labels they really carry."""
    docs = by_kind(template("--set", "etcd.enabled=true", "--set", "cacheCluster.enabled=true",
                            "--set", "vllm.enabled=true", "--set", "admin.enabled=true"))
    return {"vllm": pod_of(docs[("Deployment", "kv-kvring-vllm")], CLUSTER_NS),
            "admin": pod_of(docs[("Deployment", "kv-kvring-admin")], CLUSTER_NS),
            "operator": pod_of(docs[("Deployment", "kv-kvring-operator")], OPERATOR_NS),
            "etcd": pod_of(docs[("StatefulSet", "kv-kvring-etcd")], CLUSTER_NS)}


def cluster(spec_patch: dict[str, Any] | None = None, name: str = "kv-cache",
            namespace: str = CLUSTER_NS) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    spec = ClusterSpec.from_dict({"memoryPerNode": "1Gi", **(spec_patch or {})})
    objects = render_children(name, namespace, spec, operator_namespace=OPERATOR_NS)
    return policies_of(objects), {(o["kind"] + " " + o["metadata"]["name"]): o for o in objects}


def test_node_data_and_event_ports_admit_clients_nodes_and_the_admin_only(chart_pods):
    policies, objs = cluster()
    node = pod_of(objs["StatefulSet kv-cache"], CLUSTER_NS)
    other_cluster_node = pod_of(cluster(name="other")[1]["StatefulSet other"], CLUSTER_NS)
    for port_name in ("data", "events", "events-replay"):
        port = node.port(port_name)
        assert allowed(policies, chart_pods["vllm"], node, port), port_name  # the chart's vLLM: a client
        assert allowed(policies, Pod(CLUSTER_NS, {CLIENT_LABEL: "true"}), node, port)  # a router so labelled
        assert allowed(policies, node, node, port)  # node to node: repair, drain handoff, id probe
        assert allowed(policies, chart_pods["admin"], node, port)
        assert not allowed(policies, Pod(CLUSTER_NS, {"app": "curious"}), node, port)  # unlabelled
        assert not allowed(policies, Pod("elsewhere", {CLIENT_LABEL: "true"}), node, port)  # client elsewhere
        assert not allowed(policies, other_cluster_node, node, port)  # another CacheCluster's node
        assert not allowed(policies, Pod("monitoring"), node, port)
        assert not allowed(policies, chart_pods["operator"], node, port)


def test_node_metrics_port_admits_monitoring_the_admin_and_the_operator(chart_pods):
    policies, objs = cluster()
    node = pod_of(objs["StatefulSet kv-cache"], CLUSTER_NS)
    metrics = node.port("admin")  # /metrics, /stats, flush and drain
    # What Prometheus scrapes is that port.
    assert objs["StatefulSet kv-cache"]["spec"]["template"]["metadata"].get("annotations", {}).get(
        "prometheus.io/port", str(metrics)) == str(metrics)
    assert allowed(policies, Pod("monitoring", {"app.kubernetes.io/name": "prometheus"}), node, metrics)
    assert not allowed(policies, Pod("default", {"app.kubernetes.io/name": "prometheus"}), node, metrics)
    assert allowed(policies, chart_pods["admin"], node, metrics)
    assert allowed(policies, chart_pods["operator"], node, metrics)  # /stats for the status, from its namespace
    assert not allowed(policies, Pod("elsewhere", chart_pods["operator"].labels), node, metrics)
    assert not allowed(policies, chart_pods["vllm"], node, metrics)
    assert not allowed(policies, Pod(CLUSTER_NS, {"app": "curious"}), node, metrics)


def test_managed_etcd_admits_kvrings_own_pods_only(chart_pods):
    policies, objs = cluster()
    node = pod_of(objs["StatefulSet kv-cache"], CLUSTER_NS)
    etcd = pod_of(objs["StatefulSet kv-cache-etcd"], CLUSTER_NS)
    client = etcd.port("client")
    for who in (node, chart_pods["vllm"], chart_pods["admin"], chart_pods["operator"]):
        assert allowed(policies, who, etcd, client), who
    for who in (Pod(CLUSTER_NS, {"app": "curious"}), Pod("monitoring"), Pod("elsewhere", chart_pods["operator"].labels)):
        assert not allowed(policies, who, etcd, client), who
    assert allowed(policies, etcd, etcd, etcd.port("peer"))
    assert not allowed(policies, node, etcd, etcd.port("peer"))
    assert allowed(policies, Pod("monitoring"), etcd, etcd.port("metrics"))
    assert not allowed(policies, Pod("default"), etcd, etcd.port("metrics"))


def test_the_event_stream_admits_clients_only_and_reaches_the_node_event_ports_and_etcd(chart_pods):
    """The relay pods (``<name>-events``): routers (clients) may subscribe; they themselves reach
    every node's two event ports (not its data or admin port) and the managed etcd."""
    policies, objs = cluster()
    relay = pod_of(objs["Deployment kv-cache-events"], CLUSTER_NS)
    node = pod_of(objs["StatefulSet kv-cache"], CLUSTER_NS)
    etcd = pod_of(objs["StatefulSet kv-cache-etcd"], CLUSTER_NS)
    other_relay = pod_of(cluster(name="other")[1]["Deployment other-events"], CLUSTER_NS)
    for port_name in ("events", "events-replay"):
        port = relay.port(port_name)
        assert allowed(policies, Pod(CLUSTER_NS, {CLIENT_LABEL: "true"}), relay, port)  # a router so labelled
        assert allowed(policies, chart_pods["vllm"], relay, port)  # the chart's client pods carry the label
        assert not allowed(policies, Pod(CLUSTER_NS, {"app": "router"}), relay, port)  # unlabelled
        assert not allowed(policies, Pod("elsewhere", {CLIENT_LABEL: "true"}), relay, port)  # not a client namespace
        assert not allowed(policies, node, relay, port)
        assert not allowed(policies, Pod("monitoring"), relay, port)
        # The relay follows every node's events and replays.
        assert allowed(policies, relay, node, node.port(port_name))
        assert not allowed(policies, other_relay, node, node.port(port_name))  # another CacheCluster's stream
    assert not allowed(policies, relay, node, node.port("data"))
    assert not allowed(policies, relay, node, node.port("admin"))
    assert allowed(policies, relay, etcd, etcd.port("client"))
    assert not allowed(policies, relay, etcd, etcd.port("peer"))
    # A client namespace's routers may subscribe too.
    policies, objs = cluster({"networkPolicy": {"clientNamespaces": ["serving"]}})
    relay = pod_of(objs["Deployment kv-cache-events"], CLUSTER_NS)
    assert allowed(policies, Pod("serving", {CLIENT_LABEL: "true"}), relay, relay.port("events"))
    assert not allowed(policies, Pod("serving"), relay, relay.port("events"))
    # Turned off: no relay, no policy for it, and nothing admitted in its name.
    policies, objs = cluster({"poolEvents": {"enabled": False}})
    assert "Deployment kv-cache-events" not in objs and "NetworkPolicy kv-cache-events" not in objs
    node = pod_of(objs["StatefulSet kv-cache"], CLUSTER_NS)
    assert not allowed(policies, relay, node, node.port("events"))
    assert not allowed(policies, relay, pod_of(objs["StatefulSet kv-cache-etcd"], CLUSTER_NS), 2379)


def test_spec_settings_move_the_namespaces_and_follow_the_ports(chart_pods):
    policies, objs = cluster({"networkPolicy": {"monitoringNamespace": "observability",
                                                "clientNamespaces": ["serving"]},
                              "ports": {"data": 7000, "admin": 7001, "events": 7002, "eventsReplay": 7003}})
    node = pod_of(objs["StatefulSet kv-cache"], CLUSTER_NS)
    assert node.port("data") == 7000
    for port_name in ("data", "events", "events-replay"):
        assert allowed(policies, Pod("serving", {CLIENT_LABEL: "true"}), node, node.port(port_name))
        assert not allowed(policies, Pod("serving"), node, node.port(port_name))
    assert allowed(policies, chart_pods["vllm"], node, node.port("data"))  # its own namespace's still may
    assert allowed(policies, Pod("observability"), node, node.port("admin"))
    assert not allowed(policies, Pod("monitoring"), node, node.port("admin"))
    assert allowed(policies, Pod("serving", {CLIENT_LABEL: "true"}), pod_of(objs["StatefulSet kv-cache-etcd"], CLUSTER_NS),
                   2379)


def test_an_operator_that_does_not_know_its_namespace_is_admitted_from_the_clusters():
    spec = ClusterSpec.from_dict({"memoryPerNode": "1Gi"})
    objects = render_children("kv", "ns", spec)
    policies = policies_of(objects)
    node = pod_of(objects[-1], "ns")
    operator_labels = {"kvring.io/operator": "true"}
    assert allowed(policies, Pod("ns", operator_labels), node, node.port("admin"))
    assert not allowed(policies, Pod("other", operator_labels), node, node.port("admin"))


def test_external_etcd_gets_no_policy_and_disabled_renders_none():
    policies, _ = cluster({"etcd": {"endpoints": ["etcd.infra:2379"]}})
    assert [p["metadata"]["name"] for p in policies] == ["kv-cache", "kv-cache-events"]
    off = ClusterSpec.from_dict({"memoryPerNode": "1Gi", "networkPolicy": {"enabled": False}})
    assert render_network_policies("kv-cache", CLUSTER_NS, off) == []
    objects = render_children("kv-cache", CLUSTER_NS, off)
    assert [o for o in objects if o["kind"] == "NetworkPolicy"] == []
    node = pod_of(objects[-1], CLUSTER_NS)
    assert allowed([], Pod("anywhere"), node, node.port("data"))


@pytest.mark.parametrize(("policy", "says"), [
    ({"enabled": "no"}, "spec.networkPolicy.enabled must be one of True, False"),
    ({"monitoringNamespace": "Monitoring"}, "spec.networkPolicy.monitoringNamespace 'Monitoring' is not a namespace"),
    ({"clientNamespaces": "serving"}, "spec.networkPolicy.clientNamespaces must be a list"),
    ({"clientNamespaces": ["ok", "not_ok"]}, "spec.networkPolicy.clientNamespaces: 'not_ok' is not a namespace"),
    ({"enable": False}, "spec.networkPolicy.enable is not a known field; did you mean enabled?"),
    ("off", "spec.networkPolicy must be an object"),
])
def test_bad_network_policy_settings_say_what_to_set(policy, says):
    with pytest.raises(SpecError) as info:
        ClusterSpec.from_dict({"memoryPerNode": "1Gi", "networkPolicy": policy})
    assert says in str(info.value)


# ---- the chart's policies ------------------------------------------------------------------------

EVERYTHING = ["--set", "etcd.enabled=true", "--set", "cacheCluster.enabled=true", "--set", "vllm.enabled=true",
              "--set", "admin.enabled=true"]


def chart(*args: str) -> tuple[list[dict[str, Any]], dict[tuple[str, str], dict[str, Any]]]:
    docs = template(*EVERYTHING, *args)
    return policies_of(docs), by_kind(docs)


def test_chart_etcd_admits_kvrings_own_pods_only():
    policies, docs = chart()
    pods = {n: pod_of(docs[("Deployment", f"kv-kvring-{n}")], NAMESPACE) for n in ("vllm", "admin", "operator")}
    etcd = pod_of(docs[("StatefulSet", "kv-kvring-etcd")], NAMESPACE)
    # The chart's CacheCluster's nodes, as the operator renders them from the chart's spec.
    cc = docs[("CacheCluster", "kv-cache")]
    rendered = {(o["kind"], o["metadata"]["name"]): o
                for o in render_children("kv-cache", NAMESPACE, ClusterSpec.from_dict(cc["spec"]))}
    node = pod_of(rendered[("StatefulSet", "kv-cache")], NAMESPACE)
    relay = pod_of(rendered[("Deployment", "kv-cache-events")], NAMESPACE)  # the event stream reads the members
    for who in (node, relay, *pods.values()):
        assert allowed(policies, who, etcd, etcd.port("client")), who.labels
    assert not allowed(policies, Pod(NAMESPACE, {"app": "curious"}), etcd, etcd.port("client"))
    assert not allowed(policies, Pod("elsewhere", node.labels), etcd, etcd.port("client"))
    assert not allowed(policies, Pod("monitoring"), etcd, etcd.port("client"))
    assert allowed(policies, etcd, etcd, etcd.port("peer"))
    assert not allowed(policies, node, etcd, etcd.port("peer"))
    assert allowed(policies, Pod("monitoring"), etcd, etcd.port("metrics"))
    assert not allowed(policies, Pod("default"), etcd, etcd.port("metrics"))


def test_chart_admin_api_and_operator():
    policies, docs = chart("--set", "networkPolicy.adminFrom[0].namespaceSelector.matchLabels.team=ops")
    admin = pod_of(docs[("Deployment", "kv-kvring-admin")], NAMESPACE)
    operator = pod_of(docs[("Deployment", "kv-kvring-operator")], NAMESPACE)
    vllm = pod_of(docs[("Deployment", "kv-kvring-vllm")], NAMESPACE)
    http = admin.port("http")
    assert allowed(policies, vllm, admin, http)  # clients (routers) use its prefix lookup
    assert allowed(policies, Pod("monitoring"), admin, http)
    assert not allowed(policies, Pod(NAMESPACE, {"app": "curious"}), admin, http)
    ops = [p for p in policies if p["metadata"]["name"] == "kv-kvring-admin"][0]["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"team": "ops"}}} in ops  # networkPolicy.adminFrom
    # The operator: only Prometheus calls it (the kubelet's liveness probe is always admitted).
    for port in operator.ports.values():
        assert allowed(policies, Pod("monitoring"), operator, port)
        assert not allowed(policies, vllm, operator, port)


def test_chart_values_reach_the_cachecluster_and_its_policies():
    policies, docs = chart("--set", "networkPolicy.monitoringNamespace=observability",
                           "--set", "networkPolicy.clientNamespaces={serving}")
    spec = ClusterSpec.from_dict(docs[("CacheCluster", "kv-cache")]["spec"])
    assert (spec.network_policy.monitoring_namespace, spec.network_policy.client_namespaces) == (
        "observability", ("serving",))
    etcd = pod_of(docs[("StatefulSet", "kv-kvring-etcd")], NAMESPACE)
    assert allowed(policies, Pod("serving", {CLIENT_LABEL: "true"}), etcd, etcd.port("client"))
    assert allowed(policies, Pod("observability"), etcd, etcd.port("metrics"))
    assert not allowed(policies, Pod("monitoring"), etcd, etcd.port("metrics"))
    # A CacheCluster spec that sets its own networkPolicy keeps it.
    _, own = chart("--set", "cacheCluster.spec.networkPolicy.enabled=false")
    assert own[("CacheCluster", "kv-cache")]["spec"]["networkPolicy"] == {"enabled": False}


def test_chart_with_the_policy_off_renders_none_and_its_cachecluster_gets_none():
    docs = template(*EVERYTHING, "--set", "networkPolicy.enabled=false")
    assert [d for d in docs if d["kind"] == "NetworkPolicy"] == []
    spec = ClusterSpec.from_dict(by_kind(docs)[("CacheCluster", "kv-cache")]["spec"])
    assert not spec.network_policy.enabled
    assert render_network_policies("kv-cache", NAMESPACE, spec) == []
    # On (the default), the chart renders one per part it runs.
    assert sorted(p["metadata"]["name"] for p in chart()[0]) == ["kv-kvring-admin", "kv-kvring-etcd",
                                                                  "kv-kvring-operator"]
