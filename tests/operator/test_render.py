"""Render functions on plain data: each spec field that changes an object, and what every object
must hold (names, labels, probes, security, the node and etcd command lines).

Rendered objects are validated against the Kubernetes 1.35 schemas (``kubernetes-validate``,
strict: unknown fields fail), and the node command line is parsed by the real ``kvring`` CLI.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import kubernetes_validate
import pytest
import typer
from crd_schema import load_examples

from kvring.cachenode.disk.tier import DiskConfig, Eviction
from kvring.cli.main import app
from kvring.connector.config import ConnectorConfig
from kvring.operator.render import (
    CONFIG_HASH_ANNOTATION,
    cluster_key,
    connector_config,
    connector_json,
    etcd_endpoints,
    node_id,
    pod_memory,
    render_children,
    render_etcd,
    render_statefulset,
    selector,
)
from kvring.operator.spec import DISK_EVICTIONS, ClusterSpec, SpecError

K8S_VERSION = "1.35.0"
BASE = {"memoryPerNode": "1Gi"}
SELECTOR = {"app.kubernetes.io/name": "kvring", "app.kubernetes.io/instance": "kv",
            "app.kubernetes.io/component": "cachenode"}


def spec_of(**patch) -> ClusterSpec:
    return ClusterSpec.from_dict({**BASE, **patch})


def children(spec: ClusterSpec, name: str = "kv", namespace: str = "ns") -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render_children(name, namespace, spec)}


def sts(c):
    return c[("StatefulSet", "kv")]


def pod(c):
    return sts(c)["spec"]["template"]["spec"]


def _after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def ctr(c):
    return pod(c)["containers"][0]


def arg(c, flag):
    args = ctr(c)["args"]
    return args[args.index(flag) + 1] if flag in args else None


def port(obj, name):
    ports = obj["spec"]["ports"] if "spec" in obj else obj["ports"]
    return next(p.get("containerPort", p.get("port")) for p in ports if p["name"] == name)


def etcd_sts(c):
    return c.get(("StatefulSet", "kv-etcd"))


def relay(c):
    """The event stream's container (None when the spec turns it off)."""
    deployment = c.get(("Deployment", "kv-events"))
    return deployment["spec"]["template"]["spec"]["containers"][0] if deployment else None


def relay_arg(c, flag):
    args = relay(c)["args"]
    return args[args.index(flag) + 1] if flag in args else None


# (spec patch, what it changes, the value expected after the change).  The same getter on the
# default spec must give something else, so each row shows the field reaching the object.
FIELDS = [
    pytest.param({"replicas": 5}, lambda c: sts(c)["spec"]["replicas"], 5, id="replicas"),
    pytest.param({"image": "registry.example.com/kvring:9"}, lambda c: ctr(c)["image"],
                 "registry.example.com/kvring:9", id="image"),
    pytest.param({"imagePullPolicy": "Always"}, lambda c: ctr(c)["imagePullPolicy"], "Always", id="imagePullPolicy"),
    pytest.param({"memoryPerNode": "8Gi"}, lambda c: (arg(c, "--memory"), ctr(c)["resources"]["limits"]["memory"],
                                                     ctr(c)["resources"]["requests"]["memory"]),
                 (str(8 << 30), "10496Mi", "10496Mi"), id="memoryPerNode"),
    pytest.param({"resources": {"limits": {"cpu": "4"}, "requests": {"ephemeral-storage": "2Gi"}}},
                 lambda c: ctr(c)["resources"],
                 {"requests": {"ephemeral-storage": "2Gi", "memory": "1536Mi"}, "limits": {"cpu": "4", "memory": "1536Mi"}},
                 id="resources"),
    pytest.param({"chunkSize": 512}, lambda c: (arg(c, "--chunk-size"),
                                                json.loads(c[("ConfigMap", "kv-config")]["data"]["contract.json"])["chunk_size"],
                                                json.loads(c[("ConfigMap", "kv-config")]["data"]["kv-transfer-config"])
                                                ["kv_connector_extra_config"]["chunk_size"]),
                 ("512", 512, 512), id="chunkSize"),
    pytest.param({"virtualNodes": 64}, lambda c: arg(c, "--vnodes"), "64", id="virtualNodes"),
    pytest.param({"replication": 2}, lambda c: (arg(c, "--replication"),
                                                json.loads(c[("ConfigMap", "kv-config")]["data"]["contract.json"])["replication"]),
                 ("2", 2), id="replication"),
    pytest.param({"evictionPolicy": "fifo"}, lambda c: arg(c, "--policy"), "fifo", id="evictionPolicy"),
    pytest.param({"leaseTtlSeconds": 30}, lambda c: arg(c, "--lease-ttl"), "30", id="leaseTtlSeconds"),
    pytest.param({"drainTimeoutSeconds": 300},
                 lambda c: (pod(c)["terminationGracePeriodSeconds"], ctr(c)["lifecycle"]["preStop"]["exec"]["command"][-2:]),
                 (330, ["--wait", "300"]), id="drainTimeoutSeconds"),
    pytest.param({"etcd": {"endpoints": ["etcd-a.infra:2379", "http://etcd-b.infra:2379"]}},
                 lambda c: (arg(c, "--etcd"), etcd_sts(c), c[("ConfigMap", "kv-config")]["data"]["etcd"]),
                 ("etcd-a.infra:2379,etcd-b.infra:2379", None, "etcd-a.infra:2379,etcd-b.infra:2379"),
                 id="etcd.endpoints"),
    pytest.param({"etcd": {"managed": {"members": 3}}},
                 lambda c: (etcd_sts(c)["spec"]["replicas"], ("PodDisruptionBudget", "kv-etcd") in c),
                 (3, True), id="etcd.managed.members"),
    pytest.param({"etcd": {"managed": {"storage": "5Gi"}}},
                 lambda c: etcd_sts(c)["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"],
                 "5Gi", id="etcd.managed.storage"),
    pytest.param({"etcd": {"managed": {"storageClassName": "fast-ssd"}}},
                 lambda c: etcd_sts(c)["spec"]["volumeClaimTemplates"][0]["spec"].get("storageClassName"),
                 "fast-ssd", id="etcd.managed.storageClassName"),
    pytest.param({"etcd": {"managed": {"image": "registry.k8s.io/etcd:3.5.21-0"}}},
                 lambda c: etcd_sts(c)["spec"]["template"]["spec"]["containers"][0]["image"],
                 "registry.k8s.io/etcd:3.5.21-0", id="etcd.managed.image"),
    pytest.param({"tls": False},
                 lambda c: ("--tls-dir" in ctr(c)["args"], [v["name"] for v in pod(c)["volumes"]],
                            [m["mountPath"] for m in ctr(c)["volumeMounts"]],
                            "tls_dir" in json.loads(c[("ConfigMap", "kv-config")]["data"]["kv-transfer-config"])
                            ["kv_connector_extra_config"]),
                 (False, ["tmp", "node-token"], ["/tmp", "/etc/kvring/node-token"], False), id="tls"),
    pytest.param({"authSecret": "kv-admin"}, lambda c: c[("ConfigMap", "kv-config")]["data"].get("admin-token-secret"),
                 "kv-admin", id="authSecret"),
    pytest.param({"ports": {"data": 6000}},
                 lambda c: (arg(c, "--data-port"), port(ctr(c), "data"), port(c[("Service", "kv-nodes")], "data"),
                            port(c[("Service", "kv")], "data")),
                 ("6000", 6000, 6000, 6000), id="ports.data"),
    pytest.param({"ports": {"admin": 9000}},
                 lambda c: (arg(c, "--admin-port"), port(ctr(c), "admin"), port(c[("Service", "kv")], "admin"),
                            _after(ctr(c)["lifecycle"]["preStop"]["exec"]["command"], "--admin"),
                            sts(c)["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]),
                 ("9000", 9000, 9000, "https://127.0.0.1:9000", "9000"), id="ports.admin"),
    pytest.param({"ports": {"events": 7000, "eventsReplay": 7001}},
                 lambda c: (arg(c, "--events-port"), port(ctr(c), "events"), port(c[("Service", "kv-nodes")], "events"),
                            arg(c, "--events-replay-port"), port(ctr(c), "events-replay"),
                            port(c[("Service", "kv-nodes")], "events-replay")),
                 ("7000", 7000, 7000, "7001", 7001, 7001), id="ports.events"),
    pytest.param({"nodeSelector": {"pool": "cache"}}, lambda c: pod(c).get("nodeSelector"), {"pool": "cache"},
                 id="nodeSelector"),
    pytest.param({"tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]},
                 lambda c: pod(c).get("tolerations"), [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                 id="tolerations"),
    pytest.param({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cache"]}]}]}}}},
                 lambda c: pod(c)["affinity"],
                 {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cache"]}]}]}}},
                 id="affinity"),
    pytest.param({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                                 "whenUnsatisfiable": "DoNotSchedule"}]},
                 lambda c: pod(c).get("topologySpreadConstraints"),
                 [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
                   "labelSelector": {"matchLabels": SELECTOR}}],
                 id="topologySpreadConstraints"),
    pytest.param({"disk": {"size": "100Gi", "storageClassName": "local-nvme"}},
                 lambda c: (arg(c, "--disk-dir"), arg(c, "--disk-capacity"),
                            [m["mountPath"] for m in ctr(c)["volumeMounts"]][-1],
                            sts(c)["spec"].get("volumeClaimTemplates"), sts(c)["spec"]["updateStrategy"]),
                 ("/var/lib/kvring/disk", str(int((100 << 30) * 0.9)), "/var/lib/kvring",
                  [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                    "metadata": {"name": "disk", "labels": {**SELECTOR, "app.kubernetes.io/managed-by": "kvring-operator"}},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Gi"}},
                             "storageClassName": "local-nvme"}}],
                  {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}),
                 id="disk"),
    pytest.param({"disk": {"size": "100Gi", "capacity": "50Gi"}}, lambda c: arg(c, "--disk-capacity"),
                 str(50 << 30), id="disk.capacity"),
    pytest.param({"disk": {"size": "100Gi", "scrubRate": "0", "scrubIntervalSeconds": 3600}},
                 lambda c: (arg(c, "--disk-scrub-rate"), arg(c, "--disk-scrub-interval")), ("0", "3600"),
                 id="disk.scrub"),
    pytest.param({"networkPolicy": {"enabled": False}}, lambda c: [n for k, n in c if k == "NetworkPolicy"], [],
                 id="networkPolicy.enabled"),
    pytest.param({"poolEvents": {"enabled": False}},
                 lambda c: [key for key in c if key[1] == "kv-events"], [], id="poolEvents.enabled"),
    pytest.param({"poolEvents": {"port": 6557, "replayPort": 6558}},
                 lambda c: (relay_arg(c, "--port"), port(relay(c), "events"), port(c[("Service", "kv-events")], "events"),
                            relay_arg(c, "--replay-port"), port(relay(c), "events-replay"),
                            port(c[("Service", "kv-events")], "events-replay"),
                            [p["port"] for p in c[("NetworkPolicy", "kv-events")]["spec"]["ingress"][0]["ports"]]),
                 ("6557", 6557, 6557, "6558", 6558, 6558, [6557, 6558]), id="poolEvents.ports"),
    pytest.param({"poolEvents": {"topic": "kv"}}, lambda c: relay_arg(c, "--topic"), "kv", id="poolEvents.topic"),
    pytest.param({"poolEvents": {"resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}}},
                 lambda c: relay(c)["resources"], {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}},
                 id="poolEvents.resources"),
    pytest.param({"networkPolicy": {"monitoringNamespace": "observability", "clientNamespaces": ["serving"]}},
                 lambda c: [peer.get("namespaceSelector") for rule in c[("NetworkPolicy", "kv")]["spec"]["ingress"]
                            for peer in rule["from"] if "namespaceSelector" in peer],
                 [{"matchLabels": {"kubernetes.io/metadata.name": "serving"}},
                  {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}],
                 id="networkPolicy.namespaces"),
]


@pytest.mark.parametrize(("patch", "get", "expected"), FIELDS)
def test_each_field_changes_its_object(patch, get, expected):
    assert get(children(ClusterSpec.from_dict(BASE))) != expected
    changed = children(ClusterSpec.from_dict({**BASE, **patch}))
    assert get(changed) == expected
    for obj in changed.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_spec_field_has_a_render_row():
    from kvring.operator.spec import _SPEC_KEYS

    covered = {p.id.split(".")[0] for p in FIELDS}
    # Read by the status pass, rendered into no object (test_rotation_plan, test_rotation_kmock).
    operator_only = {"rotationStepSeconds"}
    assert covered == set(_SPEC_KEYS) - operator_only


def test_tls_credentials_are_mounted_into_nodes_and_named_to_the_connector():
    c = children(spec_of())
    assert arg(c, "--tls-dir") == "/etc/kvring/tls"
    assert {"name": "tls", "secret": {"secretName": "kv-tls", "defaultMode": 0o440}} in pod(c)["volumes"]
    assert {"name": "tls", "mountPath": "/etc/kvring/tls", "readOnly": True} in ctr(c)["volumeMounts"]
    extra = json.loads(c[("ConfigMap", "kv-config")]["data"]["kv-transfer-config"])["kv_connector_extra_config"]
    assert extra["tls_dir"] == "/etc/kvring/tls"


def test_the_tls_secret_holds_a_working_set_of_credentials(tmp_path):
    """The Secret the operator creates once per cluster: valid, and its files are a CA and a
    certificate it signed, which the node and the connector load as they are."""
    import base64

    from kvring.common.tls import ClusterCredentials, credentials_pem
    from kvring.operator.render import render_tls_secret

    secret = render_tls_secret("kv", "ns", credentials_pem("ns/kv"))
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert (secret["metadata"]["name"], secret["type"]) == ("kv-tls", "kubernetes.io/tls")
    assert sorted(secret["data"]) == ["ca.crt", "tls.crt", "tls.key"]
    for key, value in secret["data"].items():  # what the kubelet writes into the mount
        (tmp_path / key).write_bytes(base64.b64decode(value))
    creds = ClusterCredentials.at(tmp_path)
    assert creds.server_context() and creds.client_context()


def _mount_secrets(pod_spec: dict, secrets: list[dict], root) -> dict[str, str]:
    """Write each Secret volume of ``pod_spec`` that its container mounts, as the kubelet would,
    under ``root``; the mount path -> the directory standing for it."""
    import base64

    by_name = {s["metadata"]["name"]: s for s in secrets}
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod_spec["volumes"] if "secret" in v}
    mounted = {}
    for m in pod_spec["containers"][0]["volumeMounts"]:
        if volumes.get(m["name"]) in by_name:
            where = root / m["name"]
            where.mkdir()
            for key, value in by_name[volumes[m["name"]]]["data"].items():
                (where / key).write_bytes(base64.b64decode(value))
            mounted[m["mountPath"]] = str(where)
    return mounted


def _local(argv: list[str], mounted: dict[str, str]) -> list[str]:
    """``argv`` with paths under a mount turned into the directory standing for it."""
    out = []
    for a in argv:
        for mount, where in mounted.items():
            if a == mount or a.startswith(mount + "/"):
                a = where + a[len(mount):]
        out.append(a)
    return out


@pytest.mark.parametrize("tls", [True, False])
def test_nodes_take_the_node_token_from_its_secret_as_a_file_and_the_configmap_names_it(tls, tmp_path):
    from kvring.operator.render import node_token_secret, render_node_token_secret

    secret = render_node_token_secret("kv", "ns", "t" * 64)
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert (secret["metadata"]["name"], secret["type"]) == ("kv-node-token", "Opaque") == (node_token_secret("kv"),
                                                                                           "Opaque")
    assert secret["metadata"]["labels"] == {**SELECTOR, "app.kubernetes.io/managed-by": "kvring-operator"}
    c = children(spec_of(tls=tls))
    # A file of the Secret's volume, which the kubelet updates in place (a variable would keep the
    # token the pod started with through a rotation).
    assert "KVRING_NODE_TOKEN" not in {e["name"] for e in ctr(c)["env"]}
    mounted = _mount_secrets(pod(c), [secret], tmp_path)
    token_file = _local([arg(c, "--node-token-file")], mounted)[0]
    assert Path(token_file).read_text() == "t" * 64
    drain = ctr(c)["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[drain.index("--node-token-file") + 1] == arg(c, "--node-token-file")
    assert c[("ConfigMap", "kv-config")]["data"]["node-token-secret"] == "kv-node-token"


def test_the_rendered_node_and_prestop_hook_drain_a_real_node(etcd_server, tmp_path):
    """The pod as rendered, run for real: a node given the rendered Secrets' volumes (the TLS
    Secret, so its admin port serves HTTPS, and the node token) refuses a drain without the
    token, and the rendered preStop command (same files, the node's address) drains it."""
    import subprocess
    import sys

    from kvring.common.tls import credentials_pem
    from kvring.local.cluster import NodeProcess
    from kvring.operator.render import render_node_token_secret, render_tls_secret

    c = children(spec_of())
    container = ctr(c)
    mounted = _mount_secrets(pod(c), [render_node_token_secret("kv", "ns", "s" * 48),
                                      render_tls_secret("kv", "ns", credentials_pem("ns/kv"))], tmp_path)
    node_args = _local(container["args"], mounted)
    files = [a for flag in ("--tls-dir", "--node-token-file") for a in node_args[node_args.index(flag):][:2]]
    node = NodeProcess("prestop-0", 16 << 20, etcd_server.endpoint, "render-prestop", extra=files).start()
    try:
        assert node.admin_addr.startswith("https://")
        command = [sys.executable, *_local(container["lifecycle"]["preStop"]["exec"]["command"], mounted)[1:]]
        command[command.index("--admin") + 1] = node.admin_addr
        command[command.index("--wait") + 1] = "20"
        without = command[:command.index("--node-token-file")] + command[command.index("--node-token-file") + 2:]
        refused = subprocess.run(without, capture_output=True, text=True, timeout=60,
                                 env={k: v for k, v in os.environ.items() if k != "KVRING_NODE_TOKEN"})
        assert refused.returncode == 1 and "HTTP 401" in refused.stderr
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{node.admin_addr} drained" in done.stdout
    finally:
        node.stop()


def test_children_in_apply_order():
    managed = [(o["kind"], o["metadata"]["name"]) for o in render_children("kv", "ns", spec_of())]
    assert managed == [("ConfigMap", "kv-config"), ("NetworkPolicy", "kv"), ("NetworkPolicy", "kv-events"),
                       ("NetworkPolicy", "kv-etcd"), ("Service", "kv-etcd-peer"), ("Service", "kv-etcd"),
                       ("StatefulSet", "kv-etcd"), ("Service", "kv-events"), ("Deployment", "kv-events"),
                       ("Service", "kv-nodes"), ("Service", "kv"), ("PodDisruptionBudget", "kv"), ("StatefulSet", "kv")]
    external = render_children("kv", "ns", spec_of(etcd={"endpoints": ["e:2379"]}))
    assert [o["metadata"]["name"] for o in external] == ["kv-config", "kv", "kv-events", "kv-events", "kv-events",
                                                         "kv-nodes", "kv", "kv", "kv"]
    for obj in render_children("kv", "ns", spec_of()):
        assert obj["metadata"]["namespace"] == "ns"
        assert "ownerReferences" not in obj["metadata"]  # the handlers adopt them


@pytest.mark.parametrize("example", sorted(load_examples()))
def test_examples_render_to_valid_objects(example):
    cr = load_examples()[example]
    namespace = cr["metadata"].get("namespace", "default")
    objects = render_children(cr["metadata"]["name"], namespace, ClusterSpec.from_dict(cr["spec"]))
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_strict_validation_catches_unknown_fields():
    """Guard for the checks above: strict mode really refuses a misspelt field."""
    obj = copy.deepcopy(render_statefulset("kv", "ns", spec_of()))
    obj["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_statefulset_runs_stable_secure_nodes():
    c = children(spec_of(drainTimeoutSeconds=60))
    s = sts(c)
    labels = {**SELECTOR, "app.kubernetes.io/managed-by": "kvring-operator"}
    assert s["metadata"]["labels"] == labels
    assert s["spec"]["selector"] == {"matchLabels": SELECTOR}
    assert s["spec"]["template"]["metadata"]["labels"] == labels
    assert s["spec"]["serviceName"] == "kv-nodes"
    assert s["spec"]["podManagementPolicy"] == "Parallel"
    p, container = pod(c), ctr(c)
    # Node id = pod name = <name>-<ordinal>, advertised under its stable DNS name.
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    assert arg(c, "--node-id") == "$(POD_NAME)"
    assert arg(c, "--advertise-host") == "$(POD_NAME).kv-nodes.ns.svc"
    assert arg(c, "--cluster") == "ns.kv" == cluster_key("kv", "ns")
    assert arg(c, "--host") == "0.0.0.0"
    # TLS (the default): the admin port serves HTTPS, which the probes use (without checking the
    # certificate) and the preStop drain checks against the mounted CA.
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin", "scheme": "HTTPS"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin", "scheme": "HTTPS"}
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "python", "-P", "-m", "kvring.cli", "drain", "--admin", "https://127.0.0.1:8080",
        "--tls-dir", "/etc/kvring/tls", "--node-token-file", "/etc/kvring/node-token/token", "--wait", "60"]
    assert s["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    plain = ctr(children(spec_of(drainTimeoutSeconds=60, tls=False)))
    assert plain["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "admin", "scheme": "HTTP"}
    assert plain["lifecycle"]["preStop"]["exec"]["command"] == [
        "python", "-P", "-m", "kvring.cli", "drain", "--admin", "http://127.0.0.1:8080",
        "--node-token-file", "/etc/kvring/node-token/token", "--wait", "60"]
    assert p["terminationGracePeriodSeconds"] >= 60 + 30
    assert p["securityContext"]["runAsNonRoot"] is True
    assert p["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in p["volumes"]
    assert p["automountServiceAccountToken"] is False
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "1536Mi"}, "limits": {"memory": "1536Mi"}}
    # Without an affinity of its own, the nodes prefer distinct hosts.
    term = p["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term == {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": SELECTOR}}


def test_node_command_line_parses_with_the_real_cli():
    """Every flag the StatefulSet passes exists in ``kvring node`` and has a value it accepts."""
    c = children(spec_of(memoryPerNode="2Gi", chunkSize=128, replication=2, evictionPolicy="fifo"))
    container = ctr(c)
    assert container["command"] == ["python", "-P", "-m", "kvring.cli"]
    args = [a.replace("$(POD_NAME)", "kv-0") for a in container["args"]]
    command = typer.main.get_command(app)
    ctx = command.make_context("kvring", list(args), resilient_parsing=False)
    sub = command.get_command(ctx, args[0])
    params = sub.make_context(args[0], args[1:], parent=ctx).params
    assert params["node_id"] == "kv-0" == node_id("kv", 0)
    assert params["etcd"] == "kv-etcd.ns.svc:2379"
    assert (params["memory"], params["chunk_size"], params["replication"], params["policy"]) == (str(2 << 30), 128, 2, "fifo")
    assert (params["data_port"], params["admin_port"], params["lease_ttl"]) == (5555, 8080, 10)
    assert params["advertise_host"] == "kv-0.kv-nodes.ns.svc"


def test_disk_flags_parse_with_the_real_cli():
    spec = spec_of(disk={"size": "10Gi", "scrubRate": "32Mi", "scrubIntervalSeconds": 600, "eviction": "fifo"})
    args = [a.replace("$(POD_NAME)", "kv-0") for a in ctr(children(spec))["args"]]
    command = typer.main.get_command(app)
    ctx = command.make_context("kvring", list(args), resilient_parsing=False)
    params = command.get_command(ctx, args[0]).make_context(args[0], args[1:], parent=ctx).params
    assert (params["disk_dir"], params["disk_capacity"]) == ("/var/lib/kvring/disk", str(9 * (1 << 30)))
    assert (params["disk_scrub_rate"], params["disk_scrub_interval"]) == (str(32 << 20), 600.0)
    assert DiskConfig(params["disk_dir"], 1 << 30, eviction=params["disk_eviction"]).eviction is Eviction.FIFO
    assert set(DISK_EVICTIONS) == {e.value for e in Eviction}  # the CRD's choices are the node's


def test_a_disk_cluster_holds_its_partition_for_the_operator():
    held = render_statefulset("kv", "ns", spec_of(disk={"size": "10Gi"}), partition=3)
    assert held["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 3}}
    assert held["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    kubernetes_validate.validate(held, K8S_VERSION, strict=True)
    # Without a disk the controller rolls by itself (each pod drains on its way out).
    assert render_statefulset("kv", "ns", spec_of(), partition=3)["spec"]["updateStrategy"] == {"type": "RollingUpdate"}


def test_prestop_drain_parses_with_the_real_cli():
    command = typer.main.get_command(app)
    ctx = command.make_context("kvring", ["drain"], resilient_parsing=True)
    drain = command.get_command(ctx, "drain")
    if drain is None:
        pytest.skip("`kvring drain` (the node drain command) is not in this checkout yet")
    argv = ctr(children(spec_of()))["lifecycle"]["preStop"]["exec"]["command"][4:]
    drain.make_context("drain", argv[1:], parent=ctx)


def test_replicas_override_keeps_leaving_nodes():
    assert render_statefulset("kv", "ns", spec_of(replicas=2), replicas=4)["spec"]["replicas"] == 4
    assert render_statefulset("kv", "ns", spec_of(replicas=2))["spec"]["replicas"] == 2
    assert [o["spec"]["replicas"] for o in render_children("kv", "ns", spec_of(replicas=2), replicas=4)
            if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "kv"] == [4]


def test_services_and_pdb():
    c = children(spec_of())
    headless, client, pdb = c[("Service", "kv-nodes")], c[("Service", "kv")], c[("PodDisruptionBudget", "kv")]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == client["spec"]["selector"] == SELECTOR
    assert [p["name"] for p in client["spec"]["ports"]] == ["data", "admin", "events", "events-replay"]
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": SELECTOR}}
    assert selector("kv") == ("app.kubernetes.io/name=kvring,app.kubernetes.io/instance=kv,"
                              "app.kubernetes.io/component=cachenode")


def test_connector_config_is_what_the_connector_accepts():
    spec = spec_of(chunkSize=512)
    cfg = connector_config("kv", "ns", spec)
    assert cfg == {"kv_connector": "KVRingConnector", "kv_connector_module_path": "kvring.connector",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"etcd": "kv-etcd.ns.svc:2379", "cluster": "ns.kv", "chunk_size": 512,
                                                 "tls_dir": "/etc/kvring/tls"}}
    assert json.loads(connector_json("kv", "ns", spec)) == cfg
    from vllm.config import KVTransferConfig  # the flag is one vLLM itself accepts

    assert KVTransferConfig(**cfg).kv_load_failure_policy == "recompute"
    connector = ConnectorConfig.from_sources(cfg["kv_connector_extra_config"], environ={})
    assert (connector.etcd, connector.cluster, connector.chunk_size, connector.tls_dir) == (
        "kv-etcd.ns.svc:2379", "ns.kv", 512, "/etc/kvring/tls")
    configmap = children(spec)[("ConfigMap", "kv-config")]
    assert configmap["data"]["kv-transfer-config"] == connector_json("kv", "ns", spec)
    assert configmap["data"]["cluster"] == "ns.kv"


def test_etcd_endpoints():
    assert etcd_endpoints("kv", "ns", spec_of()) == ["kv-etcd.ns.svc:2379"]
    assert etcd_endpoints("kv", "ns", spec_of(etcd={"endpoints": ["http://a:1", "b:2"]})) == ["a:1", "b:2"]


def test_config_hash_rolls_nodes_when_the_contract_changes():
    def stamp(**patch):
        return sts(children(spec_of(**patch)))["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]

    base = stamp()
    assert len(base) == 16 and base == stamp()
    assert stamp(replicas=7) == base  # scaling is not a config change
    assert stamp(authSecret="kv-admin") == base  # the nodes do not use the admin token
    assert len({base, stamp(chunkSize=128), stamp(virtualNodes=8), stamp(replication=2),
                stamp(etcd={"endpoints": ["e:2379"]})}) == 5


@pytest.mark.parametrize(("budget", "pod"), [
    (64 << 20, "336Mi"), (1 << 30, "1536Mi"), (4 << 30, "5376Mi"), (10**9, "1449Mi"),
])
def test_memory_rule(budget, pod):
    """Pod memory = budget x 1.25 + 256Mi, rounded up to a MiB."""
    assert pod_memory(budget) == pod


def test_managed_etcd_is_a_real_three_member_cluster():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render_etcd("kv", "ns", spec_of(etcd={"managed": {"members": 3}}))}
    s = objs[("StatefulSet", "kv-etcd")]
    peer = objs[("Service", "kv-etcd-peer")]
    assert s["spec"]["serviceName"] == "kv-etcd-peer"
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"] is True
    assert s["spec"]["podManagementPolicy"] == "Parallel"
    args = dict(a.removeprefix("--").split("=", 1) for a in s["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args["initial-cluster"] == ",".join(
        f"kv-etcd-{i}=http://kv-etcd-{i}.kv-etcd-peer.ns.svc:2380" for i in range(3))
    assert args["name"] == "$(POD_NAME)"
    assert args["initial-advertise-peer-urls"] == "http://$(POD_NAME).kv-etcd-peer.ns.svc:2380"
    assert args["initial-cluster-state"] == "new"
    assert args["data-dir"].startswith("/var/lib/etcd/")
    claim = s["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    client = objs[("Service", "kv-etcd")]
    assert [p["port"] for p in client["spec"]["ports"]] == [2379]
    assert s["spec"]["selector"]["matchLabels"] == client["spec"]["selector"] == peer["spec"]["selector"]
    assert s["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "etcd"
    assert objs[("PodDisruptionBudget", "kv-etcd")]["spec"]["maxUnavailable"] == 1


def test_single_member_etcd_has_no_pdb():
    kinds = [o["kind"] for o in render_etcd("kv", "ns", spec_of())]
    assert kinds == ["Service", "Service", "StatefulSet"]


def test_external_etcd_renders_nothing():
    assert render_etcd("kv", "ns", spec_of(etcd={"endpoints": ["etcd.infra:2379"]})) == []


def test_renders_are_pure():
    spec = spec_of(tolerations=[{"key": "a", "operator": "Exists"}],
                   topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}])
    first = render_children("kv", "ns", spec)
    pod_spec = first[-1]["spec"]["template"]["spec"]
    pod_spec["tolerations"][0]["key"] = "changed"
    pod_spec["topologySpreadConstraints"][0]["maxSkew"] = 9
    assert spec.tolerations[0]["key"] == "a"
    assert "labelSelector" not in spec.topology_spread[0]
    assert render_children("kv", "ns", spec) != first
    assert render_children("kv", "ns", spec) == render_children("kv", "ns", spec)


def test_bad_name_is_a_spec_error():
    with pytest.raises(SpecError, match="metadata.name 'Kv_Cache'"):
        render_children("Kv_Cache", "ns", spec_of())


def test_node_pods_carry_scrape_annotations_for_their_metrics():
    meta = sts(children(spec_of()))["spec"]["template"]["metadata"]
    assert meta["annotations"]["prometheus.io/scrape"] == "true"
    assert meta["annotations"]["prometheus.io/path"] == "/metrics"
    assert meta["annotations"]["prometheus.io/port"] == str(port(ctr(children(spec_of())), "admin"))
