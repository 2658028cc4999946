"""``PoolRelay``: the pool's KV events as one stream, as if the pool were one engine's cache.

It follows every node's events (a SUB socket per node, the node's replay socket for its
history and for what it missed), keeps what each node holds in a ``PoolLedger``, and publishes
the ledger's events on one ``EventPublisher``: one worker identity, one sequence (from 0 at each
start of the relay), one replay socket, in vLLM's wire format (``publisher.py``).  A router
registers the relay's two endpoints as one worker.

Following a node (``set_sources`` says which nodes there are, from membership):
- joining: its history is read through its replay socket from sequence 0 and what it holds is
  rebuilt from it; live batches already covered are skipped (same sequence, same bytes);
- a gap in its sequence: the missing batches are replayed from it; if its buffer no longer
  has them, its whole history is read again and the difference announced;
- restarted (a new incarnation in membership, or a batch whose sequence it has already seen
  with other bytes): its history is read again and what it holds replaced by it, so a node
  restarted empty withdraws its blocks, and one that repair already refilled changes nothing;
- left membership: what only it held is withdrawn.
A history that no longer starts at sequence 0 (a node whose replay buffer has dropped its
oldest batches) is used as far as it goes and counted in ``incomplete``: the stream then
under-credits that node, never credits what it does not hold.  Every ``check_interval`` the
relay also asks each node for batches after the last it applied, so a batch lost at the tail
(a subscription not yet in place, a full queue) is not waited for until the next one.

Consumers: the first batch of every start is ``AllBlocksCleared``, so a router that followed
an earlier relay forgets it; and whenever a subscriber joins (the publisher is an XPUB) the
relay publishes ``AllBlocksCleared`` then everything published, so a router that (re)starts
and subscribes learns the whole pool without a replay (the other subscribers apply the same
reset and end where they were).  A subscriber that misses batches replays them from the
relay's replay socket, as from vLLM's.

Threads: one thread of the relay's own owns the ledger and every node socket; ``set_sources``
and ``stats`` may be called from any thread.  A replay blocks that thread for at most
``replay_timeout`` per node.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import xxhash
import zmq

from .ledger import NodeHoldings, PoolLedger
from .publisher import END_SEQ, EventPublisher, PublisherSettings
from .wire import AllBlocksCleared, EventBatch

logger = logging.getLogger(__name__)

T = TypeVar("T")
_decoder = msgspec.msgpack.Decoder(EventBatch)
_KEEP_DIGESTS = 4096  # recent batches per node remembered to tell a duplicate from a restart


@dataclass(frozen=True, slots=True)
class Source:
    """One node's KV events, as its membership record names them."""

    node_id: str
    incarnation: str
    events_addr: str
    replay_addr: str


@dataclass(frozen=True)
class RelaySettings:
    publisher: PublisherSettings = field(default_factory=lambda: PublisherSettings(xpub=True))
    medium: str | None = "CPU"  # the tier the stream names (vLLM's own CPU offload says "CPU")
    replay_timeout: float = 5.0  # seconds a node's replay may take before it counts as failed
    check_interval: float = 2.0  # seconds between asking each node for batches past the last applied
    # The host routers reach the stream at, in ``events_addr``/``replay_addr`` (what etcd records
    # and ``kvring events`` prints); None: the publisher's bind host.  In a pod that binds
    # 0.0.0.0 it is the stream's Service name (``kvring events --advertise-host``).
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        if self.advertise_host is not None and not _reachable_host(self.advertise_host):
            raise ValueError(f"--advertise-host {self.advertise_host!r} is not an address routers can reach: give a "
                             "host name or IP address (e.g. kv-cache-events.team-a.svc), not 0.0.0.0 and without "
                             "scheme or port")


class _Followed:
    """A node the relay follows: its subscription and where its sequence stands."""

    def __init__(self, source: Source, sub: zmq.Socket) -> None:
        self.source = source
        self.sub = sub
        self.last = -1  # the last sequence number applied (-1: none)
        self.digests: dict[int, int] = {}


class PoolRelay:
    def __init__(self, settings: RelaySettings) -> None:
        if not settings.publisher.xpub:
            raise ValueError("the pool relay needs PublisherSettings(xpub=True): it answers new subscribers")
        self.settings = settings
        self.ledger = PoolLedger(settings.medium)
        self._resync = threading.Event()
        self.publisher = EventPublisher(settings.publisher, on_subscribe=self._resync.set)
        self.publisher.publish(AllBlocksCleared())
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._pending: dict[str, Source] | None = None
        self._calls: list[tuple[Callable, Future]] = []
        self._followed: dict[str, _Followed] = {}
        self._stop = False
        self.counts = {"batches": 0, "gaps": 0, "resyncs": 0, "restarts": 0, "incomplete": 0, "replay_failures": 0,
                       "snapshots": 0, "recovered": 0}
        self._thread = threading.Thread(target=self._run, name="kvring-pool-events", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------

    @property
    def events_addr(self) -> str:
        return f"tcp://{self._advertised()}:{self.publisher.port}"

    @property
    def replay_addr(self) -> str:
        return f"tcp://{self._advertised()}:{self.publisher.replay_port}"

    def _advertised(self) -> str:
        return _host(self.settings.advertise_host or self.settings.publisher.host)

    def set_sources(self, sources: Mapping[str, Source]) -> None:
        """The nodes whose events make the pool now (all of them, each time)."""
        with self._lock:
            self._pending = dict(sources)

    def on_thread(self, fn: Callable[[PoolRelay], T]) -> Future[T]:
        """Run ``fn(relay)`` on the relay's thread, between two turns (what touches the node
        sockets or the ledger from outside must go this way)."""
        future: Future[T] = Future()
        with self._lock:
            self._calls.append((fn, future))
        return future

    def followed(self) -> dict[str, zmq.Socket]:
        """Each followed node's subscription socket (call on the relay's thread)."""
        return {node: f.sub for node, f in self._followed.items()}

    def stats(self) -> dict:
        return {**self.counts, "nodes": len(self._followed), "blocks_held": self.ledger.held,
                "blocks_published": self.ledger.published_count, **self.publisher.stats()}

    def close(self) -> None:
        self._stop = True
        self._thread.join(10)
        self.publisher.close()
        self._ctx.destroy(linger=0)

    # ---- the relay's thread -------------------------------------------------------------------

    def _run(self) -> None:
        next_check = time.monotonic() + self.settings.check_interval
        while not self._stop:
            try:
                self._turn()
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + self.settings.check_interval
                    for followed in list(self._followed.values()):
                        self._catch_up(followed)
            except Exception:  # a bug must not silence the stream for good: log, go on
                logger.exception("kvring: the pool event relay failed a turn")
                time.sleep(0.1)
        for followed in self._followed.values():
            followed.sub.close(linger=0)

    def _turn(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
            calls, self._calls = self._calls, []
        if pending is not None:
            self._follow(pending)
        for fn, future in calls:
            try:
                future.set_result(fn(self))
            except Exception as exc:
                future.set_exception(exc)
        if self._resync.is_set():
            self._resync.clear()
            self.counts["snapshots"] += 1
            self.publisher.publish(*self.ledger.snapshot())
        poller = zmq.Poller()
        for followed in self._followed.values():
            poller.register(followed.sub, zmq.POLLIN)
        ready = dict(poller.poll(50)) if self._followed else time.sleep(0.05) or {}
        for followed in list(self._followed.values()):
            if followed.sub in ready:
                self._drain(followed)

    def _follow(self, sources: dict[str, Source]) -> None:
        for node in [n for n in self._followed if n not in sources]:
            followed = self._followed.pop(node)
            followed.sub.close(linger=0)
            logger.info("kvring: pool events: node %s left; withdrawing what only it held", node)
            self.publisher.publish(*self.ledger.drop(node))
        for node, source in sources.items():
            if not source.events_addr or not source.replay_addr:
                continue  # a node without events (--no-events): nothing of it is announced
            followed = self._followed.get(node)
            if followed is not None and (followed.source.events_addr, followed.source.replay_addr) != (
                    source.events_addr, source.replay_addr):
                followed.sub.close(linger=0)
                followed = None
            if followed is None:
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(source.events_addr)
                followed = self._followed[node] = _Followed(source, sub)
                self._resync_node(followed)
            elif followed.source.incarnation != source.incarnation:
                followed.source = source
                self.counts["restarts"] += 1
                self._resync_node(followed)

    def _drain(self, followed: _Followed) -> None:
        while True:
            try:
                frames = followed.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            self._receive(followed, int.from_bytes(frames[1], "big"), frames[2])

    def _receive(self, followed: _Followed, seq: int, payload: bytes) -> None:
        if seq == followed.last + 1:
            self._apply(followed, seq, payload)
        elif seq > followed.last + 1:
            self.counts["gaps"] += 1
            self._catch_up(followed)
            if seq == followed.last + 1:
                self._apply(followed, seq, payload)
        elif followed.digests.get(seq) != xxhash.xxh3_64_intdigest(payload):
            # A sequence number seen before with other bytes: the node started again.
            self.counts["restarts"] += 1
            self._resync_node(followed)

    def _apply(self, followed: _Followed, seq: int, payload: bytes) -> None:
        try:
            batch = _decoder.decode(payload)
        except msgspec.DecodeError:
            logger.warning("kvring: pool events: node %s sent a batch that does not decode", followed.source.node_id)
            batch = EventBatch(0.0, [])
        events = []
        for event in batch.events:
            events += self.ledger.apply(followed.source.node_id, event)
        self._applied(followed, seq, payload)
        self.counts["batches"] += 1
        if events:
            self.publisher.publish(*events)

    def _applied(self, followed: _Followed, seq: int, payload: bytes) -> None:
        followed.last = seq
        followed.digests[seq] = xxhash.xxh3_64_intdigest(payload)
        if len(followed.digests) > _KEEP_DIGESTS:
            del followed.digests[next(iter(followed.digests))]

    def _catch_up(self, followed: _Followed) -> None:
        """Apply the node's batches after the last one applied; its whole history again if they
        are gone from its buffer."""
        batches = self._replay(followed.source, followed.last + 1)
        if batches is None:
            return
        if batches and batches[0][0] != followed.last + 1:
            self._resync_node(followed)
            return
        for seq, payload in batches:
            if seq == followed.last + 1:
                self._apply(followed, seq, payload)
                self.counts["recovered"] += 1

    def _resync_node(self, followed: _Followed) -> None:
        """Rebuild what the node holds from its whole history and announce the difference."""
        self.counts["resyncs"] += 1
        node = followed.source.node_id
        batches = self._replay(followed.source, 0)
        holdings = NodeHoldings()
        followed.last, followed.digests = -1, {}
        if not batches:
            # Unreachable, or nothing published yet: hold nothing of it until it says more.
            self.publisher.publish(*self.ledger.replace(node, holdings))
            return
        if batches[0][0] != 0:
            self.counts["incomplete"] += 1
            logger.warning("kvring: pool events: node %s's history starts at batch %d, not 0: what it stored "
                           "before is not announced", node, batches[0][0])
        for seq, payload in batches:
            try:
                for event in _decoder.decode(payload).events:
                    holdings.apply(event)
            except msgspec.DecodeError:
                pass
            self._applied(followed, seq, payload)
        self.publisher.publish(*self.ledger.replace(node, holdings))

    def _replay(self, source: Source, start: int) -> list[tuple[int, bytes]] | None:
        """The node's buffered batches from ``start`` on (None: it did not answer in time)."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(source.replay_addr)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            got: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + self.settings.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    self.counts["replay_failures"] += 1
                    logger.warning("kvring: pool events: node %s's replay did not answer within %.1fs",
                                   source.node_id, self.settings.replay_timeout)
                    return None
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                if frames[2] == END_SEQ:
                    return got
                got.append((int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            sock.close(linger=0)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_DNS_NAME = re.compile(r"^(?=.{1,253}$)([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$",
                       re.IGNORECASE)


def _reachable_host(host: str) -> bool:
    """A DNS name or an IP address other than the unspecified one (0.0.0.0, ::)."""
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return bool(_DNS_NAME.match(host))
