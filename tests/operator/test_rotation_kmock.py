"""A credentials rotation the operator drives (the real kopf operator against the Kubernetes API
emulator, real etcd, real node processes): the nodes follow their Secrets' volumes through the
three steps while a client reads, writes and asks the guarded admin endpoints all along, and
nothing is refused; at the end only the new CA and token get in.

The emulator has no kubelet, so the test plays it: ``Kubelet`` copies each Secret into its volume
(``secret_volume.publish``, the kubelet's atomic swap) a moment after it changes, as the kubelet
does within its sync period."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import secret_volume
from polling import wait_for
from test_operator_kmock import NS, MiB, cachecluster, cc_path, events_for, kube, operator, path, set_ready

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.common.nodetoken import NodeToken
from kvring.common.tls import ClusterCredentials
from kvring.local.cluster import NodeProcess
from kvring.operator.rotation import ROTATE_ANNOTATION, ROTATED_ANNOTATION, ROTATION_ANNOTATION

__all__ = ["kube"]  # the emulator fixture, shared with the operator's other tests


class Kubelet:
    """Keeps the volumes of some Secrets in step with the API, every ``period`` seconds."""

    def __init__(self, api, volumes: dict[str, Path], period: float = 0.2) -> None:
        self.api, self.volumes, self.period = api, volumes, period
        self._seen: dict[str, dict] = {}
        self._stop = threading.Event()
        self.errors: list[str] = []
        self._thread: threading.Thread | None = None

    def sync(self) -> bool:
        """One round; True once every Secret has been written at least once."""
        for name, volume in self.volumes.items():
            secret = self.api.get(path("v1", "secrets", name))
            data = (secret or {}).get("data")
            if data and data != self._seen.get(name):
                volume.mkdir(parents=True, exist_ok=True)
                secret_volume.publish(volume, {k: base64.b64decode(v) for k, v in data.items()})
                self._seen[name] = data
        return len(self._seen) == len(self.volumes)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.sync()
            except Exception as exc:  # noqa: BLE001 -- reported by the test, not lost in a thread
                self.errors.append(repr(exc))

    def __enter__(self) -> Kubelet:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(5)


def _present(node: NodeProcess, token: str, tls: ClusterCredentials) -> int:
    req = urllib.request.Request(f"{node.admin_addr}/v1/present", data=json.dumps({"keys": [b"k".hex()]}).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5, context=tls.client_context()) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_rotation_the_operator_drives_refuses_nothing_and_leaves_the_new_set_alone(kube, etcd_server, tmp_path):
    api = kube.api
    cluster = f"{NS}.rot"
    tls_dir, token_dir = tmp_path / "tls", tmp_path / "node-token"  # the pods' volumes
    nodes = [NodeProcess(f"rot-{i}", 64 * MiB, etcd_server.endpoint, cluster, lease_ttl=3,
                         extra=["--tls-dir", str(tls_dir), "--node-token-file", str(token_dir / "token")])
             for i in range(2)]
    kubelet = Kubelet(api, {"rot-tls": tls_dir, "rot-node-token": token_dir})
    try:
        with operator():
            api.create(cc_path(), cachecluster("rot", replicas=2, rotationStepSeconds=1,
                                               etcd={"endpoints": [etcd_server.endpoint]}))
            wait_for(kubelet.sync, what="the Secrets the operator makes")
            old_tls = secret_volume.read(tls_dir, ("ca.crt", "tls.crt", "tls.key"))
            old_token = (token_dir / "token").read_text().strip()
            stale = tmp_path / "stale"  # a copy of the first set, never updated
            stale.mkdir()
            for name, data in old_tls.items():
                (stale / name).write_bytes(data)
            with kubelet:
                for n in nodes:
                    n.start(wait=False)
                for n in nodes:
                    n.wait_ready()
                set_ready(api, "rot", 2)
                creds = ClusterCredentials.at(tls_dir, check_interval=0.2)  # a client pod, same volume
                token = NodeToken.from_file(token_dir / "token", check_interval=0.2)
                steps: list[str] = []
                refused: list[str] = []
                with ClusterClient(etcd_server.endpoint, cluster=cluster, tls=creds) as client:
                    assert client.wait_for_nodes(2)
                    api.patch(cc_path("rot"), {"metadata": {"annotations": {ROTATE_ANNOTATION: "first"}}})
                    deadline = time.monotonic() + 90
                    i = 0
                    while time.monotonic() < deadline:
                        cr = api.get(cc_path("rot"))
                        rotating = cr["status"].get("credentialsRotation")
                        if rotating and (not steps or steps[-1] != rotating["step"]):
                            steps.append(rotating["step"])
                        if cr["metadata"].get("annotations", {}).get(ROTATED_ANNOTATION) == "first" and not rotating:
                            break
                        # All the while: chunks written and read back, guarded endpoints asked.
                        key = b"during-%d" % i
                        data = np.random.default_rng(i).bytes(64 << 10)
                        try:
                            assert client.put_many([ChunkItem.of(key, data, (4, (64 << 10) // 4), "uint8", 16)]) == [1]
                            assert bytes(client.get([key])[0].data) == data
                        except Exception as exc:  # noqa: BLE001 -- collected: the test fails on any
                            refused.append(f"{rotating and rotating['step']}: {exc!r}")
                        codes = {_present(n, token.presented(), creds) for n in nodes}
                        if codes != {200}:
                            refused.append(f"{rotating and rotating['step']}: present answered {codes}")
                        i += 1
                        time.sleep(0.1)
                    else:
                        raise AssertionError(f"the rotation did not end; steps seen {steps}")
                    assert not refused, refused[:5]
                    assert steps == ["trust", "present", "drop"], steps
                    assert i > 10 and not kubelet.errors, kubelet.errors
                    # Each node holds the new set alone, and the old gets nowhere.
                    new_tls = secret_volume.read(tls_dir, ("ca.crt", "tls.crt", "tls.key"))
                    new_token = (token_dir / "token").read_text().strip()
                    assert new_tls["ca.crt"].count(b"BEGIN CERTIFICATE") == 1 and new_tls["ca.crt"] != old_tls["ca.crt"]
                    assert "\n" not in new_token and new_token != old_token
                    wait_for(lambda: creds.loaded.trusted == ClusterCredentials.at(tls_dir).loaded.trusted, 5)
                    assert all(_present(n, old_token, creds) == 401 for n in nodes)
                    assert all(_present(n, new_token, creds) == 200 for n in nodes)
                    with ClusterClient(etcd_server.endpoint, cluster=cluster, tls=ClusterCredentials.at(stale),
                                       timeout=2) as old:
                        assert old.wait_for_nodes(2)
                        assert all("error" in s for s in old.stats().values())
                    assert bytes(client.get([b"during-0"])[0].data) == np.random.default_rng(0).bytes(64 << 10)
            cr = api.get(cc_path("rot"))
            assert ROTATION_ANNOTATION not in cr["metadata"].get("annotations", {})
            assert api.get(path("v1", "secrets", "rot-tls-rotation")) is None
            reasons = [e["reason"] for e in events_for(api, "rot")]
            assert reasons.count("CredentialsRotation") == 3 and "CredentialsRotated" in reasons
            # Asked again with the same value: nothing happens; with a new one, another rotation.
            api.patch(cc_path("rot"), {"metadata": {"annotations": {ROTATE_ANNOTATION: "first"}}})
            time.sleep(1)
            assert "credentialsRotation" not in api.get(cc_path("rot"))["status"]
    finally:
        for n in nodes:
            n.stop()


def test_a_rotation_survives_an_operator_restart_and_a_lost_secret_starts_it_over(kube, etcd_server, tmp_path):
    """Held at its first step (rotationStepSeconds: one hour), a rotation outlives an operator
    restart unchanged; its Secret deleted, the operator changes nothing and says so; its record
    removed, it starts over from the Secrets as they stand, and ends with that last set alone."""
    api = kube.api
    cluster = f"{NS}.again"
    tls_dir, token_dir = tmp_path / "tls", tmp_path / "node-token"
    node = NodeProcess("again-0", 64 * MiB, etcd_server.endpoint, cluster, lease_ttl=3,
                       extra=["--tls-dir", str(tls_dir), "--node-token-file", str(token_dir / "token")])
    kubelet = Kubelet(api, {"again-tls": tls_dir, "again-node-token": token_dir})

    def record() -> dict:
        return json.loads(api.get(cc_path("again"))["metadata"].get("annotations", {}).get(ROTATION_ANNOTATION, "{}"))

    def rotating() -> dict:
        return api.get(cc_path("again"))["status"].get("credentialsRotation") or {}

    try:
        with operator():
            api.create(cc_path(), cachecluster("again", replicas=1, rotationStepSeconds=3600,
                                               etcd={"endpoints": [etcd_server.endpoint]}))
            wait_for(kubelet.sync, what="the Secrets the operator makes")
            first_ca = ClusterCredentials.at(tls_dir).loaded.trusted
            with kubelet:
                node.start()
                set_ready(api, "again", 1)
                api.patch(cc_path("again"), {"metadata": {"annotations": {ROTATE_ANNOTATION: "one"}}})
                wait_for(lambda: rotating().get("step") == "trust" and rotating().get("waitingFor") == [], 20,
                         "the node to take the first step")
        held = record()
        kept = api.get(path("v1", "secrets", "again-tls-rotation"))["data"]
        with operator(), kubelet:  # a new operator process: the rotation stands where it was
            time.sleep(2)
            assert record() == held and rotating()["step"] == "trust"
            assert api.get(path("v1", "secrets", "again-tls-rotation"))["data"] == kept
            api.delete(path("v1", "secrets", "again-tls-rotation"))
            wait_for(lambda: any("is missing or unreadable" in e.get("message", "") for e in events_for(api, "again")),
                     10, "the warning that the rotation is held")
            assert record() == held and (tls_dir / "ca.crt").read_bytes().count(b"BEGIN CERTIFICATE") == 2
            # Start over: the record removed, the request (still not carried out) starts a new
            # rotation from the Secrets as they stand; a short step now takes it to its end.
            api.patch(cc_path("again"), {"metadata": {"annotations": {ROTATION_ANNOTATION: None}},
                                         "spec": {"rotationStepSeconds": 0}})
            wait_for(lambda: (o := api.get(cc_path("again")))["metadata"].get("annotations", {})
                     .get(ROTATED_ANNOTATION) == "one" and "credentialsRotation" not in o["status"], 30,
                     "the rotation started over to end")
            wait_for(lambda: tuple(json.loads(urllib.request.urlopen(
                f"{node.admin_addr}/stats", timeout=5, context=ClusterCredentials.at(tls_dir).client_context()
            ).read())["credentials"]["tls"]["trusted"]) == ClusterCredentials.at(tls_dir).loaded.trusted, 10,
                     "the node to trust the last CA alone")
            last_ca = ClusterCredentials.at(tls_dir).loaded.trusted
            assert len(last_ca) == 1 and last_ca[0] not in first_ca  # neither the first CA nor the lost one
    finally:
        node.stop()
