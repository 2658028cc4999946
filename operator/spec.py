"""The CacheCluster spec, read once into frozen dataclasses.

``ClusterSpec.from_dict(cr["spec"])`` applies the defaults the CRD schema declares
(``crds/cachecluster.yaml``; a test holds the two to the same values) and checks everything the
operator relies on.  It repeats the schema's checks, because the operator also meets specs that
never went through an API server's validation (older CRD versions, emulators in tests), and it
adds what the schema cannot express: a budget below the minimum, replication above replicas, a
data port equal to the admin port, memory set by hand in ``resources``.  Every problem found is
listed in one ``SpecError``, each saying what to set instead.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

GROUP = "kvring.io"
VERSION = "v1alpha1"
KIND = "CacheCluster"
PLURAL = "cacheclusters"
SHORT_NAMES = ["kvc"]

MIN_MEMORY = 64 << 20  # a node below this holds too few chunks to be worth a pod
MAX_NAME_LENGTH = 40  # pods are <name>-<ordinal> behind <name>-nodes; etcd peers <name>-etcd-<i>
CHUNK_SIZES = tuple(2**i for i in range(4, 13))  # 16 .. 4096
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
EVICTION_POLICIES = ("lru", "fifo")
DISK_EVICTIONS = ("second-chance", "fifo")  # the node's --disk-eviction (``cachenode.disk.tier.Eviction``)
ETCD_MEMBERS = (1, 3)
DEFAULT_IMAGE = "kvring:0.1.0"
DEFAULT_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"

_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_BYTES = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                       r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_ENDPOINT = re.compile(r"^(http://)?[^\s,/]+:[0-9]{1,5}$")
_SUFFIX = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_FRACTIONS = {"m": Decimal("1e-3"), "u": Decimal("1e-6"), "n": Decimal("1e-9")}
_TOLERATION_OPERATORS = ("Exists", "Equal")
_TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
_SPREAD_WHEN = ("DoNotSchedule", "ScheduleAnyway")


class SpecError(ValueError):
    """A CacheCluster spec the operator cannot run; the message lists every problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid CacheCluster spec:\n  - " + "\n  - ".join(self.problems))


def parse_bytes(text: str) -> int:
    """Bytes in a Kubernetes quantity without milli units (``4Gi``, ``512Mi``, ``1.5G``, ``1000``)."""
    m = _BYTES.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"{text!r} is not a byte quantity; write e.g. 4Gi, 512Mi or 1000000000")
    return int(float(m.group(1)) * _SUFFIX[m.group(2)])


def _quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity (``500m``, ``2``, ``4Gi``, ``1e3``) as a number, or None if it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    m = _QUANTITY.match(str(value))
    if not m:
        return None
    if m.group(8):  # an exponent: 1e3
        return Decimal(str(value))
    suffix = m.group(6)
    scale = _FRACTIONS[suffix] if suffix in _FRACTIONS else Decimal(_SUFFIX[suffix])
    return Decimal((m.group(1) or "") + m.group(2)) * scale


def check_name(name: str) -> str:
    """The CacheCluster's own name, which every child object's name is built from."""
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > MAX_NAME_LENGTH:
        raise SpecError([f"metadata.name {name!r} must be a DNS label of at most {MAX_NAME_LENGTH} "
                         "characters that starts with a letter (e.g. kv-cache)"])
    return name


@dataclass(frozen=True)
class EtcdSpec:
    """External endpoints, or an etcd the operator runs (``managed``)."""

    endpoints: tuple[str, ...] = ()
    managed: bool = True
    members: int = 1
    storage: str = "1Gi"
    storage_class: str | None = None
    image: str = DEFAULT_ETCD_IMAGE


DISK_MOUNT = "/var/lib/kvring"  # where each node's volume is mounted; the node's --disk-dir is <mount>/disk
DISK_FILL = 0.9  # the share of its volume a node may fill with chunks unless spec.disk.capacity says otherwise
MIN_DISK = 1 << 30
MAX_INT32 = (1 << 31) - 1  # the CRD's integers are int32


@dataclass(frozen=True)
class DiskSpec:
    """A volume per node (a StatefulSet claim template) holding the node's disk tier."""

    size: str  # the claim's request, as written (e.g. 100Gi)
    size_bytes: int
    capacity: int  # bytes of chunks the node may keep there (--disk-capacity)
    storage_class: str | None = None
    scrub_rate: int | None = None  # --disk-scrub-rate in bytes a second (0: off); None: the node's default
    scrub_interval_seconds: int | None = None  # --disk-scrub-interval; None: the node's default
    eviction: str | None = None  # --disk-eviction; None: the node's default (second-chance)


DEFAULT_MONITORING_NAMESPACE = "monitoring"
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class NetworkPolicySpec:
    """Who may reach the nodes and the managed etcd (``render_policy``): kvring's own pods, pods
    labelled as clients in the cluster's namespace and in ``client_namespaces``, and, on the
    metrics ports, pods in ``monitoring_namespace``.  Off: no NetworkPolicy, every pod may."""

    enabled: bool = True
    monitoring_namespace: str = DEFAULT_MONITORING_NAMESPACE
    client_namespaces: tuple[str, ...] = ()


# The relay's container.  Its memory is bounded by the pool it follows, not by traffic: the
# process itself (~70 MiB RSS measured: interpreter, zmq, the etcd client), the publisher's replay
# buffer (at most 64 MiB of encoded batches) and send queue (at most 100,000 events), and the
# ledger of what the pool holds (each block's hashes and token ids: 40-75 bytes per token per copy
# held, measured; under 1% of the pool's memory for a model whose KV takes 8 KiB or more per
# token, a 1B Llama's is 32 KiB).  512Mi leaves room for ~4M tokens held; a larger pool needs a
# higher limit.  An OOM restart costs routers only a resync (each start of the stream begins with
# AllBlocksCleared).
DEFAULT_POOL_EVENTS_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}


@dataclass(frozen=True)
class PoolEventsSpec:
    """The pool's KV events as one stream for KV-aware routers (``kvring events``), which the
    operator runs as the Deployment and Service ``<name>-events`` (``render_events``).  Off: not
    run, and what the operator made is deleted."""

    enabled: bool = True
    port: int = 5557  # ZMQ PUB (an XPUB: a new subscriber gets the whole pool)
    replay_port: int = 5558  # ZMQ ROUTER replaying the stream's recent batches
    topic: str = ""  # the topic frame of every message
    resources: dict[str, dict[str, str | int]] = field(
        default_factory=lambda: {part: dict(items) for part, items in DEFAULT_POOL_EVENTS_RESOURCES.items()})


@dataclass(frozen=True)
class ClusterSpec:
    """A validated CacheCluster spec with every default applied."""

    memory_per_node: int  # bytes of chunk payload per node (--memory)
    memory_per_node_raw: str  # the quantity as written, for display
    replicas: int = 3
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    resources: dict[str, dict[str, str | int]] = field(default_factory=dict)  # extra, never memory
    chunk_size: int = 256
    vnodes: int = 1024
    replication: int = 1
    policy: str = "lru"
    lease_ttl: int = 10
    drain_timeout_seconds: int = 120
    # Seconds each step of a credentials rotation stays in place at least, once every node has
    # taken it: for the clients the operator cannot see (vLLM pods mounting the Secrets).
    rotation_step_seconds: int = 120
    etcd: EtcdSpec = field(default_factory=EtcdSpec)
    auth_secret: str | None = None
    data_port: int = 5555
    admin_port: int = 8080
    events_port: int = 5557  # the node's KV events (ZMQ PUB)
    events_replay_port: int = 5558  # their replay (ZMQ ROUTER)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    topology_spread: tuple[dict[str, Any], ...] = ()
    tls: bool = True  # mutual TLS on the data plane, with credentials in the Secret <name>-tls
    disk: DiskSpec | None = None  # a disk tier on a volume per node; None: memory only
    network_policy: NetworkPolicySpec = field(default_factory=NetworkPolicySpec)
    pool_events: PoolEventsSpec = field(default_factory=PoolEventsSpec)

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | None) -> ClusterSpec:
        """Read ``cr["spec"]`` (camelCase, as in YAML); raise ``SpecError`` listing every problem."""
        return _Reader(spec).read()


_SPEC_KEYS = ("replicas", "image", "imagePullPolicy", "memoryPerNode", "resources", "chunkSize",
              "virtualNodes", "replication", "evictionPolicy", "leaseTtlSeconds", "drainTimeoutSeconds",
              "rotationStepSeconds", "etcd", "authSecret", "ports", "nodeSelector", "tolerations", "affinity",
              "topologySpreadConstraints", "tls", "disk", "networkPolicy", "poolEvents")


class _Reader:
    """Walks one spec, collecting problems instead of stopping at the first."""

    def __init__(self, spec: Any):
        self.problems: list[str] = []
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            self.problems.append(f"spec must be an object, got {type(spec).__name__}")
            spec = {}
        self.spec = spec

    def read(self) -> ClusterSpec:
        s = self.spec
        self._unknown(s, _SPEC_KEYS, "spec")
        values: dict[str, Any] = {
            "replicas": self._int(s, "replicas", 3, 0, 1000),
            "image": self._str(s, "image", DEFAULT_IMAGE),
            "image_pull_policy": self._enum(s, "imagePullPolicy", "IfNotPresent", PULL_POLICIES),
            "resources": self._resources(s.get("resources")),
            "chunk_size": self._enum(s, "chunkSize", 256, CHUNK_SIZES),
            "vnodes": self._int(s, "virtualNodes", 1024, 1, 65536),
            "replication": self._int(s, "replication", 1, 1, 16),
            "policy": self._enum(s, "evictionPolicy", "lru", EVICTION_POLICIES),
            "lease_ttl": self._int(s, "leaseTtlSeconds", 10, 2, 300),
            "drain_timeout_seconds": self._int(s, "drainTimeoutSeconds", 120, 0, 3600),
            "rotation_step_seconds": self._int(s, "rotationStepSeconds", 120, 0, 86400),
            "etcd": self._etcd(s.get("etcd")),
            "auth_secret": self._str(s, "authSecret", None),
            "node_selector": self._node_selector(s.get("nodeSelector")),
            "tolerations": self._tolerations(s.get("tolerations")),
            "affinity": self._affinity(s.get("affinity")),
            "topology_spread": self._spread(s.get("topologySpreadConstraints")),
            "tls": self._enum(s, "tls", True, (True, False)),
            "disk": self._disk(s.get("disk")),
            "network_policy": self._network_policy(s.get("networkPolicy")),
            "pool_events": self._pool_events(s.get("poolEvents")),
        }
        values["memory_per_node_raw"], values["memory_per_node"] = self._memory(s)
        (values["data_port"], values["admin_port"], values["events_port"],
         values["events_replay_port"]) = self._ports(s.get("ports"))
        if 0 < values["replicas"] < values["replication"]:  # 0: scaled to zero, nothing to place
            self.problems.append(f"spec.replication {values['replication']} exceeds spec.replicas "
                                 f"{values['replicas']}: every chunk needs that many distinct nodes; "
                                 "raise replicas or lower replication")
        if self.problems:
            raise SpecError(self.problems)
        return ClusterSpec(**values)

    # -- scalars ---------------------------------------------------------------------------------

    def _unknown(self, obj: dict, known: tuple[str, ...], where: str) -> None:
        for key in sorted(set(obj) - set(known), key=str):
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(known)}"
            self.problems.append(f"{where}.{key} is not a known field; {hint}")

    def _int(self, obj: dict, key: str, default: int, lo: int, hi: int, where: str = "spec") -> int:
        value = obj.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{where}.{key} must be an integer, got {value!r}")
            return default
        if not lo <= value <= hi:
            self.problems.append(f"{where}.{key} must be between {lo} and {hi}, got {value}")
        return value

    def _str(self, obj: dict, key: str, default: str | None, where: str = "spec") -> str | None:
        value = obj.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            self.problems.append(f"{where}.{key} must be a non-empty string, got {value!r}")
            return default
        return value

    def _enum(self, obj: dict, key: str, default: Any, allowed: tuple, where: str = "spec") -> Any:
        value = obj.get(key, default)
        if isinstance(value, bool) is not isinstance(allowed[0], bool) or type(value) is not type(allowed[0]) \
                or value not in allowed:
            self.problems.append(f"{where}.{key} must be one of {', '.join(map(str, allowed))}; "
                                 f"got {value!r}")
            return default
        return value

    def _memory(self, s: dict) -> tuple[str, int]:
        raw = s.get("memoryPerNode")
        if raw is None:
            self.problems.append("spec.memoryPerNode is required: the cache budget of each node, e.g. 4Gi")
            return "", 0
        try:
            value = parse_bytes(raw)
        except ValueError as exc:
            self.problems.append(f"spec.memoryPerNode: {exc}")
            return str(raw), 0
        if value < MIN_MEMORY:
            self.problems.append(f"spec.memoryPerNode {raw} is below the minimum of 64Mi; set at least 64Mi")
        return raw, value

    def _ports(self, ports: Any) -> tuple[int, int, int, int]:
        defaults = {"data": 5555, "admin": 8080, "events": 5557, "eventsReplay": 5558}
        if ports is None:
            ports = {}
        if not isinstance(ports, dict):
            self.problems.append(f"spec.ports must be an object with {', '.join(defaults)}, got {ports!r}")
            return tuple(defaults.values())
        self._unknown(ports, tuple(defaults), "spec.ports")
        chosen = {name: self._int(ports, name, default, 1, 65535, "spec.ports") for name, default in defaults.items()}
        seen: dict[int, str] = {}
        for name, port in chosen.items():
            if port in seen:
                self.problems.append(f"spec.ports.{seen[port]} and spec.ports.{name} are both {port}; "
                                     f"give them different ports")
            seen.setdefault(port, name)
        return tuple(chosen.values())

    # -- nested objects --------------------------------------------------------------------------

    def _resources(self, res: Any, where: str = "spec.resources",
                   memory_derived: bool = True) -> dict[str, dict[str, str | int]]:
        """A container's requests and limits.  ``memory_derived``: the container's memory is set
        from ``spec.memoryPerNode`` (the nodes'), so giving it here is a problem."""
        if res is None:
            return {}
        if not isinstance(res, dict):
            self.problems.append(f"{where} must be an object with requests/limits, got {res!r}")
            return {}
        self._unknown(res, ("requests", "limits"), where)
        out: dict[str, dict[str, str | int]] = {}
        for part in ("requests", "limits"):
            items = res.get(part)
            if items is None:
                continue
            if not isinstance(items, dict):
                self.problems.append(f"{where}.{part} must be a map of resource names to quantities")
                continue
            for name, qty in items.items():
                if name == "memory" and memory_derived:
                    self.problems.append(f"{where}.{part}.memory cannot be set: memory is derived "
                                         "from spec.memoryPerNode; change that instead")
                elif _quantity(qty) is None:
                    self.problems.append(f"{where}.{part}.{name} {qty!r} is not a quantity (e.g. 500m, 2)")
            out[part] = dict(items)
        for name, request in out.get("requests", {}).items():
            low, high = _quantity(request), _quantity(out.get("limits", {}).get(name))
            if low is not None and high is not None and low > high:
                self.problems.append(f"{where}.requests.{name} {request} exceeds {where}.limits.{name} "
                                     f"{out['limits'][name]}; lower the request or raise the limit")
        return out

    def _etcd(self, etcd: Any) -> EtcdSpec:
        if etcd is None:
            return EtcdSpec()
        if not isinstance(etcd, dict):
            self.problems.append(f"spec.etcd must be an object, got {etcd!r}")
            return EtcdSpec()
        self._unknown(etcd, ("endpoints", "managed"), "spec.etcd")
        if "endpoints" in etcd and "managed" in etcd:
            self.problems.append("spec.etcd sets both endpoints and managed; set endpoints for an etcd "
                                 "you run, or managed for one the operator runs, not both")
            return EtcdSpec()
        if "endpoints" in etcd:
            eps = etcd["endpoints"]
            if not isinstance(eps, list) or not eps:
                self.problems.append("spec.etcd.endpoints must be a non-empty list of host:port")
                return EtcdSpec()
            for ep in eps:
                if not isinstance(ep, str) or not _ENDPOINT.match(ep):
                    self.problems.append(f"spec.etcd.endpoints: {ep!r} is not host:port (e.g. etcd.infra.svc:2379)")
            return EtcdSpec(endpoints=tuple(str(e) for e in eps), managed=False)
        managed = etcd.get("managed")
        if managed is None:
            self.problems.append("spec.etcd must set endpoints (an etcd you run) or managed (one the "
                                 "operator runs, e.g. managed: {members: 3})")
            return EtcdSpec()
        if not isinstance(managed, dict):
            self.problems.append(f"spec.etcd.managed must be an object, got {managed!r}")
            return EtcdSpec()
        where = "spec.etcd.managed"
        self._unknown(managed, ("members", "storage", "storageClassName", "image"), where)
        storage = managed.get("storage", "1Gi")
        try:
            parse_bytes(storage)
        except ValueError as exc:
            self.problems.append(f"{where}.storage: {exc}")
        return EtcdSpec(members=self._enum(managed, "members", 1, ETCD_MEMBERS, where), storage=str(storage),
                        storage_class=self._str(managed, "storageClassName", None, where),
                        image=self._str(managed, "image", DEFAULT_ETCD_IMAGE, where) or DEFAULT_ETCD_IMAGE)

    def _section(self, value: Any, where: str, example: str) -> dict | None:
        """An optional object of the spec: None when it is absent, or not an object (a problem,
        with ``example`` of what to write)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            self.problems.append(f"{where} must be an object such as {example}, got {value!r}")
            return None
        return value

    def _disk(self, disk: Any) -> DiskSpec | None:
        where = "spec.disk"
        disk = self._section(disk, where, "{size: 100Gi}")
        if disk is None:
            return None
        self._unknown(disk, ("size", "storageClassName", "capacity", "scrubRate", "scrubIntervalSeconds", "eviction"),
                      where)
        size, size_bytes = disk.get("size"), 0
        if size is None:
            self.problems.append(f"{where}.size is required: each node's volume, e.g. 100Gi")
        else:
            try:
                size_bytes = parse_bytes(size)
                if size_bytes < MIN_DISK:
                    self.problems.append(f"{where}.size {size} is below the minimum of 1Gi; set at least 1Gi")
            except ValueError as exc:
                self.problems.append(f"{where}.size: {exc}")
        capacity = int(size_bytes * DISK_FILL)
        if "capacity" in disk:
            try:
                capacity = parse_bytes(disk["capacity"])
            except ValueError as exc:
                self.problems.append(f"{where}.capacity: {exc}")
            else:
                if size_bytes and capacity > size_bytes:
                    self.problems.append(f"{where}.capacity {disk['capacity']} exceeds {where}.size {size}: the node "
                                         "could fill its volume; lower it (or leave it out: 90% of size)")
                elif capacity <= 0:
                    self.problems.append(f"{where}.capacity must be positive, got {disk['capacity']!r}")
        scrub_rate = None
        if "scrubRate" in disk:
            try:
                scrub_rate = parse_bytes(disk["scrubRate"])
            except ValueError as exc:
                self.problems.append(f"{where}.scrubRate: {exc} (bytes a second, e.g. 16Mi; 0 turns the scrub off)")
        interval = (self._int(disk, "scrubIntervalSeconds", 1, 1, MAX_INT32, where)
                    if "scrubIntervalSeconds" in disk else None)
        eviction = self._enum(disk, "eviction", None, DISK_EVICTIONS, where) if "eviction" in disk else None
        return DiskSpec(size=str(size), size_bytes=size_bytes, capacity=capacity,
                        storage_class=self._str(disk, "storageClassName", None, where), scrub_rate=scrub_rate,
                        scrub_interval_seconds=interval, eviction=eviction)

    def _network_policy(self, policy: Any) -> NetworkPolicySpec:
        where = "spec.networkPolicy"
        policy = self._section(policy, where, "{enabled: false}")
        if policy is None:
            return NetworkPolicySpec()
        self._unknown(policy, ("enabled", "monitoringNamespace", "clientNamespaces"), where)
        monitoring = policy.get("monitoringNamespace", DEFAULT_MONITORING_NAMESPACE)
        if not self._namespace(monitoring):
            self.problems.append(f"{where}.monitoringNamespace {monitoring!r} is not a namespace name; set the "
                                 f"namespace Prometheus runs in (e.g. {DEFAULT_MONITORING_NAMESPACE})")
            monitoring = DEFAULT_MONITORING_NAMESPACE
        clients = policy.get("clientNamespaces", [])
        if not isinstance(clients, list):
            self.problems.append(f"{where}.clientNamespaces must be a list of namespace names, got {clients!r}")
            clients = []
        for ns in clients:
            if not self._namespace(ns):
                self.problems.append(f"{where}.clientNamespaces: {ns!r} is not a namespace name (e.g. inference)")
        return NetworkPolicySpec(enabled=self._enum(policy, "enabled", True, (True, False), where),
                                 monitoring_namespace=monitoring,
                                 client_namespaces=tuple(ns for ns in clients if self._namespace(ns)))

    def _pool_events(self, events: Any) -> PoolEventsSpec:
        where = "spec.poolEvents"
        events = self._section(events, where, "{enabled: false}")
        if events is None:
            return PoolEventsSpec()
        self._unknown(events, ("enabled", "port", "replayPort", "topic", "resources"), where)
        port = self._int(events, "port", 5557, 1, 65535, where)
        replay_port = self._int(events, "replayPort", 5558, 1, 65535, where)
        if port == replay_port:
            self.problems.append(f"{where}.port and {where}.replayPort are both {port}; give them different ports")
        topic = events.get("topic", "")
        if not isinstance(topic, str):
            self.problems.append(f"{where}.topic must be a string (the topic frame of every message), got {topic!r}")
            topic = ""
        resources = PoolEventsSpec().resources
        if "resources" in events:
            resources = self._resources(events["resources"], f"{where}.resources", memory_derived=False)
        return PoolEventsSpec(enabled=self._enum(events, "enabled", True, (True, False), where), port=port,
                              replay_port=replay_port, topic=topic, resources=resources)

    @staticmethod
    def _namespace(value: Any) -> bool:
        return isinstance(value, str) and len(value) <= 63 and bool(_NAMESPACE.match(value))

    def _node_selector(self, sel: Any) -> dict[str, str]:
        if sel is None:
            return {}
        if not isinstance(sel, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sel.items()):
            self.problems.append(f"spec.nodeSelector must map label names to string values, got {sel!r}")
            return {}
        return dict(sel)

    def _list_of_objects(self, value: Any, where: str) -> list[dict]:
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            self.problems.append(f"{where} must be a list of objects, got {value!r}")
            return []
        return value

    def _tolerations(self, value: Any) -> tuple[dict[str, Any], ...]:
        items = self._list_of_objects(value, "spec.tolerations")
        for i, t in enumerate(items):
            where = f"spec.tolerations[{i}]"
            self._unknown(t, ("key", "operator", "value", "effect", "tolerationSeconds"), where)
            if "operator" in t:
                self._enum(t, "operator", "Equal", _TOLERATION_OPERATORS, where)
            if "effect" in t:
                self._enum(t, "effect", "", _TAINT_EFFECTS, where)
            for key in ("key", "value"):
                if key in t and not isinstance(t[key], str):
                    self.problems.append(f"{where}.{key} must be a string, got {t[key]!r}")
            if "tolerationSeconds" in t:
                self._int(t, "tolerationSeconds", 0, -(2**63), 2**63 - 1, where)
        return tuple(dict(t) for t in items)

    def _affinity(self, value: Any) -> dict[str, Any] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            self.problems.append(f"spec.affinity must be an object (a core/v1 Affinity), got {value!r}")
            return None
        return dict(value)

    def _spread(self, value: Any) -> tuple[dict[str, Any], ...]:
        items = self._list_of_objects(value, "spec.topologySpreadConstraints")
        known = ("maxSkew", "topologyKey", "whenUnsatisfiable", "minDomains", "labelSelector",
                 "matchLabelKeys", "nodeAffinityPolicy", "nodeTaintsPolicy")
        for i, c in enumerate(items):
            where = f"spec.topologySpreadConstraints[{i}]"
            self._unknown(c, known, where)
            for key in ("maxSkew", "topologyKey", "whenUnsatisfiable"):
                if key not in c:
                    self.problems.append(f"{where}.{key} is required")
            if "maxSkew" in c:
                self._int(c, "maxSkew", 1, 1, 2**31 - 1, where)
            if "whenUnsatisfiable" in c:
                self._enum(c, "whenUnsatisfiable", "DoNotSchedule", _SPREAD_WHEN, where)
            if "topologyKey" in c:
                self._str(c, "topologyKey", None, where)
        return tuple(dict(c) for c in items)
