"""``ClusterClient``: the public Python API of the data plane, a thin facade.

Which thread runs what:
- every data call (``lookup``, ``get``, ``iter_layers``, ``put_many``, ``delete``, ``locate``,
  ``flush_namespace``, ``stats``, ``ping``, ``list_keys``) runs entirely on the caller's thread:
  it checks out connections to the nodes it needs, sends, and reads the replies itself, with no
  hand-off to another thread.  Any number of threads may call at once (vLLM's worker is not
  asyncio);
- ``lookup_async`` runs a lookup on one of the client's ``lookup_threads`` and returns a future;
- one membership thread (``ringview.Membership``) watches etcd and publishes the ring.

The parts: ``transport`` (connections and exchanges), ``ringview`` (members, ring, previous
ring, failure marks), ``reads`` (lookup, locate, GET with failover and checksums), ``writes``
(PUT to every owner, delete, flush, one-node calls).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvring.common import protocol as P
from kvring.common.chunk import ChunkItem
from kvring.common.contract import Contract
from kvring.common.errors import KVRingError
from kvring.common.records import NodeRecord
from kvring.common.ring import HashRing
from kvring.common.tls import ClusterCredentials
from kvring.membership.settings import EtcdSettings

from .meter import NO_METER, ReadMeter
from .reads import Chunk, LayerBatch, Place, Reads, readers_pay_off
from .ringview import FailureMarks, Membership
from .transport import Links, next_rid
from .writes import Writes


@dataclass(frozen=True)
class AnchorsDropped:
    """What ``ClusterClient.drop_anchors`` did."""

    anchors: list[bytes]  # the anchors of parts held nowhere: deleted (their chunks withdrawn)
    held: int  # parts some owner holds (or one owner did not answer for): their chunks kept
    copies_deleted: int  # anchor copies deleted, on all the anchors' owners


class ClusterClient:
    """Client of one kvring cluster.

    ``etcd`` is ``"host:port[,host:port]"`` or ``EtcdSettings``.  ``contract`` is checked
    against the cluster's record (``ContractMismatch`` names the difference); with ``None``
    the client adopts the recorded one, waiting up to ``contract_wait`` seconds for the
    cluster's first node to record it (never a default; a contract that later changes in etcd
    turns reads into misses and writes into no-ops).  ``timeout`` bounds how long a node may
    stay silent while a request waits on it; a node that times out is skipped for
    ``failure_backoff`` seconds.  ``verify`` checks every layer's checksum on read.
    ``read_threads``: a GET that asks several nodes reads each on a thread of its own (``True``),
    or all on the caller's thread (``False``); ``None`` picks by the CPUs this process may use
    (``reads.readers_pay_off``).  Large
    payloads are read into slabs (up to ``buffer_pool_bytes``) that are reused once the caller
    has dropped every view of them, so reads do not pay for fresh memory each time
    (``reserve_buffers`` maps them ahead).  ``tls``: the cluster's credentials
    (``ClusterCredentials.at(dir)``), for a cluster whose nodes run with ``--tls-dir``.
    ``wait=False`` returns at once and reaches the cluster in the background, however long that
    takes (``attached``): until then every read is a miss and every write a no-op (the connector:
    vLLM serves without its cache meanwhile).  ``require(contract)`` names what else this process
    cannot work with in the cluster's contract: if anything, that is a conflict (reads miss,
    writes are dropped).
    """

    def __init__(
        self,
        etcd: str | EtcdSettings,
        *,
        cluster: str = "default",
        contract: Contract | None = None,
        timeout: float = 5.0,
        resync_interval: float = 30.0,
        failure_backoff: float = 5.0,
        handoff_window: float = 120.0,
        verify: bool = True,
        lookup_threads: int = 4,
        buffer_pool_bytes: int = 256 << 20,
        contract_wait: float = 30.0,
        tls: ClusterCredentials | None = None,
        read_threads: bool | None = None,
        wait: bool = True,
        require: Callable[[Contract], list[str]] | None = None,
    ) -> None:
        self.settings = etcd if isinstance(etcd, EtcdSettings) else EtcdSettings.parse(etcd, cluster=cluster)
        self.timeout = timeout
        self.marks = FailureMarks(failure_backoff)
        self.links = Links(connect_timeout=timeout, buffer_pool_bytes=buffer_pool_bytes,
                           tls=tls.client_context if tls is not None else None)
        self._closed = False
        self.membership = Membership(self.settings, contract, resync_interval, handoff_window, self._members_changed,
                                     contract_wait, require)
        self._lookups = concurrent.futures.ThreadPoolExecutor(lookup_threads, thread_name_prefix="kvring-lookup")
        cluster_name = self.settings.cluster
        self.reads = Reads(self.links, self.membership, self.marks, timeout, verify, cluster_name,
                           readers_pay_off() if read_threads is None else read_threads)
        self.writes = Writes(self.links, self.membership, self.marks, timeout, cluster_name)
        if not wait:
            self.membership.start_background()
            return
        try:
            self.membership.start(timeout=self.settings.timeout * 4 + 2 + contract_wait)
        except BaseException:
            self.close()
            raise

    def _members_changed(self, members: dict[str, NodeRecord]) -> None:
        old = self.membership.view.members
        self.links.update({n: r.data_addr for n, r in members.items()})
        for node_id, rec in members.items():
            if old.get(node_id) != rec:
                self.marks.forgive(node_id)  # a (re-)registered node gets a fresh chance

    # ---- the cluster as this client sees it ---------------------------------------------------

    @property
    def contract(self) -> Contract | None:
        """The cluster's contract (None only while a client started with ``wait=False`` has not
        reached the cluster yet)."""
        return self.membership.contract

    @property
    def attached(self) -> bool:
        """The cluster was reached and its contract read: always, unless started with ``wait=False``."""
        return self.membership.attached.is_set()

    @property
    def ring(self) -> HashRing:
        return self.membership.view.ring

    @property
    def members(self) -> dict[str, NodeRecord]:
        return self.membership.view.members

    @property
    def etcd_ok(self) -> bool:
        return self.membership.etcd_ok

    @property
    def corrupt_dropped(self) -> int:
        """Copies that failed their checksum on read and were deleted."""
        return self.reads.corrupt_dropped

    def owners(self, key: bytes) -> list[str]:
        return self.ring.owners(key)

    def wait_for_nodes(self, count: int, timeout: float = 10.0, exact: bool = False) -> bool:
        """Block until the ring has ``count`` nodes (at least, or exactly)."""
        return self.membership.wait_for_nodes(count, timeout, exact)

    def reserve_buffers(self, nbytes: int) -> None:
        """Map ``nbytes`` of the receive buffers now (within ``buffer_pool_bytes``), so the first
        reads run at the speed of later ones instead of paying page faults (a server's start-up)."""
        self.links.buffers.reserve(nbytes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self.reads.close()
        self.membership.close()
        self.links.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reads ----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], lease_ms: int = 0, meter: ReadMeter = NO_METER) -> list[bool]:
        """Presence of each key (one batched request per owner node, in parallel).

        ``lease_ms`` asks the nodes to keep the present chunks from eviction that long;
        ``meter`` records what each node's answer cost (``meter.py``)."""
        return self.reads.lookup(list(keys), lease_ms, meter) if keys else []

    def lookup_async(self, keys: Sequence[bytes], lease_ms: int = 0,
                     meter: ReadMeter = NO_METER) -> concurrent.futures.Future:
        """``lookup`` without waiting: a future of the presence list, run on a lookup thread.

        The future fails with ``KVRingError`` if the lookup cannot be routed; cancelling it
        before it runs drops it."""
        return self._lookups.submit(self.lookup, list(keys), lease_ms, meter)

    def lookup_prefix(self, keys: Sequence[bytes], lease_ms: int = 0) -> int:
        """How many leading keys of a chain are all present."""
        n = 0
        for hit in self.lookup(keys, lease_ms):
            if not hit:
                break
            n += 1
        return n

    def locate(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Which nodes hold each key (every owner asked, without leasing); for inspection."""
        return self.reads.locate(list(keys)) if keys else []

    def held_nowhere(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: every owner answered and none holds it (``locate``'s strict form)."""
        return self.reads.held_nowhere(list(keys)) if keys else []

    def drop_anchors(self, parts: Mapping[bytes, bytes]) -> AnchorsDropped:
        """``parts``: chunk parts gone from somewhere, each with its chunk's anchor.  Every owner
        of each part is asked whether it holds it (``held_nowhere``); the anchors of the parts
        held nowhere are deleted on all their owners, so the pool's KV events withdraw their
        chunks (``cachenode/anchors.py``).  A part with an owner that did not answer keeps its
        chunk.  Raises ``KVRingError`` if the cluster cannot be asked."""
        keys = list(parts)
        nowhere = self.held_nowhere(keys)
        anchors = sorted({parts[key] for key, gone in zip(keys, nowhere) if gone})
        copies = self.delete(anchors) if anchors else 0
        return AnchorsDropped(anchors, held=sum(1 for gone in nowhere if not gone), copies_deleted=copies)

    def get(self, keys: Sequence[bytes], layers: tuple[int, int] | None = None,
            node: str | None = None) -> list[Chunk | None]:
        """Read chunks (whole, or layers ``[start, end)``); ``None`` where a key is missing.

        ``node`` reads from that node only, whoever owns the keys (handoff, inspection)."""
        return self.reads.get(list(keys), layers, node)

    def iter_layers(self, keys: Sequence[bytes], layers: tuple[int, int] | None = None,
                    found: list | None = None, meter: ReadMeter = NO_METER, place: Place | None = None
                    ) -> Iterator[LayerBatch]:
        """Stream layers as they arrive: one ``LayerBatch`` per node and layer.

        ``found`` (a list as long as ``keys``), if given, receives each key's ``ChunkMeta`` as
        its head arrives, and is ``None`` at the end for every key that could not be read
        whole (missing everywhere, node lost with no replica left, checksum mismatch).
        Layers of different nodes interleave; within a node they arrive in order.  After a
        failover a key's layers may be delivered again from another replica (same bytes), so
        consumers must treat deliveries as idempotent writes.  The views stay valid after the
        next batch arrives (each is a buffer of its own).  ``meter`` records what each node's
        share cost (``meter.py``).

        ``place(position, layer, size)``, if given, may give a key's layer a place of its own (a
        ``Landing``: views into a KV cache's blocks): its bytes are then received straight into
        it and checked there, and the batch holds a ``Landed`` for it instead of a view.  A
        layer that fails its checksum has been written all the same: it is not delivered, and
        the caller must treat its place as not loaded unless a replica's delivery follows."""
        yield from self.reads.stream(list(keys), layers, found, stream=True, meter=meter, place=place)

    # ---- writes ---------------------------------------------------------------------------------

    def put_many(self, items: Sequence[ChunkItem]) -> list[int]:
        """Store many chunks on their owners, in parallel; returns the replicas stored per item."""
        if not items:
            return []
        if not all(isinstance(item, ChunkItem) for item in items):
            raise TypeError("put_many takes ChunkItem records: ChunkItem.of(key, payload, shape, dtype, tokens)")
        return self.writes.put_many(items)

    def put(self, key: bytes, payload, shape: Sequence[int], dtype: str, tokens: int, namespace: str = "") -> int:
        """Store one layer-major chunk on its owners; returns how many replicas stored it."""
        return self.put_many([ChunkItem.of(key, payload, shape, dtype, tokens, namespace)])[0]

    def put_to(self, copies: Mapping[str, Sequence[ChunkItem]]) -> dict[str, list[bool]]:
        """Store each node's items on that node, whoever owns them (repair, handoff); returns,
        per node, which of its items it stored."""
        return self.writes.put_to(copies)

    def holders(self, node: str, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` ``node`` holds (one LOOKUP, nothing leased); raises its error."""
        present: list[bool] = []
        for i in range(0, len(keys), P.MAX_KEYS_PER_REQUEST):
            batch = list(keys[i:i + P.MAX_KEYS_PER_REQUEST])
            present += self.writes.call(node, P.Lookup(rid=next_rid(), keys=batch)).present
        return present

    def delete(self, keys: Sequence[bytes], node: str | None = None) -> int:
        """Delete keys from all their owners (or from ``node`` only); returns copies removed."""
        return self.writes.delete(list(keys), node) if keys else 0

    def flush_namespace(self, namespace: str) -> int:
        """Delete every chunk of ``namespace`` on every member; returns how many were deleted.

        Raises ``KVRingError`` naming the nodes that did not confirm (their chunks of the
        namespace may remain; flushing again is safe).  ``""`` (chunks without a namespace) is
        refused: it never means "everything"."""
        per_node = self.flush_namespace_nodes(namespace)
        failed = {n: r for n, r in per_node.items() if isinstance(r, str)}
        deleted = sum(r for r in per_node.values() if isinstance(r, int))
        if failed:
            detail = "; ".join(f"{n}: {why}" for n, why in sorted(failed.items()))
            raise KVRingError(f"flushed {deleted} chunks of {namespace!r}, but {len(failed)} node(s) did not "
                              f"confirm ({detail}); run the flush again when they are back")
        return deleted

    def flush_namespace_nodes(self, namespace: str) -> dict[str, int | str]:
        """``flush_namespace`` node by node: chunks deleted, or why that node failed."""
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("a namespace to flush must be a non-empty string; chunks put without one "
                             "cannot be flushed (that would mean the whole cluster)")
        replies = self.writes.each_member(lambda: P.Flush(rid=next_rid(), namespace=namespace))
        return {n: r.deleted if isinstance(r, P.FlushReply) else str(r) for n, r in replies.items()}

    # ---- one node -------------------------------------------------------------------------------

    def stats(self) -> dict[str, dict]:
        """STATS of every member (``{"error": ...}`` for nodes that do not answer)."""
        replies = self.writes.each_member(lambda: P.Stats(rid=next_rid()))
        return {n: r.stats if isinstance(r, P.StatsReply) else {"error": str(r)} for n, r in replies.items()}

    def ping(self, node_id: str) -> float:
        """Round-trip time to one node in seconds."""
        t0 = time.perf_counter()
        self.writes.call(node_id, P.Ping(rid=next_rid()))
        return time.perf_counter() - t0

    def list_keys(self, node: str, after: bytes = b"", limit: int = 10_000) -> list[bytes]:
        """Keys stored on ``node``, in byte order, starting after ``after`` (paged)."""
        return self.writes.call(node, P.ListKeys(rid=next_rid(), after=after, limit=limit)).keys

    def copies(self, nodes: Sequence[str] | None = None) -> Counter[bytes]:
        """How many of ``nodes`` (default: every member) hold each key, from their key lists; for
        inspection and tests (it pages through every key of every node)."""
        count: Counter[bytes] = Counter()
        for node_id in sorted(self.members) if nodes is None else nodes:
            after = b""
            while keys := self.list_keys(node_id, after, 10_000):
                count.update(keys)
                after = keys[-1]
        return count

    def request(self, node: str, msg):
        """Send one protocol request to one node and return its reply (tests, tools)."""
        return self.writes.call(node, msg)


