"""Credentials that change under running processes (real etcd, real node processes, real TLS):
a Secret's volume updated as the kubelet does it, a CA rotated in three steps while a client
reads and writes with credentials one step behind, a set that does not load, and node tokens
changed the same way.  Nothing is refused at any step, and no byte comes back other than it went
in; once the old CA is dropped, nothing that holds only it gets in, and what it had opened is
closed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import httpx
import numpy as np
import pytest
import secret_volume
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.common import protocol as P
from kvring.common.chunk import ChunkItem
from kvring.common.errors import KVRingError, NodeUnavailable
from kvring.common.nodetoken import NodeToken, NodeTokenError, token_fingerprint
from kvring.common.tls import (CA_FILE, CERT_FILE, KEY_FILE, ClusterCredentials, CredentialsError, RotationStep,
                               credentials_pem, rotation_step)
from kvring.local.cluster import LocalCluster

SET = (CA_FILE, CERT_FILE, KEY_FILE)


@pytest.fixture(scope="module")
def cluster(etcd_server):
    with LocalCluster(nodes=2, memory=64 << 20, etcd=etcd_server.endpoint, cluster="creds-reload", tls=True,
                      admin=True) as c:
        # The nodes' directory becomes a Secret volume (same content: nothing to reload).
        secret_volume.publish(c.tls.directory, secret_volume.read(c.tls.directory, SET))
        yield c


def _stats(cluster, node) -> dict:
    with urllib.request.urlopen(f"{node.admin_addr}/stats", timeout=5, context=cluster.admin_tls) as r:
        return json.loads(r.read())


def _held(files: dict[str, bytes], directory) -> ClusterCredentials:
    """A client's copy of ``files`` in ``directory``."""
    directory.mkdir(exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return ClusterCredentials.at(directory)


def _fingerprints(files: dict[str, bytes], tmp_path) -> tuple[str, tuple[str, ...]]:
    """The certificate's and the CAs' fingerprints of ``files``, as a process that loaded them reports."""
    loaded = _held(files, tmp_path / "fingerprints").loaded
    return loaded.cert, loaded.trusted


def _nodes_loaded(cluster, files, tmp_path) -> None:
    cert, trusted = _fingerprints(files, tmp_path)
    def loaded(node) -> bool:
        tls = _stats(cluster, node)["credentials"]["tls"]
        return tls["cert"] == cert and tuple(tls["trusted"]) == trusted

    wait_for(lambda: all(loaded(n) for n in cluster.nodes), 15, "every node to load the new set")


def _payload(seed: int, size: int = 256 << 10) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def _round_trip(cluster, creds: ClusterCredentials, tag: str) -> None:
    """A client of its own (fresh connections: fresh handshakes) writes chunks and reads them back."""
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=creds, timeout=5) as client:
        assert client.wait_for_nodes(len(cluster.nodes))
        _write_and_read(client, tag)


def _write_and_read(client: ClusterClient, tag: str) -> None:
    keys = [f"{tag}-{i}".encode() for i in range(4)]
    items = [ChunkItem.of(key, _payload(i), (4, (256 << 10) // 4), "uint8", 64) for i, key in enumerate(keys)]
    assert client.put_many(items) == [1] * len(items), tag
    assert [bytes(c.data) for c in client.get(keys)] == [_payload(i) for i in range(len(keys))], tag


def test_a_ca_rotated_in_three_steps_refuses_nothing_and_then_shuts_the_old_ca_out(cluster, tmp_path):
    nodes_dir = cluster.tls.directory
    old = secret_volume.read(nodes_dir, SET)
    new = credentials_pem(cluster.cluster)
    client_dir = tmp_path / "client"  # a client's own volume: the kubelet updates each pod in its own time
    client_dir.mkdir()
    secret_volume.publish(client_dir, old)
    client_creds = ClusterCredentials.at(client_dir, check_interval=0)
    stale_dir = tmp_path / "stale"  # a holder of the old set alone, all along
    stale_dir.mkdir()
    secret_volume.publish(stale_dir, old)
    stale = ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=ClusterCredentials.at(stale_dir), timeout=3)
    # A client that lives through the rotation (a serving instance's connector), on the client's volume.
    lasting = ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=client_creds, timeout=5)
    try:
        assert stale.wait_for_nodes(len(cluster.nodes)) and lasting.wait_for_nodes(len(cluster.nodes))
        _write_and_read(lasting, "lasting-before")
        kept = [ChunkItem.of(b"kept-by-stale", _payload(99), (4, (256 << 10) // 4), "uint8", 64)]
        assert stale.put_many(kept) == [1]  # opens (and keeps) connections under the old CA
        reloads = {n.node_id: _stats(cluster, n)["credentials"]["tls"]["reloads"] for n in cluster.nodes}
        for step in RotationStep:
            files = rotation_step(old, new, step)
            # The nodes take the step first, the client is one step behind: both ways must work.
            secret_volume.publish(nodes_dir, files)
            _nodes_loaded(cluster, files, tmp_path)
            _round_trip(cluster, client_creds, f"{step.value}-client-behind")
            _write_and_read(lasting, f"{step.value}-lasting-behind")
            secret_volume.publish(client_dir, files)
            assert client_creds.refresh()
            _round_trip(cluster, client_creds, f"{step.value}-in-step")
            _write_and_read(lasting, f"{step.value}-lasting-in-step")
            if step is RotationStep.TRUST:  # until the nodes show the new certificate, the old set still works
                _round_trip(cluster, ClusterCredentials.at(stale_dir), f"{step.value}-stale")
        for node in cluster.nodes:
            s = _stats(cluster, node)
            assert s["credentials"]["tls"]["reloads"] == reloads[node.node_id] + 3
            assert s["credentials"]["tls"]["reload_error"] is None
        # The old CA is out: a new handshake with the old set fails, and the connections it had
        # opened were closed, so the stale client's next request cannot ride on them either.
        wait_for(lambda: sum(_stats(cluster, n)["tls_closed"] for n in cluster.nodes) >= 1, 10,
                 "the old CA's connections to be closed")
        for node in cluster.nodes:
            with pytest.raises(NodeUnavailable):
                stale.request(node.node_id, P.Ping(rid=1))
        with pytest.raises(KVRingError, match="TLS handshake .* certificate verify failed"):
            _round_trip(cluster, ClusterCredentials.at(stale_dir), "stale-after-drop")
        _round_trip(cluster, client_creds, "after")
        with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=client_creds) as client:
            assert bytes(client.get([b"kept-by-stale"])[0].data) == _payload(99)  # nothing was lost on the way
    finally:
        stale.close()
        lasting.close()


def _reload_errors(cluster) -> list[str]:
    return [_stats(cluster, n)["credentials"]["tls"]["reload_error"] or "" for n in cluster.nodes]


def test_a_set_that_does_not_load_is_not_taken_and_the_nodes_keep_serving(cluster, tmp_path):
    nodes_dir = cluster.tls.directory
    good = secret_volume.read(nodes_dir, SET)
    client = _held(good, tmp_path / "client")
    before = {n.node_id: _stats(cluster, n)["credentials"]["tls"] for n in cluster.nodes}
    bad_sets = {
        "cannot load": {**good, KEY_FILE: credentials_pem("other")[KEY_FILE]},  # a key that is not the certificate's
        "CA certificates": {**good,  # a CA file whose one "certificate" is not one
                            CA_FILE: b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n"},
        "lacks tls.key": {CA_FILE: good[CA_FILE], CERT_FILE: good[CERT_FILE]},  # a key missing from the volume
    }
    try:
        for why, files in bad_sets.items():
            secret_volume.publish(nodes_dir, files)
            wait_for(lambda: all(why in e for e in _reload_errors(cluster)), 15, f"every node to refuse a set ({why})")
            _round_trip(cluster, client, f"refused-{why.split()[0]}")  # the last good set still serves
            with urllib.request.urlopen(f"{cluster.nodes[0].admin_addr}/metrics", timeout=5,
                                        context=client.client_context()) as r:
                assert b"kvring_node_tls_reload_failing 1.0" in r.read()
    finally:
        secret_volume.publish(nodes_dir, good)
    wait_for(lambda: not any(_reload_errors(cluster)), 15, "the error to clear once the files load again")
    for node in cluster.nodes:  # the same set as before: nothing was taken on the way
        now = _stats(cluster, node)["credentials"]["tls"]
        assert (now["cert"], now["trusted"], now["reloads"]) == (before[node.node_id]["cert"],
                                                                 before[node.node_id]["trusted"],
                                                                 before[node.node_id]["reloads"])


def _present(cluster, node, token: str) -> int:
    """POST /v1/present (a guarded endpoint that changes nothing) with ``token``: the HTTP status."""
    req = urllib.request.Request(f"{node.admin_addr}/v1/present", data=json.dumps({"keys": [b"k".hex()]}).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5, context=cluster.admin_tls) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _tokens(cluster) -> list[dict]:
    return [_stats(cluster, n)["credentials"]["node_token"] for n in cluster.nodes]


def test_node_tokens_change_in_three_steps_and_the_admin_api_follows(cluster):
    """The token file's lines: the nodes accept each, the admin API sends the first; a change goes
    old -> old+new -> new+old -> new with no refused request, then the old token is refused."""
    file, old, new = cluster.node_token_file, cluster.node_token, "n" * 64
    owners = f"{cluster.admin.url}/v1/keys/{b'k'.hex()}/owners"
    reloads = [t["reloads"] for t in _tokens(cluster)]
    try:
        for step, (lines, accepted, refused) in enumerate((([old, new], [old, new], []), ([new, old], [old, new], []),
                                                           ([new], [new], [old])), 1):
            file.write_text("\n".join(lines) + "\n")
            wait_for(lambda: [t["reloads"] for t in _tokens(cluster)] == [r + step for r in reloads], 15,
                     f"every node to read step {step}")
            assert all(t["accepted"] == [token_fingerprint(line) for line in lines] for t in _tokens(cluster))
            for node in cluster.nodes:
                assert [_present(cluster, node, t) for t in accepted] == [200] * len(accepted), lines
                assert [_present(cluster, node, t) for t in refused] == [401] * len(refused), lines
            # The admin API sends the file's first line, whichever it is now (its key owners query
            # asks every node with it).
            wait_for(lambda: httpx.get(owners, timeout=5).status_code == 200, 15, "the admin API's query")
        # A file that does not hold a token is not taken: the last tokens stay.
        for bad in ("", "short\n", f"{new} with spaces\n"):
            file.write_text(bad)
            wait_for(lambda: all(t["reload_error"] for t in _tokens(cluster)), 15, f"the nodes to refuse {bad!r}")
            assert all(_present(cluster, n, new) == 200 for n in cluster.nodes)
            assert httpx.get(owners, timeout=5).status_code == 200
    finally:
        file.write_text(old + "\n")
    wait_for(lambda: all(t["reload_error"] is None and t["accepted"] == [token_fingerprint(old)]
                         for t in _tokens(cluster)), 15,
             "the nodes to take the first token back")
    assert all(_present(cluster, n, old) == 200 for n in cluster.nodes)


# ---- one process's view of its files (no nodes) ------------------------------------------------

def test_credentials_follow_a_volume_swap_and_ignore_a_touch(tmp_path):
    first, second = credentials_pem("a"), credentials_pem("b")
    secret_volume.publish(tmp_path, first)
    creds = ClusterCredentials.at(tmp_path, check_interval=3600)
    seen: list[tuple[str, str]] = []
    creds.on_reload(lambda before, after: seen.append((before.cert, after.cert)))
    context = creds.client_context()
    start = creds.loaded
    secret_volume.publish(tmp_path, second)
    assert creds.client_context() is context  # looked at no more often than check_interval
    assert creds.refresh() and creds.client_context() is not context
    assert creds.loaded.cert != start.cert and seen == [(start.cert, creds.loaded.cert)] and creds.reloads == 1
    secret_volume.publish(tmp_path, second)  # the same content again: new inodes, no new set
    assert not creds.refresh() and creds.reloads == 1 and len(seen) == 1
    # Files replaced one by one (no volume): between the writes the key is not the certificate's.
    plain = tmp_path / "plain"
    plain.mkdir()
    for name, data in first.items():
        (plain / name).write_bytes(data)
    creds = ClusterCredentials.at(plain, check_interval=0)
    (plain / CERT_FILE).write_bytes(second[CERT_FILE])
    assert not creds.refresh() and "cannot load" in creds.reload_error
    (plain / KEY_FILE).write_bytes(second[KEY_FILE])
    (plain / CA_FILE).write_bytes(second[CA_FILE])
    assert creds.refresh() and creds.reload_error is None and creds.reloads == 1


def test_a_directory_without_credentials_is_one_line_at_start(tmp_path):
    with pytest.raises(CredentialsError, match="does not exist"):
        ClusterCredentials.at(tmp_path / "absent")
    (tmp_path / CA_FILE).write_bytes(credentials_pem("a")[CA_FILE])
    with pytest.raises(CredentialsError, match="lacks tls.crt, tls.key"):
        ClusterCredentials.at(tmp_path)
    (tmp_path / CERT_FILE).write_bytes(b"garbage")
    (tmp_path / KEY_FILE).write_bytes(b"garbage")
    with pytest.raises(CredentialsError, match="cannot load"):
        ClusterCredentials.at(tmp_path)


def test_rotation_steps_trust_both_then_show_the_new_then_drop_the_old(tmp_path):
    old, new = credentials_pem("a"), credentials_pem("a")
    trust, present, drop = (rotation_step(old, new, step) for step in RotationStep)
    assert trust[CERT_FILE] == old[CERT_FILE] and trust[KEY_FILE] == old[KEY_FILE]
    assert present[CERT_FILE] == new[CERT_FILE] and present[KEY_FILE] == new[KEY_FILE]
    assert trust[CA_FILE] == present[CA_FILE] and drop == new
    (tmp_path / "t").mkdir()
    loaded = _held(trust, tmp_path / "t").loaded
    assert loaded is not None and len(loaded.trusted) == 2
    assert loaded.trusted[1] == _held(new, tmp_path / "n").loaded.trusted[0]


def test_node_token_file_lines(tmp_path):
    file = tmp_path / "token"
    a, b = "a" * 32, "b" * 40
    file.write_text(f"{a}\n\n  {b}  \n")
    token = NodeToken.from_file(file, check_interval=0)
    assert token.presented() == a and token.accepts(a) and token.accepts(b) and not token.accepts("c" * 32)
    assert not token.accepts("") and not token.accepts(a[:-1]) and "a" * 8 not in repr(token)
    file.write_text(b)
    assert token.presented() == b and not token.accepts(a) and token.reloads == 1
    fixed = NodeToken.fixed(f" {a}\n{b}\n")  # KVRING_NODE_TOKEN: lines too
    assert fixed.presented() == a and fixed.accepts(b) and not fixed.refresh()
    for content, why in (("", "is empty"), ("short", "at least 32"), (f"{a} {b}", "without spaces")):
        file.write_text(content)
        with pytest.raises(NodeTokenError, match=why):
            NodeToken.from_file(file)
    with pytest.raises(NodeTokenError, match="cannot read"):
        NodeToken.from_file(tmp_path / "absent")
