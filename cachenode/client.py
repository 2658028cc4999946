"""The cluster client: membership from etcd, routing on the ring, batched parallel I/O.

``ClusterClient`` is the public Python API of the data plane.  It is safe to call from any
number of plain threads (vLLM's worker is not asyncio): all I/O runs on one asyncio loop in
a background thread that the client owns, and every public method blocks only its caller.

Routing: each key goes to its owners on the ring (``replication`` distinct nodes, primary
first).  Requests are batched — one request per node per call — and sent to all nodes in
parallel.  A node that times out or cannot be reached is marked failed for
``failure_backoff`` seconds and its keys are retried on the next owner.  After a ring change,
a key missed on its new owner is looked for on its owner in the previous ring (the ring
before the change), so moving ownership does not turn into a burst of misses.  If etcd goes
away the client keeps routing with the last ring it had.

GET verifies the XXH3 checksum of every layer it receives; a mismatch counts as a miss of
that key (it is never returned).

Nodes that are ``draining`` or ``drained`` stay members (reads and flushes still reach them)
but are left out of the ring, so no key is routed to them first.  Chunks may be put under a
namespace (``namespace=``); ``flush_namespace`` deletes one namespace on every member.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
import zmq

from . import protocol as P
from .chunk import ChunkMeta, make_meta
from .errors import KVRingError, MembershipError, NodeUnavailable, NoOwners, RemoteError
from .membership import LEFT_RING_STATES, Contract, Etcd, EtcdSettings, NodeRecord
from .ring import HashRing

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    """A chunk (or a layer range of it) read back from the cluster."""

    key: bytes
    meta: ChunkMeta
    layer_start: int
    layer_end: int
    data: np.ndarray  # uint8, the layers [layer_start, layer_end) contiguous

    def layer(self, i: int) -> memoryview:
        lb = self.meta.layer_bytes
        off = (i - self.layer_start) * lb
        return memoryview(self.data)[off:off + lb]


@dataclass(slots=True)
class LayerBatch:
    """One layer of several keys, as streamed by ``ClusterClient.iter_layers``."""

    layer: int
    indices: list[int]  # positions in the caller's key list
    views: list[memoryview]  # that layer's bytes of each key, zero-copy from the socket
    span: bool = False  # (``get`` only) each view holds layers [layer, end) of its key


class _Node:
    """A DEALER socket to one node and the requests waiting on it.

    Owned by the client's loop thread.  The socket is a plain (sync) zmq socket driven by
    ``loop.add_reader`` on its edge-triggered FD: sends never block (NOBLOCK), and every
    wake-up or send drains all pending replies.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, ctx: zmq.Context, record: NodeRecord) -> None:
        self.loop = loop
        self.record = record
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(record.data_addr)
        self.pending: dict[int, asyncio.Future | queue.Queue] = {}
        self._fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self.drain)

    def send(self, frames: list) -> None:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            raise NodeUnavailable(f"cannot send to node {self.record.node_id}: {exc}") from exc
        finally:
            # Sending may consume the edge-triggered FD's readiness: look for replies now.
            self.loop.call_soon(self.drain)

    def drain(self) -> None:
        while not self.sock.closed and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._dispatch(frames)

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        try:
            reply = P.decode_reply(frames[0].buffer)
        except Exception:
            logger.warning("undecodable reply from node %s dropped", self.record.node_id)
            return
        waiter = self.pending.get(reply.rid)
        if waiter is None:
            return  # a late reply to a request we stopped waiting for
        if isinstance(waiter, queue.Queue):
            waiter.put((reply, frames[1:]))
            if isinstance(reply, P.Error) or (isinstance(reply, P.GetLayer) and reply.last) or (
                    isinstance(reply, P.GetHead) and not any(reply.metas)):
                self.pending.pop(reply.rid, None)
        else:
            self.pending.pop(reply.rid, None)
            if not waiter.done():
                waiter.set_result((reply, frames[1:]))

    def close(self) -> None:
        self.loop.remove_reader(self._fd)
        self.sock.close(linger=0)
        for waiter in self.pending.values():
            if isinstance(waiter, queue.Queue):
                waiter.put(None)
            elif not waiter.done():
                waiter.cancel()
        self.pending.clear()


class ClusterClient:
    """Client of one kvring cluster.

    ``etcd`` is ``"host:port[,host:port]"`` or ``EtcdSettings``.  ``contract`` is checked
    against the cluster's record (``ContractMismatch`` names the difference); with ``None``
    the client adopts the recorded one.
    """

    def __init__(
        self,
        etcd: str | EtcdSettings,
        *,
        cluster: str = "default",
        contract: Contract | None = None,
        timeout: float = 5.0,
        poll_interval: float = 0.5,
        failure_backoff: float = 5.0,
        handoff_window: float = 120.0,
        verify: bool = True,
    ) -> None:
        self.settings = etcd if isinstance(etcd, EtcdSettings) else EtcdSettings.parse(etcd, cluster=cluster)
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.failure_backoff = failure_backoff
        self.handoff_window = handoff_window
        self.verify = verify
        self.contract: Contract | None = contract
        self.ring = HashRing({}, epoch=0)
        self.prev_ring: HashRing | None = None
        self._prev_until = 0.0
        self.members: dict[str, NodeRecord] = {}
        self._failed: dict[str, float] = {}
        self._rids = itertools.count(1)
        self.corrupt_dropped = 0  # copies that failed their checksum and were deleted
        self._nodes: dict[str, _Node] = {}
        self._closed = False
        self._ring_changed = threading.Condition()
        self.etcd_ok = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvring-client", daemon=True)
        self._thread.start()
        self._ctx = zmq.Context()
        self._etcd = Etcd(self.settings)
        try:
            self._call(self._start(), timeout=self.settings.timeout * 4 + 2)
        except BaseException:
            self.close()
            raise

    # ---- lifecycle and membership -----------------------------------------------------------

    def _call(self, coro, timeout: float | None = None):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise NodeUnavailable(f"request did not finish within {timeout:.1f}s") from None

    async def _start(self) -> None:
        if self.contract is None:
            self.contract = await self._etcd.read_contract() or Contract()
        else:
            self.contract = await self._etcd.ensure_contract(self.contract)
        await self._refresh()
        self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self._refresh()
            except MembershipError as exc:
                if self.etcd_ok:
                    logger.warning("etcd unreachable (%s); routing with the last ring (epoch %d)",
                                   exc, self.ring.epoch)
                self.etcd_ok = False

    async def _refresh(self) -> None:
        members, revision = await self._etcd.members()
        self.etcd_ok = True
        if members == self.members:
            return
        weights = {n: r.capacity for n, r in members.items() if r.state not in LEFT_RING_STATES}
        ring = HashRing(weights, vnodes=self.contract.vnodes, replication=self.contract.replication, epoch=revision)
        for node_id in list(self._nodes):
            rec = members.get(node_id)
            if rec is None or rec.data_addr != self._nodes[node_id].record.data_addr:
                self._nodes.pop(node_id).close()
        for node_id, rec in members.items():
            if node_id not in self._nodes:
                self._nodes[node_id] = _Node(self._loop, self._ctx, rec)
            else:
                self._nodes[node_id].record = rec
            if self.members.get(node_id) != rec:
                self._failed.pop(node_id, None)  # a (re-)registered node gets a fresh chance
        if self.ring.nodes and set(self.ring.nodes) != set(ring.nodes):
            self.prev_ring, self._prev_until = self.ring, time.monotonic() + self.handoff_window
        self.members, self.ring = members, ring
        logger.info("ring epoch %d: %d nodes", revision, len(ring))
        with self._ring_changed:
            self._ring_changed.notify_all()

    def wait_for_nodes(self, count: int, timeout: float = 10.0, exact: bool = False) -> bool:
        """Block until the ring has ``count`` nodes (at least, or exactly)."""
        deadline = time.monotonic() + timeout
        with self._ring_changed:
            while True:
                n = len(self.ring)
                if n == count or (not exact and n >= count):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._ring_changed.wait(min(left, 0.1))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shutdown():
            if getattr(self, "_poller", None):
                self._poller.cancel()
            for node in self._nodes.values():
                node.close()
            self._nodes.clear()
            await self._etcd.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._ctx.term()
        self._loop.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- routing ----------------------------------------------------------------------------

    def owners(self, key: bytes) -> list[str]:
        return self.ring.owners(key)

    def _alive(self, node_id: str) -> bool:
        until = self._failed.get(node_id)
        return node_id in self._nodes and (until is None or until < time.monotonic())

    def _mark_failed(self, node_id: str, why: str) -> None:
        if self._alive(node_id):
            logger.warning("node %s marked failed for %.0fs: %s", node_id, self.failure_backoff, why)
        self._failed[node_id] = time.monotonic() + self.failure_backoff

    def _route(self, keys: Sequence[bytes], ring: HashRing, skip: dict[int, set[str]] | None = None):
        """Group key indices by their first live owner not in ``skip[index]``."""
        if not ring.nodes:
            raise NoOwners(f"no active node in cluster {self.settings.cluster!r}; is `kvring up` running?")
        groups: dict[str, list[int]] = defaultdict(list)
        alive = {n: self._alive(n) for n in ring.nodes}
        for i, owners in enumerate(ring.owners_many(keys)):
            tried = skip.get(i, ()) if skip else ()
            live = [n for n in owners if alive[n] and n not in tried]
            if not live and not tried:  # every owner is marked failed: try them anyway
                live = [n for n in owners if n in self._nodes]
            if live:
                groups[live[0]].append(i)
        return groups

    def _previous_ring(self) -> HashRing | None:
        if self.prev_ring is not None and time.monotonic() < self._prev_until:
            return self.prev_ring
        return None

    # ---- requests (run on the loop) ---------------------------------------------------------

    def _submit(self, node_id: str, msg, payloads=()) -> asyncio.Future:
        """Send a request now; the future resolves to ``(reply, frames)`` or fails."""
        node = self._nodes.get(node_id)
        fut = self._loop.create_future()
        if node is None:
            fut.set_exception(NodeUnavailable(f"node {node_id} is not a member"))
            return fut
        node.pending[msg.rid] = fut
        try:
            node.send([P.encode(msg), *payloads])
        except NodeUnavailable as exc:
            node.pending.pop(msg.rid, None)
            fut.set_exception(exc)
        return fut

    async def _await(self, node_id: str, rid: int, fut: asyncio.Future, timeout: float | None = None):
        timeout = timeout or self.timeout
        timer = self._loop.call_later(timeout, lambda: fut.done() or fut.set_exception(TimeoutError()))
        try:
            reply, frames = await fut
        except TimeoutError:
            self._forget(node_id, rid)
            self._mark_failed(node_id, "timed out")
            raise NodeUnavailable(f"node {node_id} did not answer within {timeout:.1f}s") from None
        except asyncio.CancelledError:
            raise NodeUnavailable(f"node {node_id} left the ring") from None
        finally:
            timer.cancel()
        if isinstance(reply, P.Error):
            raise RemoteError(reply.code, reply.message, node_id)
        return reply, frames

    async def _request(self, node_id: str, msg, payloads=(), timeout: float | None = None):
        return await self._await(node_id, msg.rid, self._submit(node_id, msg, payloads), timeout)

    async def _lookup_on(self, ring: HashRing, keys, idx_subset, lease_ms, present, skip) -> list[int]:
        groups = self._route([keys[i] for i in idx_subset], ring, skip={
            j: skip.get(i, set()) for j, i in enumerate(idx_subset)})
        sent = []
        for node_id, local in groups.items():  # send every node's batch first, then wait
            idx = [idx_subset[j] for j in local]
            msg = P.Lookup(rid=next(self._rids), epoch=ring.epoch, keys=[keys[i] for i in idx], lease_ms=lease_ms)
            sent.append((node_id, idx, msg.rid, self._submit(node_id, msg)))
        failed: list[int] = []
        for node_id, idx, rid, fut in sent:
            try:
                reply, _ = await self._await(node_id, rid, fut)
            except (NodeUnavailable, RemoteError) as exc:
                logger.debug("lookup on %s failed: %s", node_id, exc)
                for i in idx:
                    skip.setdefault(i, set()).add(node_id)
                failed.extend(idx)
                continue
            for i, hit in zip(idx, reply.present):
                present[i] = present[i] or hit
        return failed

    async def _lookup(self, keys: list[bytes], lease_ms: int) -> list[bool]:
        present = [False] * len(keys)
        skip: dict[int, set[str]] = {}
        todo = list(range(len(keys)))
        for _ in range(self.contract.replication):  # retry on the next owner after a failure
            todo = await self._lookup_on(self.ring, keys, todo, lease_ms, present, skip)
            if not todo:
                break
        prev = self._previous_ring()
        if prev is not None:
            missed = [i for i, hit in enumerate(present)
                      if not hit and set(prev.owners(keys[i])) - set(self.ring.owners(keys[i]))]
            if missed:
                await self._lookup_on(prev, keys, missed, lease_ms, present, {
                    i: set(self.ring.owners(keys[i])) for i in missed})
        return present

    async def _put(self, items) -> list[int]:
        """PUT every item to all its owners; returns the number of replicas stored per item."""
        stored = [0] * len(items)
        errors: list[str] = []

        async def one(i, node_id, meta, payload):
            try:
                await self._request(node_id, P.Put(rid=next(self._rids), epoch=self.ring.epoch,
                                                   key=items[i][0], meta=meta), [payload])
                stored[i] += 1
            except (NodeUnavailable, RemoteError) as exc:
                errors.append(str(exc))

        if not self.ring.nodes:
            raise NoOwners(f"no active node in cluster {self.settings.cluster!r}; is `kvring up` running?")
        jobs = []
        owner_lists = self.ring.owners_many([key for key, _, _ in items])
        for i, ((key, meta, payload), owners) in enumerate(zip(items, owner_lists)):
            live = [n for n in owners if self._alive(n)] or [n for n in owners if n in self._nodes]
            for node_id in live:
                jobs.append(one(i, node_id, meta, payload))
        await asyncio.gather(*jobs)
        if errors and not any(stored):
            raise KVRingError(f"no replica stored: {errors[0]}")
        if errors:
            logger.debug("%d replica writes failed, first: %s", len(errors), errors[0])
        return stored

    async def _simple(self, node_id: str, msg):
        reply, _ = await self._request(node_id, msg)
        return reply

    # ---- public API -------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], lease_ms: int = 0) -> list[bool]:
        """Presence of each key (one batched request per owner node, in parallel).

        ``lease_ms`` asks the nodes to keep the present chunks from eviction that long.
        """
        if not keys:
            return []
        return self._call(self._lookup(list(keys), lease_ms), timeout=self.timeout * 3 + 1)

    def lookup_async(self, keys: Sequence[bytes], lease_ms: int = 0) -> concurrent.futures.Future:
        """``lookup`` without waiting: a future of the presence list, resolved on the I/O loop.

        Runs on the client's loop (no thread of the caller's is held); the future fails with
        ``KVRingError`` if the lookup cannot be routed.  Cancelling it cancels the lookup.
        """
        if not keys:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result([])
            return done
        return asyncio.run_coroutine_threadsafe(self._lookup(list(keys), lease_ms), self._loop)

    def lookup_prefix(self, keys: Sequence[bytes], lease_ms: int = 0) -> int:
        """How many leading keys of a chain are all present."""
        n = 0
        for hit in self.lookup(keys, lease_ms):
            if not hit:
                break
            n += 1
        return n

    def put(self, key: bytes, payload, shape: Sequence[int], dtype: str, tokens: int, namespace: str = "") -> int:
        """Store one layer-major chunk on its owners; returns how many replicas stored it."""
        return self.put_many([(key, payload, shape, dtype, tokens)], namespace=namespace)[0]

    def put_array(self, key: bytes, arr: np.ndarray, tokens: int, dtype: str | None = None,
                  namespace: str = "") -> int:
        """``put`` of a NumPy array, layer-major (``dtype`` overrides, e.g. bf16 carried as uint16)."""
        arr = np.ascontiguousarray(arr)
        return self.put(key, arr, arr.shape, dtype or arr.dtype.name, tokens, namespace=namespace)

    def put_many(self, items: Sequence[tuple], namespace: str = "") -> list[int]:
        """Store many chunks ``(key, payload, shape, dtype, tokens)`` in parallel.

        ``namespace`` tags every chunk (so ``flush_namespace`` can remove them); an item may
        carry its own as a sixth element ``(key, payload, shape, dtype, tokens, namespace)``.
        """
        prepared = []
        for item in items:
            if len(item) not in (5, 6):
                raise ValueError("put_many items are (key, payload, shape, dtype, tokens[, namespace]), "
                                 f"got {len(item)} fields")
            key, payload, shape, dtype, tokens = item[:5]
            ns = item[5] if len(item) == 6 else namespace
            if isinstance(payload, np.ndarray):
                payload = np.ascontiguousarray(payload)
            prepared.append((bytes(key), make_meta(payload, shape, dtype, tokens, ns), payload))
        if not prepared:
            return []
        total = sum(memoryview(p).nbytes for _, _, p in prepared)
        return self._call(self._put(prepared), timeout=self.timeout * 2 + total / 100e6)

    def get(self, keys: Sequence[bytes], layers: tuple[int, int] | None = None,
            node: str | None = None) -> list[Chunk | None]:
        """Read chunks (whole, or layers ``[start, end)``); ``None`` where a key is missing.

        ``node`` reads from that node only, whoever owns the keys (handoff, inspection)."""
        keys = list(keys)
        found: list[ChunkMeta | None] = [None] * len(keys)
        out: list[Chunk | None] = [None] * len(keys)
        start = layers[0] if layers is not None else 0
        for batch in self._stream(keys, layers, found, stream=False, pin=node):
            for i, view in zip(batch.indices, batch.views):
                meta = found[i]
                end = meta.layers if layers is None or layers[1] == -1 else layers[1]
                chunk = out[i]
                if chunk is None or chunk.meta is not meta:
                    data = np.frombuffer(view, dtype=np.uint8) if batch.span else np.empty(
                        (end - start) * meta.layer_bytes, dtype=np.uint8)
                    chunk = out[i] = Chunk(keys[i], meta, start, end, data)
                if not batch.span:
                    off = (batch.layer - start) * meta.layer_bytes
                    chunk.data[off:off + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
        return [c if found[i] is not None else None for i, c in enumerate(out)]

    def iter_layers(self, keys: Sequence[bytes], layers: tuple[int, int] | None = None,
                    found: list | None = None) -> Iterator[LayerBatch]:
        """Stream layers as they arrive: one ``LayerBatch`` per node and layer.

        ``found`` (a list as long as ``keys``), if given, receives each key's ``ChunkMeta`` as
        its head arrives, and is ``None`` at the end for every key that could not be read
        whole (missing everywhere, node lost with no replica left, checksum mismatch).
        Layers of different nodes interleave; within a node they arrive in order.  After a
        failover a key's layers may be delivered again from another replica (same bytes), so
        consumers must treat deliveries as idempotent writes.
        """
        yield from self._stream(list(keys), layers, found, stream=True)

    def _stream(self, keys: list[bytes], layers, found, stream: bool, pin: str | None = None) -> Iterator[LayerBatch]:
        start, end = layers if layers is not None else (0, -1)
        if start < 0 or (end != -1 and end <= start):
            raise ValueError(f"layer range {layers} is empty or negative")
        found = found if found is not None else [None] * len(keys)
        done = [False] * len(keys)
        want = [0] * len(keys)  # layers still expected per key
        results: queue.Queue = queue.Queue()
        skip: dict[int, set[str]] = {}
        ring, used_prev = self.ring, False
        todo = list(range(len(keys)))
        for _ in range(self.contract.replication + 2):
            if not todo:
                break
            if pin is not None:
                groups = {pin: list(range(len(todo)))}
            else:
                groups = self._route([keys[i] for i in todo], ring,
                                     skip={j: skip.get(i, set()) for j, i in enumerate(todo)})
            streams: dict[int, tuple[str, list[int], list[int]]] = {}
            for node_id, local in groups.items():
                idx = [todo[j] for j in local]
                msg = P.Get(rid=next(self._rids), epoch=ring.epoch, keys=[keys[i] for i in idx],
                            layer_start=start, layer_end=end, stream=stream)
                streams[msg.rid] = (node_id, idx, [])
                self._loop.call_soon_threadsafe(self._send_stream, node_id, msg, results)
            retry: list[int] = []
            missing: list[int] = []
            while streams:
                try:
                    item = results.get(timeout=self.timeout)
                except queue.Empty:
                    item = None
                if item is None:  # timeout or client closing: every open stream failed
                    for rid, (node_id, idx, got) in streams.items():
                        self._loop.call_soon_threadsafe(self._forget, node_id, rid)
                        self._mark_failed(node_id, "GET timed out")
                        retry.extend(idx)
                    streams.clear()
                    break
                reply, frames = item
                if reply.rid not in streams:
                    continue
                node_id, idx, got = streams[reply.rid]
                if isinstance(reply, P.Error):
                    if reply.code == "bad_range":
                        raise RemoteError(reply.code, reply.message, node_id)
                    retry.extend(idx)
                    del streams[reply.rid]
                elif isinstance(reply, P.GetHead):
                    if len(reply.metas) != len(idx):
                        retry.extend(idx)
                        del streams[reply.rid]
                        continue
                    for i, meta in zip(idx, reply.metas):
                        found[i] = meta
                        if meta is None:
                            missing.append(i)
                        else:
                            got.append(i)
                            want[i] = (meta.layers if end == -1 else end) - start
                    if not got:
                        del streams[reply.rid]
                elif isinstance(reply, P.GetLayer):
                    good_idx, good_views = [], []
                    sums = iter(reply.checksums)
                    for pos, view in zip(reply.which, frames):
                        i = idx[pos]
                        buf = view.buffer
                        meta = found[i]
                        n = want[i] if reply.span else 1
                        lb = meta.layer_bytes if meta is not None else 0
                        expected = [next(sums, None) for _ in range(n)]
                        if meta is None or buf.nbytes != n * lb or (self.verify and any(
                                xxhash.xxh3_64_intdigest(buf[j * lb:(j + 1) * lb]) != expected[j] for j in range(n))):
                            logger.warning("bad or corrupt layer %d of a chunk from %s", reply.layer, node_id)
                            if meta is not None and buf.nbytes == n * lb:  # bytes that fail their checksum
                                self._drop_corrupt(node_id, keys[i])
                            found[i] = None
                            retry.append(i)
                            continue
                        good_idx.append(i)
                        good_views.append(buf)
                        want[i] -= n
                    if good_idx:
                        yield LayerBatch(reply.layer, good_idx, good_views, reply.span)
                    if reply.last:
                        for i in got:
                            done[i] = found[i] is not None and want[i] == 0
                            if not done[i] and found[i] is not None:
                                retry.append(i)
                        del streams[reply.rid]
            owner_of = {i: n for n, local in groups.items() for i in (todo[j] for j in local)}
            for i in retry:
                found[i] = None
                skip.setdefault(i, set()).add(owner_of.get(i, ""))
            todo = sorted(set(i for i in retry if not done[i])) if pin is None else []
            prev = self._previous_ring() if pin is None else None
            if not todo and not used_prev and prev is not None:
                moved = [i for i in missing if not done[i]
                         and set(prev.owners(keys[i])) - set(self.ring.owners(keys[i]))]
                if moved:
                    ring, used_prev, todo = prev, True, moved
                    for i in moved:
                        skip[i] = set(self.ring.owners(keys[i]))
        for i in range(len(keys)):
            if not done[i]:
                found[i] = None

    def _drop_corrupt(self, node_id: str, key: bytes) -> None:
        """Delete a copy that failed its checksum (in the background), so the next save of the
        key can store a good one: PUT of an existing key is a no-op."""
        async def drop():
            try:
                await self._simple(node_id, P.Delete(rid=next(self._rids), keys=[key]))
            except Exception as exc:  # best effort: the copy stays a miss for every reader anyway
                logger.debug("could not delete the corrupt copy on %s: %s", node_id, exc)

        self.corrupt_dropped += 1
        asyncio.run_coroutine_threadsafe(drop(), self._loop)

    def _send_stream(self, node_id: str, msg: P.Get, results: queue.Queue) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            results.put((P.Error(rid=msg.rid, code="gone", message=f"node {node_id} left"), []))
            return
        node.pending[msg.rid] = results
        try:
            node.send([P.encode(msg)])
        except NodeUnavailable as exc:
            node.pending.pop(msg.rid, None)
            results.put((P.Error(rid=msg.rid, code="gone", message=str(exc)), []))

    def _forget(self, node_id: str, rid: int) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            node.pending.pop(rid, None)

    def stats(self) -> dict[str, dict]:
        """STATS of every member (``{"error": ...}`` for nodes that do not answer)."""
        async def all_stats():
            async def one(node_id):
                try:
                    return node_id, (await self._simple(node_id, P.Stats(rid=next(self._rids)))).stats
                except KVRingError as exc:
                    return node_id, {"error": str(exc)}
            return dict(await asyncio.gather(*(one(n) for n in sorted(self._nodes))))
        return self._call(all_stats(), timeout=self.timeout + 1)

    def ping(self, node_id: str) -> float:
        """Round-trip time to one node in seconds."""
        t0 = time.perf_counter()
        self._call(self._simple(node_id, P.Ping(rid=next(self._rids))), timeout=self.timeout + 1)
        return time.perf_counter() - t0

    def delete(self, keys: Sequence[bytes], node: str | None = None) -> int:
        """Delete keys from all their owners (or from ``node`` only); returns copies removed."""
        keys = list(keys)

        async def run():
            groups: dict[str, list[bytes]] = defaultdict(list)
            for key, owners in zip(keys, self.ring.owners_many(keys) if node is None else [[node]] * len(keys)):
                for node_id in owners:
                    groups[node_id].append(key)
            replies = await asyncio.gather(*(self._simple(n, P.Delete(rid=next(self._rids), keys=ks))
                                             for n, ks in groups.items()), return_exceptions=True)
            return sum(r.deleted for r in replies if isinstance(r, P.DeleteReply))
        return self._call(run(), timeout=self.timeout + 1)

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

        async def run():
            async def one(node_id):
                try:
                    reply = await self._simple(node_id, P.Flush(rid=next(self._rids), namespace=namespace))
                    return node_id, reply.deleted
                except KVRingError as exc:
                    return node_id, str(exc)
            return dict(await asyncio.gather(*(one(n) for n in sorted(self._nodes))))
        return self._call(run(), timeout=self.timeout + 1)

    def locate(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Which nodes hold each key: every owner on the current ring is asked (and, right after
        a ring change, the previous owners too), without leasing anything.  For inspection;
        routing uses ``lookup``."""
        keys = list(keys)
        if not keys:
            return []
        prev = self._previous_ring()
        candidates = self.ring.owners_many(keys)  # primary first, then the previous owners
        if prev is not None:
            candidates = [cur + [n for n in old if n not in cur]
                          for cur, old in zip(candidates, prev.owners_many(keys))]
        ask: dict[str, list[int]] = defaultdict(list)
        for i, owners in enumerate(candidates):
            for node_id in owners:
                if node_id in self._nodes:
                    ask[node_id].append(i)

        async def run():
            found: list[set[str]] = [set() for _ in keys]

            async def one(node_id, idx):
                try:
                    reply = await self._simple(node_id, P.Lookup(rid=next(self._rids), epoch=self.ring.epoch,
                                                                 keys=[keys[i] for i in idx]))
                except KVRingError as exc:
                    logger.debug("locate on %s failed: %s", node_id, exc)
                    return
                for i, hit in zip(idx, reply.present):
                    if hit:
                        found[i].add(node_id)
            await asyncio.gather(*(one(n, idx) for n, idx in ask.items()))
            return [[n for n in owners if n in got] for owners, got in zip(candidates, found)]
        return self._call(run(), timeout=self.timeout * 2 + 1)

    def list_keys(self, node: str, after: bytes = b"", limit: int = 10_000) -> list[bytes]:
        """Keys stored on ``node``, in byte order, starting after ``after`` (paged)."""
        reply = self._call(self._simple(node, P.ListKeys(rid=next(self._rids), after=after, limit=limit)),
                           timeout=self.timeout + 1)
        return reply.keys
