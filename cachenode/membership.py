"""Cluster membership and the cluster contract, kept in etcd.

Layout under ``<prefix>/<cluster>/`` (default prefix ``/kvring``):

- ``contract``: the hashing/placement contract, written once by the first process of the
  cluster (a compare-and-swap on the key's version); everyone after compares theirs to it.
- ``nodes/<node-id>``: one JSON ``NodeRecord`` per node, attached to the node's lease (TTL ~10 s,
  kept alive at a third of it).  A node that dies stops refreshing; etcd deletes the record
  when the lease runs out and every client drops the node from its ring.
- ``drain/<node-id>``: a drain request (no lease; JSON with the time it was asked for).  The
  node polls for its key, sets its state ``draining`` (clients drop it from the ring, it keeps
  serving reads), hands every chunk to its new owners and then reports ``drained``.  Deleting
  the key (``cancel_drain``) before the node exits sends it back to ``active``.  A node that
  exits after reporting ``drained`` deletes its key itself: the request has been carried out,
  and a pod that later comes back under the same id starts active.

Node states: ``joining`` and ``active`` nodes are on the ring; ``draining`` and ``drained``
nodes are members (their records and addresses stay, reads may still reach them) but own no
keys (``LEFT_RING_STATES``).

Only this module imports ``aetcd``; grpc/etcd failures become ``MembershipError``.
Both classes here run on an asyncio loop that their owner drives (the node's or the client's
background thread); their coroutines never block that loop on anything but etcd I/O.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, fields

import aetcd
import msgspec

from .errors import ContractMismatch, MembershipError
from .hashing import DEFAULT_CHUNK_SIZE, FORMAT_VERSION, HASH_ALGORITHM
from .ring import DEFAULT_VNODES

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "/kvring"
NODE_STATES = ("joining", "active", "draining", "drained")
LEFT_RING_STATES = frozenset({"draining", "drained"})  # members that own no keys


@dataclass(frozen=True)
class Contract:
    """What every process of a cluster must agree on to compute the same keys and owners."""

    hash_algorithm: str = HASH_ALGORITHM
    chunk_size: int = DEFAULT_CHUNK_SIZE
    format_version: int = FORMAT_VERSION
    vnodes: int = DEFAULT_VNODES
    replication: int = 1

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Contract:
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def differences(self, recorded: Contract) -> list[str]:
        return [
            f"{f.name}: this process has {getattr(self, f.name)!r}, the cluster has {getattr(recorded, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(recorded, f.name)
        ]


class NodeRecord(msgspec.Struct, frozen=True):
    node_id: str
    data_addr: str
    admin_addr: str
    capacity: int
    state: str = "active"
    pid: int = 0


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: tuple[str, ...]  # "host:port"
    cluster: str = "default"
    prefix: str = DEFAULT_PREFIX
    timeout: float = 2.0

    @classmethod
    def parse(cls, endpoints: str | list[str] | tuple[str, ...], **kw) -> EtcdSettings:
        items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        cleaned = []
        for item in items:
            item = item.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
            host, sep, port = item.rpartition(":")
            if not sep or not port.isdigit() or not host:
                raise ValueError(f"etcd endpoint {item!r} is not host:port (e.g. 127.0.0.1:2379)")
            cleaned.append(f"{host}:{port}")
        if not cleaned:
            raise ValueError("no etcd endpoint given; set --etcd host:port")
        return cls(endpoints=tuple(cleaned), **kw)

    def key(self, *parts: str) -> bytes:
        return "/".join([self.prefix.rstrip("/"), self.cluster, *parts]).encode()

    @property
    def nodes_prefix(self) -> bytes:
        return self.key("nodes") + b"/"

    @property
    def drain_prefix(self) -> bytes:
        return self.key("drain") + b"/"


def _check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not node_id or "/" in node_id:
        raise ValueError(f"node id {node_id!r} must be non-empty and contain no '/'")
    return node_id


class Etcd:
    """A reconnecting aetcd client over the configured endpoints (tried in turn)."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._client: aetcd.Client | None = None
        self._next = 0

    async def client(self) -> aetcd.Client:
        if self._client is None:
            host, _, port = self.settings.endpoints[self._next % len(self.settings.endpoints)].rpartition(":")
            self._next += 1
            client = aetcd.Client(host=host, port=int(port), timeout=self.settings.timeout)
            try:
                await asyncio.wait_for(client.connect(), self.settings.timeout)
            except Exception as exc:
                await self._close(client)
                raise MembershipError(f"cannot connect to etcd at {host}:{port}: {exc}") from exc
            self._client = client
        return self._client

    async def call(self, fn: Callable[[aetcd.Client], Awaitable]):
        """Run ``fn(client)``; on failure drop the connection and raise ``MembershipError``."""
        client = await self.client()
        try:
            return await asyncio.wait_for(fn(client), self.settings.timeout * 2)
        except ContractMismatch:
            raise
        except Exception as exc:
            self._client = None
            await self._close(client)
            raise MembershipError(f"etcd request failed: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await self._close(client)

    @staticmethod
    async def _close(client: aetcd.Client) -> None:
        try:
            await asyncio.wait_for(client.close(), 1.0)
        except Exception:
            pass

    # ---- cluster-level operations ------------------------------------------------------------

    async def ensure_contract(self, contract: Contract) -> Contract:
        """Record ``contract`` if the cluster has none; raise ``ContractMismatch`` if it differs."""
        key = self.settings.key("contract")

        async def txn(c: aetcd.Client):
            return await c.transaction(
                compare=[c.transactions.version(key) == 0],
                success=[c.transactions.put(key, contract.to_json())],
                failure=[c.transactions.get(key)],
            )

        created, responses = await self.call(txn)
        if created:
            logger.info("recorded the contract of cluster %r: %s", self.settings.cluster, contract)
            return contract
        recorded = Contract.from_json(responses[0][0][0])
        diff = contract.differences(recorded)
        if diff:
            raise ContractMismatch(
                f"contract mismatch with cluster {self.settings.cluster!r} in etcd: " + "; ".join(diff)
                + ". Start this process with the cluster's settings, or use another --cluster name."
            )
        return recorded

    async def read_contract(self) -> Contract | None:
        got = await self.call(lambda c: c.get(self.settings.key("contract")))
        return Contract.from_json(got.value) if got is not None else None

    async def members(self) -> tuple[dict[str, NodeRecord], int]:
        """All registered nodes and the etcd revision they were read at."""
        rng = await self.call(lambda c: c.get_prefix(self.settings.nodes_prefix))
        out: dict[str, NodeRecord] = {}
        for kv in rng:
            try:
                rec = msgspec.json.decode(kv.value, type=NodeRecord)
            except msgspec.DecodeError:
                logger.warning("ignoring a malformed node record at %s", kv.key)
                continue
            out[rec.node_id] = rec
        return out, rng.header.revision

    async def request_drain(self, node_id: str) -> None:
        """Ask ``node_id`` to hand off its chunks and leave the ring (idempotent)."""
        key = self.settings.key("drain", _check_node_id(node_id))
        value = json.dumps({"requested_at": time.time()}).encode()
        await self.call(lambda c: c.put(key, value))

    async def cancel_drain(self, node_id: str) -> None:
        """Withdraw a drain request; a node still running goes back to ``active``."""
        key = self.settings.key("drain", _check_node_id(node_id))
        await self.call(lambda c: c.delete(key))

    async def drain_requests(self) -> set[str]:
        """Node ids with a pending drain request."""
        rng = await self.call(lambda c: c.get_prefix(self.settings.drain_prefix))
        cut = len(self.settings.drain_prefix)
        return {kv.key[cut:].decode() for kv in rng}

    async def drain_requested(self, node_id: str) -> bool:
        """Whether ``node_id`` has a pending drain request (what a node polls)."""
        got = await self.call(lambda c: c.get(self.settings.key("drain", _check_node_id(node_id))))
        return got is not None

    async def delete_cluster(self) -> int:
        rng = await self.call(lambda c: c.delete_prefix(self.settings.key("")))
        return getattr(rng, "deleted", 0)


class Registrar:
    """Keeps one node's record in etcd under a lease, re-registering after etcd outages."""

    def __init__(self, etcd: Etcd, record: NodeRecord, contract: Contract, ttl: int = 10) -> None:
        self.etcd = etcd
        self.record = record
        self.contract = contract
        self.ttl = ttl
        self.registered = asyncio.Event()
        self.registrations = 0
        self._lease = None
        self._dirty = True
        self._wake = asyncio.Event()

    def set_state(self, state: str) -> None:
        """Change the recorded state; the record is rewritten at once, not at the next refresh."""
        if state not in NODE_STATES:
            raise ValueError(f"unknown node state {state!r}")
        self.record = msgspec.structs.replace(self.record, state=state)
        self._dirty = True
        self._wake.set()

    async def register_once(self) -> None:
        """Check the contract and write the record under a fresh lease (raises on mismatch)."""
        await self.etcd.ensure_contract(self.contract)
        self._lease = await self.etcd.call(lambda c: c.lease(self.ttl))
        await self._put()
        self.registrations += 1
        self.registered.set()

    async def _put(self) -> None:
        key = self.etcd.settings.key("nodes", self.record.node_id)
        value = msgspec.json.encode(self.record)
        await self.etcd.call(lambda c: c.put(key, value, lease=self._lease))
        self._dirty = False

    async def run(self) -> None:
        """Refresh the lease forever; on any etcd failure, retry and register anew."""
        period = max(self.ttl / 3, 0.2)
        while True:
            try:
                if self._lease is None:
                    await self.register_once()
                    logger.info("node %s registered (lease %ss)", self.record.node_id, self.ttl)
                reply = await self.etcd.call(lambda c: c.refresh_lease(self._lease.id))
                if reply is None or getattr(reply, "TTL", 1) <= 0:
                    raise MembershipError("lease expired")
                if self._dirty:
                    await self._put()
            except ContractMismatch:
                raise
            except MembershipError as exc:
                if self._lease is not None:
                    logger.warning("node %s lost etcd (%s); will re-register", self.record.node_id, exc)
                self._lease = None
                self.registered.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), period)
            except TimeoutError:
                pass
            self._wake.clear()

    async def deregister(self) -> None:
        if self._lease is not None:
            lease, self._lease = self._lease, None
            try:
                await self.etcd.call(lambda c: c.revoke_lease(lease.id))
            except MembershipError:
                pass
