"""Reads: LOOKUP, locate, and the GET of whole chunks or streamed layers, with failover.

Threading contract: every function may be called from many threads at once; shared state is
only the ``Links``, the ``Membership`` view (read once per call) and the ``FailureMarks``.
LOOKUPs, and a GET round that asks one node, run on the caller's thread (one ``Exchange``).
With ``parallel``, a GET round that asks several nodes reads each node's replies on a thread of
its own (an ``Exchange`` each, from a pool the ``Reads`` keeps): decrypting one node's stream
(which releases the GIL), checking its checksums and the caller's work on the layers already
delivered (copying them into a KV cache) then run on several cores at once, where one thread
does them one after the other.  The caller's thread still makes every decision (routing,
failover, what is delivered); the readers only move bytes and hash them, and hand each reply
over through a bounded queue (a caller that falls behind stops the readers, and TCP stops the
nodes).  A caller that stops iterating stops the readers at their next reply.  The threads cost
CPU of their own (hand-overs, the GIL passing between them, bytes decrypted on one core and
copied on another), which pays off only where cores are idle: ``readers_pay_off``; and not for
a caller that has the layers received straight into their places (``place``: no copy left to
take off its thread), whose rounds stay on its thread.

Routing: each key goes to its first live owner on the ring (``replication`` distinct nodes,
primary first), one request per node, all nodes in parallel.  A key that owner does not hold
(it restarted empty, or evicted it) or that fails there is asked of its next owner, and so on
through its owners; a node that fails is marked.  After a ring change, a key missed on its
new owners is looked for on its owner in the previous ring.  GET verifies the XXH3 checksum of
every layer it receives; a mismatch is a miss of that key (it is never returned) and the
corrupt copy is deleted, so the next save can store a good one.

A caller's ``ReadMeter`` (``meter.py``) records what each node's share of a LOOKUP or GET cost.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import numpy as np
import xxhash

from kvring.common import protocol as P
from kvring.common.chunk import ChunkMeta
from kvring.common.errors import ErrorCode, KVRingError, NoOwners, RemoteError
from kvring.common.ring import HashRing

from ..landing import Landed, Landing
from .meter import NO_METER, ReadMeter
from .ringview import FailureMarks, Membership
from .transport import Exchange, Failure, Links, Reply, next_rid

logger = logging.getLogger(__name__)

READER_THREADS = 32  # per client: the node readers of concurrent GET rounds
# Reader threads pay off from this many usable CPUs on.  Measured (``kvring bench reads``): on 2
# cores shared with the nodes, a load was no faster with them, its CPU per byte a quarter higher.
READERS_MIN_CPUS = 4
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # this process's CPU quota, where cgroup v2 sets one
_QUEUED_PER_NODE = 4  # replies a node's reader may hold ahead of the caller
_STOPPED = object()  # a reader's last item: it has nothing more to hand over
# Where a streamed layer of a key goes instead of a buffer: ``place(position in the caller's key
# list, layer, size)`` -> a ``Landing`` (``landing.py``), or None for a buffer as usual.
Place = Callable[[int, int, int], "Landing | None"]


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
    # That layer's bytes of each key, zero-copy from the socket; a ``Landed`` where the caller's
    # ``place`` gave the layer a place of its own: its bytes are there already, checked.
    views: list[memoryview | Landed]
    span: bool = False  # (``get`` only) each view holds layers [layer, end) of its key


@dataclass(slots=True)
class KeyRead:
    """Where one key of a GET stands: its metadata once a head names it, the layers still
    expected, the nodes already tried, and whether it is complete."""

    key: bytes
    positions: list[int]  # where the caller listed it (a key listed twice is read once)
    meta: ChunkMeta | None = None
    want: int = 0
    next_layer: int = 0  # the number its next layer must carry: a node streams them in order
    done: bool = False
    missing: bool = False  # an owner answered "not stored"
    tried: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Arrived:
    """One event of a GET round's node, as its reader saw it: when (for the ``ReadMeter``), and
    for a ``GetLayer`` with ``verify``, the XXH3 of each payload's layers (``None``: a payload
    whose size is not whole layers of its chunk; the caller rejects it)."""

    event: Reply | Failure
    at: float
    digests: list[list[int] | None] | None = None


class Reads:
    def __init__(self, links: Links, membership: Membership, marks: FailureMarks, timeout: float,
                 verify: bool, cluster: str, parallel: bool = False) -> None:
        self.links = links
        self.membership = membership
        self.marks = marks
        self.timeout = timeout
        self.verify = verify
        self.cluster = cluster
        self.corrupt_dropped = 0  # copies that failed their checksum and were deleted
        self.parallel = parallel  # a GET round of several nodes: a reader thread per node
        self._readers: ThreadPoolExecutor | None = None
        self._readers_lock = threading.Lock()

    def close(self) -> None:
        """Let the node readers' threads go (a round still reading finishes its current reply)."""
        with self._readers_lock:
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=False, cancel_futures=True)

    @property
    def replication(self) -> int:
        return self.membership.contract.replication

    def route(self, ring: HashRing, keys: Sequence[bytes], skip: Sequence[set[str]] = ()) -> dict[str, list[int]]:
        """Group key positions by their first live owner not in ``skip[position]``."""
        if not ring.nodes:
            raise NoOwners(f"no active node in cluster {self.cluster!r}; is `kvring up` running?")
        groups: dict[str, list[int]] = defaultdict(list)
        alive = {n: self.marks.alive(n) and n in self.links for n in ring.nodes}
        if all(alive.values()) and not any(skip):  # the common case: every key to its primary
            if len(ring.nodes) == 1:
                return {ring.nodes[0]: list(range(len(keys)))}
            for i, node_id in enumerate(ring.primaries(keys)):
                groups[node_id].append(i)
            return groups
        for i, owners in enumerate(ring.owners_many(keys)):
            tried = skip[i] if skip else ()
            live = [n for n in owners if alive[n] and n not in tried]
            if not live and not tried:  # every owner is marked failed: try them anyway
                live = [n for n in owners if n in self.links]
            if live:
                groups[live[0]].append(i)
        return groups

    # ---- LOOKUP -----------------------------------------------------------------------------

    def lookup(self, keys: list[bytes], lease_ms: int, meter: ReadMeter = NO_METER) -> list[bool]:
        view = self.membership.view
        present = [False] * len(keys)
        if not self.membership.usable:  # not reached yet, or another contract's keys: nothing of ours
            return present
        skip: list[set[str]] = [set()] * len(keys)  # replaced per key by a set of its own once one fails
        todo = list(range(len(keys)))
        for _ in range(self.replication):  # on a miss or a failure, the next owner
            todo = self._lookup_on(view.ring, keys, todo, lease_ms, present, skip, meter)
            if not todo:
                break
        prev = view.previous()
        if prev is not None:
            missed = [i for i, hit in enumerate(present)
                      if not hit and set(prev.owners(keys[i])) - set(view.ring.owners(keys[i]))]
            if missed:
                for i in missed:
                    skip[i] = set(view.ring.owners(keys[i]))
                self._lookup_on(prev, keys, missed, lease_ms, present, skip, meter)
        return present

    def _lookup_on(self, ring: HashRing, keys, todo: list[int], lease_ms: int, present: list[bool],
                   skip: list[set[str]], meter: ReadMeter) -> list[int]:
        groups = self.route(ring, [keys[i] for i in todo], [skip[i] for i in todo])
        asked: dict[int, list[int]] = {}
        again: list[int] = []  # keys to ask of their next owner
        with Exchange(self.links, self.timeout) as ex:
            for node_id, local in groups.items():
                for idx in _requests_of([todo[j] for j in local]):
                    msg = P.Lookup(rid=next_rid(), epoch=ring.epoch, keys=[keys[i] for i in idx], lease_ms=lease_ms)
                    asked[ex.request(node_id, msg)] = idx
                    meter.sent(node_id)
            for event in ex.events():
                if isinstance(event, Failure):
                    self.marks.failed(event.node_id, event.error)
                    _failed(meter, event)
                    logger.debug("lookup on %s failed: %s", event.node_id, event.error)
                    for rid in event.rids:
                        for i in asked.pop(rid, ()):
                            skip[i] = skip[i] | {event.node_id}
                            again.append(i)
                    continue
                idx = asked.pop(event.rid, ())
                meter.replied(event.node_id, hits=sum(map(bool, event.msg.present)))
                for i, hit in zip(idx, event.msg.present):
                    if hit:
                        present[i] = True
                    else:  # not there: its next owner may hold it
                        skip[i] = skip[i] | {event.node_id}
                        again.append(i)
        return again

    def locate(self, keys: list[bytes]) -> list[list[str]]:
        """Which nodes hold each key: every owner on the current ring (and, right after a ring
        change, the previous owners too), asked without leasing anything."""
        candidates, found, _ = self._ask_owners(keys)
        return [[n for n in owners if n in got] for owners, got in zip(candidates, found)]

    def held_nowhere(self, keys: list[bytes]) -> list[bool]:
        """Per key: every owner (current and, right after a ring change, previous) answered, and
        none holds it.  A key with an owner that did not answer is not held nowhere; a previous
        owner that is no longer a member (it left, it was killed) holds nothing a read can
        reach.  With no owner to ask (no ring yet, or none left) nothing is known: not held
        nowhere."""
        candidates, found, silent = self._ask_owners(keys)
        return [bool(owners) and not got and not silent.intersection(owners) for owners, got in zip(candidates, found)]

    def _ask_owners(self, keys: list[bytes]) -> tuple[list[list[str]], list[set[str]], set[str]]:
        """Each key's owners, which of them hold it, and the owners that did not answer."""
        view = self.membership.view
        prev = view.previous()
        candidates = view.ring.owners_many(keys)
        if prev is not None:
            candidates = [cur + [n for n in old if n not in cur] for cur, old in zip(candidates, prev.owners_many(keys))]
        ask: dict[str, list[int]] = defaultdict(list)
        silent: set[str] = set()
        for i, owners in enumerate(candidates):
            for node_id in owners:
                if node_id in self.links:
                    ask[node_id].append(i)
                elif node_id in view.members:  # a member this client has no link to
                    silent.add(node_id)
        found: list[set[str]] = [set() for _ in keys]
        asked: dict[int, tuple[str, list[int]]] = {}
        with Exchange(self.links, self.timeout) as ex:
            for node_id, idx in ask.items():
                msg = P.Lookup(rid=next_rid(), epoch=view.ring.epoch, keys=[keys[i] for i in idx])
                asked[ex.request(node_id, msg)] = (node_id, idx)
            for event in ex.events():
                if isinstance(event, Reply):
                    node_id, idx = asked[event.rid]
                    for i, hit in zip(idx, event.msg.present):
                        if hit:
                            found[i].add(node_id)
                else:
                    logger.debug("locate on %s failed: %s", event.node_id, event.error)
                    silent.add(event.node_id)
        return candidates, found, silent

    # ---- GET ----------------------------------------------------------------------------------

    def stream(self, keys: list[bytes], layers: tuple[int, int] | None, found: list | None, stream: bool,
               pin: str | None = None, meter: ReadMeter = NO_METER, place: Place | None = None
               ) -> Iterator[LayerBatch]:
        """Layers of ``keys`` as they arrive (see ``ClusterClient.iter_layers``)."""
        start, end = layers if layers is not None else (0, -1)
        if start < 0 or (end != -1 and end <= start):
            raise ValueError(f"layer range {layers} is empty or negative")
        found = found if found is not None else [None] * len(keys)
        if not self.membership.usable:  # a miss, never KV laid out under another contract
            return
        reads: dict[bytes, KeyRead] = {}
        for i, key in enumerate(keys):
            read = reads.get(key)
            if read is None:
                reads[key] = KeyRead(key, [i])
            else:
                read.positions.append(i)
        todo = list(reads.values())
        view = self.membership.view
        ring, used_prev = view.ring, False
        for _ in range(self.replication + 2):
            if not todo:
                break
            if pin is not None:
                groups = {pin: list(range(len(todo)))}
            else:
                groups = self.route(ring, [r.key for r in todo], [r.tried for r in todo])
            batches = {node_id: [todo[j] for j in local] for node_id, local in groups.items()}
            yield from self._round(batches, ring.epoch, start, end, stream, found, meter, place)
            # Failed keys, and missing ones that an owner not asked yet may hold, go round again.
            todo = [r for r in reads.values() if not r.done and (not r.missing or set(ring.owners(r.key)) - r.tried)
                    ] if pin is None else []
            prev = view.previous() if pin is None else None
            if not todo and not used_prev and prev is not None:
                moved = [r for r in reads.values() if r.missing and not r.done
                         and set(prev.owners(r.key)) - set(view.ring.owners(r.key))]
                if moved:
                    ring, used_prev, todo = prev, True, moved
                    for r in moved:
                        r.missing, r.tried = False, set(view.ring.owners(r.key))
        for r in reads.values():
            if not r.done:
                for i in r.positions:
                    found[i] = None

    def _round(self, batches: dict[str, list[KeyRead]], epoch: int, start: int, end: int, stream: bool,
               found: list, meter: ReadMeter, place: Place | None = None) -> Iterator[LayerBatch]:
        """One GET per node for its batch; yields the layers that pass their checksums."""
        asked: dict[int, tuple[str, list[KeyRead]]] = {}
        requests: dict[str, list[P.Get]] = defaultdict(list)
        for node_id, keys in batches.items():
            for batch in _requests_of(keys):
                msg = P.Get(rid=next_rid(), epoch=epoch, keys=[r.key for r in batch], layer_start=start,
                            layer_end=end, stream=stream)
                asked[msg.rid] = (node_id, batch)
                requests[node_id].append(msg)
                meter.sent(node_id)
                for r in batch:
                    r.tried.add(node_id)
        clock = meter.clock  # when each reply arrived, on the meter's clock
        land = self._lander(asked, place, start) if place is not None and stream else None
        # Layers received into their places are read on the caller's thread: reader threads then
        # cost more than they give (``kvring bench reads`` on 16 cores: 0.66 GB/s with a reader
        # per node, 0.98 on the caller's thread, whose copies they used to take off it).
        arrivals = (self._parallel(requests, clock) if self.parallel and len(requests) > 1 and land is None
                    else self._serial(requests, clock, land))
        try:
            for arrived in arrivals:
                event = arrived.event
                if isinstance(event, Failure):
                    self.marks.failed(event.node_id, event.error)
                    _failed(meter, event, arrived.at)
                    if isinstance(event.error, RemoteError) and event.error.code == ErrorCode.BAD_RANGE:
                        raise event.error
                    for rid in event.rids:
                        for r in asked.pop(rid, ("", ()))[1]:
                            self._forget(r, found)
                    continue
                node_id, batch = asked[event.rid]
                msg = event.msg
                if isinstance(msg, P.GetHead):
                    meter.replied(node_id, last=not any(m is not None for m in msg.metas), at=arrived.at)
                    self._head(batch, msg, start, end, found)
                elif isinstance(msg, P.GetLayer):
                    meter.replied(node_id, sum(map(_nbytes, event.payloads)), last=msg.last, at=arrived.at)
                    good = self._check_layer(node_id, batch, msg, event.payloads, found, arrived.digests)
                    if good:
                        indices, views = [], []
                        for r, view in good:
                            indices.extend(r.positions)
                            views.extend([view] * len(r.positions))
                        yield LayerBatch(msg.layer, indices, views, msg.span)
                    if msg.last:
                        for r in batch:
                            r.done = r.meta is not None and r.want == 0
                            if not r.done and r.meta is not None:
                                self._forget(r, found)
        finally:
            arrivals.close()

    def _lander(self, asked: dict[int, tuple[str, list[KeyRead]]], place: Place, start: int) -> Callable:
        """The readers' ``land`` callback for a round: a streamed layer's payload of a key the
        caller listed once goes where ``place(position, layer, size)`` says, if anywhere, with a
        hasher for its checksum.  Only the layer due next for its key gets a place (its frames may
        arrive before the caller has checked the previous layer, so the count is kept here): a
        layer numbered out of turn goes to a buffer and is refused there, and so does every later
        frame of its key from that node, so none is written over another layer's place."""
        last: list = [None, None]  # the header decoded last (a message's payloads share it)
        # (rid, position in its request) -> the layer due next; None once one came out of turn.
        due: dict[tuple[int, int], int | None] = {}

        def land(header: bytearray, index: int, size: int) -> Landing | None:
            if header is not last[0]:
                try:
                    last[:] = [header, P.decode_reply(header)]
                except (msgspec.DecodeError, msgspec.ValidationError):
                    last[:] = [header, None]  # the transport rejects it once it is whole
            msg = last[1]
            if not isinstance(msg, P.GetLayer) or msg.span or not 0 <= index < len(msg.which):
                return None
            batch = asked.get(msg.rid, ("", ()))[1]
            pos = msg.which[index]
            if not 0 <= pos < len(batch) or len(batch[pos].positions) != 1:
                return None
            if msg.layer != due.get((msg.rid, pos), start):
                due[msg.rid, pos] = None
                return None
            due[msg.rid, pos] = msg.layer + 1
            landing = place(batch[pos].positions[0], msg.layer, size)
            if landing is not None:
                landing.hasher = xxhash.xxh3_64() if self.verify else None
            return landing

        return land

    def _serial(self, requests: dict[str, list[P.Get]], clock: Callable[[], float],
                land: Callable | None = None) -> Iterator[_Arrived]:
        """The round's events, read on the caller's thread."""
        with Exchange(self.links, self.timeout, land) as ex:
            for node_id, msgs in requests.items():
                for msg in msgs:
                    ex.request(node_id, msg, streamed=True)
            for event in ex.events():
                yield _Arrived(event, clock())

    def _parallel(self, requests: dict[str, list[P.Get]], clock: Callable[[], float]) -> Iterator[_Arrived]:
        """The round's events, each node's read by a thread of its own (see the module docstring)."""
        arrivals: queue.Queue = queue.Queue(maxsize=_QUEUED_PER_NODE * len(requests))
        stop = threading.Event()
        readers = self._reader_pool()
        for node_id, msgs in requests.items():
            readers.submit(self._read_node, node_id, msgs, arrivals, stop, clock)
        running = len(requests)
        try:
            while running:
                item = arrivals.get()
                if item is _STOPPED:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            stop.set()
            while running:  # let readers blocked on a full queue see the stop
                try:
                    running -= arrivals.get_nowait() is _STOPPED
                except queue.Empty:
                    break

    def _reader_pool(self) -> ThreadPoolExecutor:
        with self._readers_lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="kvring-read")
            return self._readers

    def _read_node(self, node_id: str, msgs: list[P.Get], arrivals: queue.Queue, stop: threading.Event,
                   clock: Callable[[], float]) -> None:
        """A node reader: run ``msgs`` on one node and hand over each event with its checksums."""
        metas: dict[int, list[ChunkMeta | None]] = {}  # rid -> its head's metadata (to cut payloads into layers)
        try:
            with Exchange(self.links, self.timeout) as ex:
                for msg in msgs:
                    ex.request(node_id, msg, streamed=True)
                for event in ex.events():
                    digests = None
                    if isinstance(event, Reply):
                        if isinstance(event.msg, P.GetHead):
                            metas[event.rid] = event.msg.metas
                        elif isinstance(event.msg, P.GetLayer) and self.verify:
                            digests = _digests(event.msg, event.payloads, metas.get(event.rid, []))
                    if not _hand_over(arrivals, _Arrived(event, clock(), digests), stop):
                        return
        except Exception as exc:  # noqa: BLE001 (a bug, not a node's failure, which is an event: the caller raises it)
            _hand_over(arrivals, exc, stop)
        finally:
            _hand_over(arrivals, _STOPPED, stop)

    @staticmethod
    def _forget(r: KeyRead, found: list) -> None:
        """A key whose read failed on this round: read again elsewhere."""
        r.meta, r.want = None, 0
        for i in r.positions:
            found[i] = None

    @staticmethod
    def _head(batch: list[KeyRead], msg: P.GetHead, start: int, end: int, found: list) -> None:
        if len(msg.metas) != len(batch):
            for r in batch:
                Reads._forget(r, found)
            return
        for r, meta in zip(batch, msg.metas):
            r.meta = meta
            for i in r.positions:
                found[i] = meta
            if meta is None:
                r.missing = True
            else:
                r.want = (meta.layers if end == -1 else end) - start
                r.next_layer = start

    def _check_layer(self, node_id: str, batch: list[KeyRead], msg: P.GetLayer, payloads: list,
                     found: list, digests: list[list[int] | None] | None = None
                     ) -> list[tuple[KeyRead, memoryview | Landed]]:
        """The payloads of ``msg`` that are whole layers of their keys, numbered as the next ones
        due, and match the checksums the key's head gave (``digests``: computed already, by the
        node's reader).  Those are the writer's, one per layer, so a layer's bytes are checked
        against its number too: a layer numbered as another one never passes for it."""
        good = []
        for k, (pos, payload) in enumerate(zip(msg.which, payloads)):
            if not 0 <= pos < len(batch):
                continue
            r = batch[pos]
            meta = r.meta
            n = r.want if msg.span else 1
            if isinstance(payload, Landed) and not payload.complete:  # the caller took its place back
                self._forget(r, found)
                continue
            if meta is None or r.want < 1 or msg.layer != r.next_layer:  # repeated, skipped, past the end
                if meta is not None:
                    logger.warning("%s sent a layer numbered %d where %s was due; its chunk is read elsewhere",
                                   node_id, msg.layer, r.next_layer if r.want >= 1 else "none")
                self._forget(r, found)
                continue
            lb = meta.layer_bytes
            buf = payload if isinstance(payload, Landed) else memoryview(payload)
            if buf.nbytes != n * lb or (self.verify and (_digests_of(buf, lb) if digests is None else digests[k])
                                        != meta.checksums[msg.layer:msg.layer + n]):
                logger.warning("bad or corrupt layer %d of a chunk from %s", msg.layer, node_id)
                if buf.nbytes == n * lb:  # bytes that fail their checksum
                    self._drop_corrupt(node_id, r.key)
                self._forget(r, found)
                continue
            good.append((r, buf))
            r.want -= n
            r.next_layer += n
        return good

    def _drop_corrupt(self, node_id: str, key: bytes) -> None:
        """Delete a copy that failed its checksum, so the next save of the key can store a good
        one (a PUT of an existing key is a no-op)."""
        self.corrupt_dropped += 1
        try:
            with Exchange(self.links, self.timeout) as ex:
                ex.request(node_id, P.Delete(rid=next_rid(), keys=[key]))
                for event in ex.events():
                    if isinstance(event, Failure):
                        logger.debug("could not delete the corrupt copy on %s: %s", node_id, event.error)
        except KVRingError as exc:  # best effort: the copy stays a miss for every reader anyway
            logger.debug("could not delete the corrupt copy on %s: %s", node_id, exc)

    def get(self, keys: list[bytes], layers: tuple[int, int] | None, node: str | None) -> list[Chunk | None]:
        found: list[ChunkMeta | None] = [None] * len(keys)
        out: list[Chunk | None] = [None] * len(keys)
        start = layers[0] if layers is not None else 0
        for batch in self.stream(keys, layers, found, stream=False, pin=node):
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


def readers_pay_off() -> bool:
    """Whether this process may use enough CPUs for a reader thread per node (``READERS_MIN_CPUS``):
    the CPUs it may run on, fewer where its cgroup's CPU quota (a Kubernetes CPU limit) is lower."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = float(os.cpu_count() or 1)
    try:
        with open(CGROUP_CPU_MAX) as f:  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus >= READERS_MIN_CPUS


def _failed(meter: ReadMeter, event: Failure, at: float | None = None) -> None:
    """Record a failure in ``meter``: the node's own (it did not answer) or an answer (an error it sent)."""
    for _ in event.rids:
        if isinstance(event.error, RemoteError):
            meter.replied(event.node_id, at=at)
        else:
            meter.failed(event.node_id, at=at)


def _digests(msg: P.GetLayer, payloads: list, metas: list[ChunkMeta | None]) -> list[list[int] | None]:
    """The XXH3 of each layer in each payload of ``msg`` (one layer each, or with ``span`` the
    key's remaining layers); ``None`` for a payload that is not whole layers of its key."""
    out: list[list[int] | None] = []
    for pos, payload in zip(msg.which, payloads):
        meta = metas[pos] if 0 <= pos < len(metas) else None
        buf = memoryview(payload)
        lb = meta.layer_bytes if meta is not None else 0
        if not lb or buf.nbytes % lb or (not msg.span and buf.nbytes != lb):
            out.append(None)
            continue
        out.append(_layer_digests(buf, lb))
    return out


def _digests_of(buf: memoryview | Landed, lb: int) -> list[int | None]:
    """The XXH3 of each layer of a payload: a landed one's was taken as its bytes arrived."""
    return [buf.digest] if isinstance(buf, Landed) else _layer_digests(buf, lb)


def _nbytes(payload) -> int:
    return payload.nbytes if isinstance(payload, Landed) else memoryview(payload).nbytes


def _layer_digests(buf: memoryview, lb: int) -> list[int]:
    """The XXH3 of each of the ``lb``-byte layers that make up ``buf``."""
    return [xxhash.xxh3_64_intdigest(buf[j * lb:(j + 1) * lb]) for j in range(buf.nbytes // lb)]


def _hand_over(arrivals: queue.Queue, item, stop: threading.Event) -> bool:
    """Put ``item`` on a round's queue, waiting while it is full; ``False``: the round stopped."""
    while not stop.is_set():
        try:
            arrivals.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _requests_of(items: list) -> list[list]:
    """``items`` for one node, cut into requests of at most ``MAX_KEYS_PER_REQUEST`` keys (a long
    prompt's parts, one per KV head and stage, can pass it on a small cluster)."""
    step = P.MAX_KEYS_PER_REQUEST
    return [items[i:i + step] for i in range(0, len(items), step)]
