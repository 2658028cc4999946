"""Malformed input: every kind gets an error reply and a counter; the node keeps serving."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
from raw_protocol import RawConnection

from kvring.cachenode.client import ClusterClient
from kvring.cachenode.framing import ConnectionClosed, pack
from kvring.common import protocol as P
from kvring.common.chunk import ChunkItem, ChunkMeta, make_meta

MiB = 1 << 20


def _malformed(rng: np.random.Generator, valid_key: bytes) -> tuple[str, list[bytes]]:
    """One malformed request of a random kind: (expected error code, [header, payloads...])."""
    good = np.arange(64, dtype=np.uint8).tobytes()
    meta = make_meta(good, [2, 32], "uint8", 4)
    kind = int(rng.integers(0, 14))
    rid = int(rng.integers(1, 1 << 40))
    enc = msgspec.msgpack.encode
    if kind == 0:
        return "bad_header", [rng.bytes(int(rng.integers(1, 200)))]
    if kind == 1:
        return "unknown_op", [enc({"op": "explode", "rid": rid, "v": 1})]
    if kind == 2:
        return "version", [P.encode(P.Ping(rid=rid, v=99))]
    if kind == 3:  # PUT without its payload
        return "frame_count", [P.encode(P.Put(rid=rid, key=os.urandom(16), meta=meta))]
    if kind == 4:  # PUT with two payloads
        return "frame_count", [P.encode(P.Put(rid=rid, key=os.urandom(16), meta=meta)), good, good]
    if kind == 5:  # LOOKUP carrying a payload
        return "frame_count", [P.encode(P.Lookup(rid=rid, keys=[valid_key])), good]
    if kind == 6:  # payload shorter than the declared shape
        return "size_mismatch", [P.encode(P.Put(rid=rid, key=os.urandom(16), meta=meta)), good[:-7]]
    if kind == 7:  # declared size over the node's maximum (nothing that large is sent)
        big = ChunkMeta(shape=[64, 1 << 30], dtype="float32", tokens=1, checksums=[0] * 64)
        return "too_large", [P.encode(P.Put(rid=rid, key=os.urandom(16), meta=big)), good]
    if kind == 8:  # unknown dtype
        bad = ChunkMeta(shape=[2, 32], dtype="complex128", tokens=4, checksums=meta.checksums)
        return "bad_meta", [P.encode(P.Put(rid=rid, key=os.urandom(16), meta=bad)), good]
    if kind == 9:  # impossible shape
        bad = ChunkMeta(shape=[2, -32], dtype="uint8", tokens=4, checksums=meta.checksums)
        return "bad_meta", [P.encode(P.Put(rid=rid, key=os.urandom(16), meta=bad)), good]
    if kind == 10:  # bytes that do not match their checksums — and aimed at a stored key
        return "checksum", [P.encode(P.Put(rid=rid, key=os.urandom(16), meta=meta)), bytes(64)]
    if kind == 11:  # a header of the wrong type inside a valid op
        return "bad_header", [enc({"op": "get", "rid": rid, "keys": "not-a-list"})]
    if kind == 12:  # a key that is too long
        return "bad_key", [P.encode(P.Lookup(rid=rid, keys=[b"k" * 1000]))]
    return "bad_range", [P.encode(P.Get(rid=rid, keys=[valid_key], layer_start=5, layer_end=9))]


def test_10000_malformed_messages_leave_the_node_serving(cluster_factory):
    cluster = cluster_factory(nodes=1, memory=64 * MiB, node_args=["--max-chunk-bytes", "4MiB"])
    node = cluster.nodes[0]
    rng = np.random.default_rng(11)
    stored = {os.urandom(16): rng.integers(0, 256, size=4096, dtype=np.uint8) for _ in range(50)}
    with ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        assert client.wait_for_nodes(1)
        client.put_many([ChunkItem.of(k, v, [4, 1024], "uint8", 8) for k, v in stored.items()])
        valid_key = next(iter(stored))
        expected: dict[str, int] = {}
        sent = 0
        with RawConnection(node.data_addr) as conn:
            while sent < 10_000:
                batch = [_malformed(rng, valid_key) for _ in range(200)]
                for code, (header, *payloads) in batch:  # pipelined: 200 requests, then 200 replies
                    conn.send(header, payloads)
                    expected[code] = expected.get(code, 0) + 1
                for code, _ in batch:
                    reply = conn.reply()
                    assert isinstance(reply, P.Error) and reply.code == code, (code, reply)
                sent += len(batch)
                # Valid clients are served correctly in between.
                key = list(stored)[sent // 200 % len(stored)]
                got = client.get([key])[0]
                assert got is not None and np.array_equal(got.data, stored[key])
        # A payload above the node's maximum chunk size: refused from the frame prefix alone
        # (before any allocation), answered, and the connection closed.
        with RawConnection(node.data_addr) as rogue:
            rogue.send_raw(pack(P.encode(P.Ping(rid=1)), [bytes(16)])[0][:14] + (8 << 20).to_bytes(8, "little")
                           + P.encode(P.Ping(rid=1)))
            reply = rogue.reply()
            assert isinstance(reply, P.Error) and reply.code == "too_large"
            with pytest.raises(ConnectionClosed):
                rogue.receive()
        expected["too_large"] += 1

        stats = client.stats()["node-0"]
        for code, n in expected.items():
            assert stats["errors"][code] == n, code
        assert sum(stats["errors"].values()) >= 10_000 and stats["errors"]["internal"] == 0
        assert node.proc.poll() is None
        assert client.ping("node-0") < 5
        # Every stored chunk is intact, and none of the rejected PUTs stored anything.
        got = client.get(list(stored))
        assert all(np.array_equal(g.data, stored[k]) for k, g in zip(stored, got))
        assert stats["chunks"] == len(stored)
