"""The pool's KV-event stream as the operator renders it (``render_events``): a Deployment and a
Service ``<name>-events`` that validate against the Kubernetes 1.35 schemas, run the nodes'
image as the nodes run it, and whose command line the real ``kvring events`` accepts and runs.

No Kubernetes cluster runs here, so the rendered command is run as a process of its own against
a real local cluster (real etcd, real nodes), with the addresses only a pod would have replaced
by loopback ones; what it records in etcd is what the operator's status shows.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import kubernetes_validate
import msgspec
import pytest
import zmq
from kvring.operator import status as st
from kvring.operator.naming import pool_events_host
from kvring.operator.render import (
    render_children,
    render_pool_events,
    render_statefulset,
)
from kvring.operator.render_events import pool_events_objects
from kvring.operator.render_nodes import ENTRY, RUN_AS
from kvring.operator.spec import ClusterSpec
from polling import wait_for
from test_chart import parse_cli

from kvring.cli.main import main as kvring_main
from kvring.events.wire import AllBlocksCleared, EventBatch
from kvring.membership.etcd import Etcd
from kvring.membership.settings import EtcdSettings

K8S_VERSION = "1.35.0"
NAME, NS = "kv", "team-a"


def spec_of(**patch) -> ClusterSpec:
    return ClusterSpec.from_dict({"memoryPerNode": "1Gi", **patch})


def rendered(spec: ClusterSpec | None = None) -> dict[str, dict]:
    return {o["kind"]: o for o in render_pool_events(NAME, NS, spec or spec_of())}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def snapshot(endpoint: str, cluster: str):
    async def read():
        etcd = Etcd(EtcdSettings.parse(endpoint, cluster=cluster))
        try:
            return await etcd.snapshot()
        finally:
            await etcd.close()
    return asyncio.run(read())


@pytest.mark.parametrize("patch", [{}, {"poolEvents": {"port": 6000, "replayPort": 6001, "topic": "kv"},
                                       "etcd": {"endpoints": ["etcd-a.infra:2379", "etcd-b.infra:2379"]}}])
def test_the_deployment_and_service_validate_and_name_one_stream(patch):
    objs = rendered(spec_of(**patch))
    assert list(objs) == ["Service", "Deployment"]  # the Service (its DNS name) before the pod advertising it
    for obj in objs.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["metadata"]["name"] == "kv-events" and obj["metadata"]["namespace"] == NS
        assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == "events"
    deployment, service = objs["Deployment"], objs["Service"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    c = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    events = spec_of(**patch).pool_events
    assert ports == {"events": events.port, "events-replay": events.replay_port}
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "events": (events.port, "events"), "events-replay": (events.replay_port, "events-replay")}
    assert c["readinessProbe"]["tcpSocket"] == {"port": "events"}
    # What it advertises is the Service's own DNS name, on the ports the Service serves.
    assert flag(c["args"], "--advertise-host") == f"{service['metadata']['name']}.{NS}.svc" == pool_events_host(NAME, NS)
    assert flag(c["args"], "--host") == "0.0.0.0"
    assert (flag(c["args"], "--port"), flag(c["args"], "--replay-port")) == (str(events.port), str(events.replay_port))
    assert flag(c["args"], "--topic") == (events.topic or None)


def test_the_relay_runs_the_node_image_as_the_nodes_do():
    spec = spec_of(image="registry.example.com/kvring:9", imagePullPolicy="Always")
    pod = rendered(spec)["Deployment"]["spec"]["template"]["spec"]
    node_pod = render_statefulset(NAME, NS, spec)["spec"]["template"]["spec"]
    c, node = container({"spec": {"template": {"spec": pod}}}), node_pod["containers"][0]
    assert (c["image"], c["imagePullPolicy"], c["command"]) == (node["image"], node["imagePullPolicy"], node["command"])
    assert c["command"] == ENTRY
    assert c["securityContext"] == node["securityContext"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"] == node_pod["securityContext"] and pod["securityContext"]["runAsUser"] == RUN_AS
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    # Etcd and cluster are the nodes' own.
    for name in ("--etcd", "--cluster"):
        assert flag(c["args"], name) == flag(node["args"], name)
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}


def test_turned_off_it_renders_nothing_and_the_operator_knows_what_to_delete():
    off = spec_of(poolEvents={"enabled": False})
    assert render_pool_events(NAME, NS, off) == []
    assert not [o for o in render_children(NAME, NS, off) if o["metadata"]["name"] == "kv-events"]
    on = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in render_pool_events(NAME, NS, spec_of())}
    assert set(pool_events_objects(NAME)) == on


def test_the_rendered_command_line_parses_with_the_real_cli():
    args = container(rendered(spec_of(poolEvents={"topic": "kv"}))["Deployment"])["args"]
    params = parse_cli(args)
    assert (params["host"], params["advertise_host"], params["port"], params["replay_port"], params["topic"]) == (
        "0.0.0.0", "kv-events.team-a.svc", 5557, 5558, "kv")
    assert (params["etcd"], params["cluster"]) == ("kv-etcd.team-a.svc:2379", "team-a.kv")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "tcp://kv-events.ns.svc", "kv-events.ns.svc:5557", "kv events",
                                  "kv-.ns.svc", ""])
def test_an_advertise_host_no_router_could_reach_is_refused_in_one_line(host, capsys):
    assert kvring_main(["events", "--etcd", "127.0.0.1:2379", "--advertise-host", host]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--advertise-host" in err and "e.g. kv-cache-events.team-a.svc" in err, err


def test_the_rendered_stream_runs_records_its_service_address_and_shows_in_the_status(cluster_factory, tmp_path):
    """The Deployment's command, run for real: only what a pod alone has is replaced (the etcd
    and cluster of this test's cluster, loopback instead of 0.0.0.0, free ports)."""
    cluster = cluster_factory(nodes=2, memory=8 << 20)
    args = container(rendered()["Deployment"])["args"]
    port, replay_port = free_port(), free_port()
    given = {"--etcd": cluster.etcd, "--cluster": cluster.cluster, "--host": "127.0.0.1",
             "--port": str(port), "--replay-port": str(replay_port)}
    argv = [given.get(args[i - 1], a) if i else a for i, a in enumerate(args)]
    assert flag(argv, "--advertise-host") == "kv-events.team-a.svc"  # kept as rendered
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "kvring.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "TMPDIR": str(tmp)},
                            start_new_session=True)
    ctx = zmq.Context()
    try:
        line = proc.stdout.readline()
        assert f"tcp://kv-events.team-a.svc:{port} (replay tcp://kv-events.team-a.svc:{replay_port})" in line, line
        # The record in etcd carries the Service's address and the ports; the members come with it.
        snap = wait_for(lambda: (s := snapshot(cluster.etcd, cluster.cluster)).pool_events and s, timeout=15,
                        what="the stream's record in etcd")
        assert (snap.pool_events.events_addr, snap.pool_events.replay_addr, snap.pool_events.topic) == (
            f"tcp://kv-events.team-a.svc:{port}", f"tcp://kv-events.team-a.svc:{replay_port}", "")
        assert len(snap.members) == 2
        # It publishes where it bound: a subscriber gets the pool's snapshot, AllBlocksCleared first.
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        assert sub.poll(10_000), "nothing published"
        _, _, payload = sub.recv_multipart()
        assert isinstance(msgspec.msgpack.decode(payload, type=EventBatch).events[0], AllBlocksCleared)
        sub.close(linger=0)
        # The operator's status pass turns the same read into status.poolEvents.
        members = {n: st.Member(n, r.state, r.capacity, r.admin_addr) for n, r in snap.members.items()}
        obs = st.Observation(name="kv", generation=1, desired=2, statefulset=None, members=members,
                             revision=snap.revision, pool_events=snap.pool_events)
        shown = st.build_status(obs, None, selector="s", connector="{}", now=st.now_iso())
        assert shown["poolEvents"] == {"events": f"tcp://kv-events.team-a.svc:{port}",
                                       "replay": f"tcp://kv-events.team-a.svc:{replay_port}", "topic": ""}

        # Stopped as Kubernetes stops a pod: it revokes its lease, so the record goes, and so
        # does status.poolEvents.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stdout.read()
        snap = snapshot(cluster.etcd, cluster.cluster)
        assert snap.pool_events is None
        obs = st.Observation(name="kv", generation=1, desired=2, statefulset=None, members=members,
                             revision=snap.revision, pool_events=snap.pool_events)
        gone = st.build_status(obs, shown, selector="s", connector="{}", now=st.now_iso())
        assert st.changed_fields(shown, gone, whole=True)["poolEvents"] is None
    finally:
        ctx.destroy(linger=0)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stdout.close()
    assert list(tmp.iterdir()) == []  # nothing left in its temporary directory
