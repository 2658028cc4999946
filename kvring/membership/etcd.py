"""Cluster membership and the cluster contract, kept in etcd.

Layout under ``<prefix>/<cluster>/`` (default prefix ``/kvring``):

- ``contract``: the hashing/placement contract, written once by the first process of the
  cluster (a compare-and-swap on the key's version); everyone after compares theirs to it.
- ``nodes/<node-id>``: one JSON ``NodeRecord`` per node, attached to the node's lease (TTL ~10 s,
  kept alive at a third of it).  A node that dies stops refreshing; etcd deletes the record
  when the lease runs out and every client drops the node from its ring.
- ``drain/<node-id>``: a drain request (no lease; JSON with the time it was asked for).  The
  node watches its key, sets its state ``draining`` (clients drop it from the ring, it keeps
  serving reads), hands every chunk to its new owners and then reports ``drained``.  Deleting
  the key (``cancel_drain``) before the node exits sends it back to ``active``.  A node that
  exits after reporting ``drained`` deletes its key itself: the request has been carried out,
  and a pod that later comes back under the same id starts active.
- ``restart/<node-id>``: a restart marker (no lease; JSON with the time and the revision the
  node restarts into), set by the operator before it lets a node's pod go in a rolling update
  of a cluster with a disk tier.  While it exists, the node's preStop ``POST /drain`` does not
  drain: the node keeps its chunks on disk and takes them back when it returns.  The operator
  removes it once the pod is back (``cancel_restart``).  A drain request always wins.
- ``repair/<node-id>``: the node's ``RepairReport`` (attached to its lease), which the
  operator reads to know when repair has settled after a node came back.
- ``events``: where the pool's KV events are published as one stream (``PoolEventsRecord``,
  attached to the publishing process's lease; ``cachenode/pool_events.py``).

Node states are ``kvring.common.types.NodeState``.

Only this package imports ``aetcd``; grpc/etcd failures become ``MembershipError``.
``Etcd`` and ``Registrar`` run on an asyncio loop that their owner drives (the node's or the
client's background thread); their coroutines never block that loop on anything but etcd I/O.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aetcd
import msgspec

from kvring.common.contract import Contract
from kvring.common.errors import ContractMismatch, MembershipError
from kvring.common.records import NodeRecord, PoolEventsRecord, RepairReport

from .settings import EtcdSettings, check_node_id

logger = logging.getLogger(__name__)


def decode_record(key: bytes, value: bytes) -> NodeRecord | None:
    """The node record stored at ``key``, or None (logged) if it is malformed."""
    try:
        return msgspec.json.decode(value, type=NodeRecord)
    except (msgspec.DecodeError, msgspec.ValidationError):
        logger.warning("ignoring a malformed node record at %s", key)
        return None


def decode_contract(key: bytes, value: bytes) -> Contract | None:
    """The contract stored at ``key``, or None (logged) if it is unreadable: whoever follows the
    cluster keeps the contract it has rather than stop following."""
    try:
        return Contract.from_json(value)
    except (ValueError, TypeError, AttributeError):
        logger.error("ignoring an unreadable contract at %s", key)
        return None


@dataclass(frozen=True)
class ClusterSnapshot:
    """A cluster's contract and members as of one etcd revision (one range read)."""

    contract: Contract | None
    members: dict[str, NodeRecord]
    revision: int
    pool_events: PoolEventsRecord | None = None  # the pool's event stream, if one is running


@dataclass(frozen=True)
class RestartView:
    """What a rolling restart needs to know of a cluster, from one range read of its prefix."""

    members: dict[str, NodeRecord]
    # node id -> etcd revision its record last changed at: every client's ring is at least this
    # new once it has seen the record as it is (a node that came back writes a new incarnation)
    written: dict[str, int]
    repair: dict[str, RepairReport]
    restarting: set[str]  # node ids with a restart marker
    revision: int


def decode_report(key: bytes, value: bytes) -> RepairReport | None:
    try:
        return msgspec.json.decode(value, type=RepairReport)
    except (msgspec.DecodeError, msgspec.ValidationError):
        logger.warning("ignoring a malformed repair report at %s", key)
        return None


@dataclass(frozen=True)
class Change:
    """One change under a cluster's prefix, as a watch delivers it."""

    key: bytes
    value: bytes | None  # None: the key was deleted
    revision: int


@dataclass(frozen=True)
class Holder:
    """Who holds a node id in etcd: its record (None if unreadable) and the lease it is under."""

    record: NodeRecord | None
    lease: int
    mod_revision: int


# gRPC ends a call in flight with ``CancelledError`` when its channel is closed under it: by
# another call on the same ``Etcd`` that failed and dropped the connection (the registrar's lease
# refresh while the repair report's write fails, etcd being down).  That is an etcd failure of this
# call, not a request to stop its task; let through, it ended the registration thread for good.
_CLOSED_UNDER_IT = "the call was cancelled under it (its connection was closed)"


def _asked_to_stop() -> bool:
    """Whether the running task itself is being cancelled (then ``CancelledError`` goes through)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


# Each connection a subchannel of its own, reconnecting within two seconds.  gRPC shares
# subchannels between the channels of a process (its global pool), with their reconnect backoff
# (growing 1.6x up to 120 s): a connection made after etcd had been out of reach a while
# inherited that backoff, and reached etcd 1-12 s after it answered (a connector reaching its
# cluster, 5-25 s); with a subchannel of its own, the first call after it answers succeeds.
CHANNEL_OPTIONS = {"grpc.use_local_subchannel_pool": 1, "grpc.initial_reconnect_backoff_ms": 250,
                   "grpc.min_reconnect_backoff_ms": 250, "grpc.max_reconnect_backoff_ms": 2000}


class Etcd:
    """A reconnecting aetcd client over the configured endpoints (tried in turn)."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._client: aetcd.Client | None = None
        self._next = 0
        self._connecting = asyncio.Lock()  # one connection at a time: tasks sharing this client wait for it

    async def client(self) -> aetcd.Client:
        async with self._connecting:
            if self._client is None:
                host, _, port = self.settings.endpoints[self._next % len(self.settings.endpoints)].rpartition(":")
                self._next += 1
                client = aetcd.Client(host=host, port=int(port), timeout=self.settings.timeout, options=CHANNEL_OPTIONS)
                try:
                    await asyncio.wait_for(client.connect(), self.settings.timeout)
                except (Exception, asyncio.CancelledError) as exc:
                    await self._close(client)
                    if isinstance(exc, asyncio.CancelledError) and _asked_to_stop():
                        raise
                    raise MembershipError(f"cannot connect to etcd at {host}:{port}: {exc}") from exc
                self._client = client
            return self._client

    async def call(self, fn: Callable[[aetcd.Client], Awaitable]):
        """Run ``fn(client)``; on failure drop the connection and raise ``MembershipError``."""
        client = await self.client()
        try:
            return await asyncio.wait_for(fn(client), self.settings.call_timeout)
        except ContractMismatch:
            raise
        except asyncio.CancelledError as exc:
            if _asked_to_stop():
                raise
            await self._drop(client)
            raise MembershipError(f"etcd request failed: {_CLOSED_UNDER_IT}") from exc
        except Exception as exc:
            await self._drop(client)
            raise MembershipError(f"etcd request failed: {type(exc).__name__}: {exc}") from exc

    async def _drop(self, client: aetcd.Client) -> None:
        """Forget a connection that failed (the next call connects again, to the next endpoint)."""
        if self._client is client:
            self._client = None
        await self._close(client)

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
            rec = decode_record(kv.key, kv.value)
            if rec is not None:
                out[rec.node_id] = rec
        return out, rng.header.revision

    async def snapshot(self) -> ClusterSnapshot:
        """The contract and every node record, in one range read of the cluster's prefix."""
        rng = await self.call(lambda c: c.get_prefix(self.settings.key("")))
        contract_key, nodes = self.settings.key("contract"), self.settings.nodes_prefix
        contract, members, events = None, {}, None
        for kv in rng:
            if kv.key == contract_key:
                contract = decode_contract(kv.key, kv.value)
            elif kv.key == self.settings.key("events"):
                try:
                    events = msgspec.json.decode(kv.value, type=PoolEventsRecord)
                except msgspec.DecodeError:
                    logger.warning("ignoring a malformed pool events record in etcd")
            elif kv.key.startswith(nodes) and (rec := decode_record(kv.key, kv.value)) is not None:
                members[rec.node_id] = rec
        return ClusterSnapshot(contract, members, rng.header.revision, events)

    async def put_pool_events(self, record: PoolEventsRecord, lease_id: int) -> None:
        """Say where the pool's event stream is, for as long as ``lease_id`` lives."""
        value = msgspec.json.encode(record)
        await self.call(lambda c: c.put(self.settings.key("events"), value, lease=lease_id))

    async def changes(self, after: int, key: bytes | None = None) -> AsyncIterator[Change]:
        """Every change under the cluster's prefix (or of ``key`` alone) after revision ``after``,
        as it happens (a watch: no request while nothing changes).  Ends with ``MembershipError``
        when the stream breaks or ``after`` was compacted away; the caller reads again and
        watches from there."""
        client = await self.client()
        try:
            watching = client.watch(key, start_revision=after + 1) if key is not None else \
                client.watch_prefix(self.settings.key(""), start_revision=after + 1)
            watch = await asyncio.wait_for(watching, self.settings.call_timeout)
        except Exception as exc:
            await self._drop(client)
            raise MembershipError(f"cannot watch etcd: {type(exc).__name__}: {exc}") from exc
        try:
            async for event in watch:
                value = event.kv.value if event.kind == "PUT" else None
                yield Change(event.kv.key, value, event.kv.mod_revision)
        except aetcd.exceptions.RevisionCompactedError as exc:
            raise MembershipError(f"etcd compacted revision {after + 1} away") from exc
        except asyncio.CancelledError as exc:
            if _asked_to_stop():
                raise
            await self._drop(client)
            raise MembershipError(f"the etcd watch broke: {_CLOSED_UNDER_IT}") from exc
        except Exception as exc:
            await self._drop(client)
            raise MembershipError(f"the etcd watch broke: {type(exc).__name__}: {exc}") from exc
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), 1.0)
            except Exception:
                pass
        raise MembershipError("the etcd watch ended")

    async def claim_node(self, record: NodeRecord, lease_id: int, replacing: Holder | None = None) -> Holder | None:
        """Write ``record`` under ``lease_id`` if its node id is free -- or, with ``replacing``,
        if the record is still exactly what ``replacing`` saw (one transaction either way).
        Returns None once written, else the current holder."""
        key = self.settings.key("nodes", check_node_id(record.node_id))
        value = msgspec.json.encode(record)

        async def txn(c: aetcd.Client):
            t = c.transactions
            unchanged = t.version(key) == 0 if replacing is None else t.mod(key) == replacing.mod_revision
            return await c.transaction(compare=[unchanged], success=[t.put(key, value, lease=lease_id)],
                                       failure=[t.get(key)])

        written, responses = await self.call(txn)
        if written:
            return None
        if not responses[0]:  # deleted in between: free, as of revision 0
            return Holder(None, 0, 0)
        raw, meta = responses[0][0]
        try:
            holder = msgspec.json.decode(raw, type=NodeRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            holder = None
        return Holder(holder, meta.lease, meta.mod_revision)

    async def request_drain(self, node_id: str) -> None:
        """Ask ``node_id`` to hand off its chunks and leave the ring (idempotent)."""
        key = self.drain_key(node_id)
        value = json.dumps({"requested_at": time.time()}).encode()
        await self.call(lambda c: c.put(key, value))

    async def cancel_drain(self, node_id: str) -> None:
        """Withdraw a drain request; a node still running goes back to ``active``."""
        key = self.drain_key(node_id)
        await self.call(lambda c: c.delete(key))

    async def drain_requests(self) -> set[str]:
        """Node ids with a pending drain request."""
        return await self._node_ids_under(self.settings.drain_prefix)

    async def _node_ids_under(self, prefix: bytes) -> set[str]:
        """The node ids that name a key under ``prefix`` (drain requests, restart markers)."""
        rng = await self.call(lambda c: c.get_prefix(prefix))
        return {kv.key[len(prefix):].decode() for kv in rng}

    async def drain_requested(self, node_id: str) -> bool:
        """Whether ``node_id`` has a pending drain request."""
        return (await self.drain_request(node_id))[0]

    async def drain_request(self, node_id: str) -> tuple[bool, int]:
        """Whether ``node_id`` has a pending drain request, and the revision it was read at (to
        watch its key from: ``changes(revision, key=drain_key(node_id))``)."""
        rng = await self.call(lambda c: c.get_prefix(self.drain_key(node_id)))
        return any(kv.key == self.drain_key(node_id) for kv in rng), rng.header.revision

    def drain_key(self, node_id: str) -> bytes:
        return self.settings.key("drain", check_node_id(node_id))

    async def request_restart(self, node_id: str, revision: str = "") -> None:
        """Mark ``node_id`` as restarting into ``revision``: its next ``POST /drain`` keeps its chunks
        (idempotent)."""
        key = self.restart_key(node_id)
        value = json.dumps({"requested_at": time.time(), "revision": revision}).encode()
        await self.call(lambda c: c.put(key, value))

    async def cancel_restart(self, node_id: str) -> None:
        """Remove ``node_id``'s restart marker (a drain through its preStop hands off again)."""
        key = self.restart_key(node_id)
        await self.call(lambda c: c.delete(key))

    async def restart_requests(self) -> set[str]:
        """Node ids with a restart marker."""
        return await self._node_ids_under(self.settings.restart_prefix)

    async def restart_requested(self, node_id: str) -> bool:
        """Whether ``node_id`` has a restart marker."""
        got = await self.call(lambda c: c.get(self.restart_key(node_id)))
        return got is not None

    def restart_key(self, node_id: str) -> bytes:
        return self.settings.key("restart", check_node_id(node_id))

    async def put_repair_report(self, report: RepairReport, lease_id: int) -> None:
        """Write a node's repair report under its lease."""
        key = self.settings.key("repair", check_node_id(report.node_id))
        value = msgspec.json.encode(report)
        await self.call(lambda c: c.put(key, value, lease=lease_id))

    async def restart_view(self) -> RestartView:
        """Members with the revisions their records were written at, repair reports and restart markers, in one
        range read of the cluster's prefix."""
        rng = await self.call(lambda c: c.get_prefix(self.settings.key("")))
        s = self.settings
        members, written, repair, restarting = {}, {}, {}, set()
        for kv in rng:
            if kv.key.startswith(s.nodes_prefix):
                if (rec := decode_record(kv.key, kv.value)) is not None:
                    members[rec.node_id] = rec
                    written[rec.node_id] = kv.mod_revision
            elif kv.key.startswith(s.repair_prefix):
                if (report := decode_report(kv.key, kv.value)) is not None:
                    repair[report.node_id] = report
            elif kv.key.startswith(s.restart_prefix):
                restarting.add(kv.key[len(s.restart_prefix):].decode())
        return RestartView(members, written, repair, restarting, rng.header.revision)

    async def delete_cluster(self) -> int:
        rng = await self.call(lambda c: c.delete_prefix(self.settings.key("")))
        return getattr(rng, "deleted", 0)
