"""One cache node: the chunk store behind the data protocol's TCP port, an admin/metrics HTTP
port (HTTPS when the node has the cluster's credentials), and registration in etcd.

Threads: the main thread runs the data loop (``server.Server``; all store access happens there,
other threads go through ``Server.call``); ``http.py``'s server answers on threads of its own;
``registration.py`` keeps the etcd record alive and follows this node's drain key; the handoff
thread (``handoff.py``) moves chunks the node no longer owns.  SIGTERM or SIGINT stops the loop,
revokes the lease (the node leaves the ring at once) and exits 0.

With ``--disk-dir`` the node also keeps every chunk on disk (``disk/``; memory and disk as one
set of chunks in ``holdings.py``): the disk's index is rebuilt in ``CacheNode.__init__``, before
the node answers or registers, and a stop writes the disk's queue before it exits.

Drain (``drain.py``): requested through etcd (``Etcd.request_drain``, whose key the node
watches) or by ``POST /drain`` on the admin port (from loopback only, with the node token: that
is the pod's preStop hook).  The node sets its state ``draining`` (clients drop it from the ring;
it keeps serving reads for their previous-owner fallback), the handoff thread moves every chunk
to its new owner, and the node reports ``drained``.  ``/readyz`` answers 503 from the moment
the drain begins; ``/stats`` (and ``GET /drain``) show its progress and, while it cannot
finish, why.  A drain with nowhere to go (no other active node) keeps its chunks and stays
``draining``.  Withdrawing every request returns the node to ``active``.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import msgspec

from kvring.common import protocol as P
from kvring.common.contract import Contract
from kvring.common.errors import ContractMismatch, NodeIdTaken
from kvring.common.follow import RELOAD_CHECK
from kvring.common.nodetoken import NodeToken
from kvring.common.records import NodeRecord
from kvring.common.tls import ClusterCredentials, CredentialsError, LoadedSet
from kvring.common.types import LEFT_RING_STATES, NodeState
from kvring.events.publisher import PublisherSettings
from kvring.membership.settings import EtcdSettings

from .anchors import AnchorDrops
from .buffers import BufferPool
from .client.cluster import ClusterClient
from .disk.identity import DiskError, DiskIdentity
from .disk.tier import DiskConfig, DiskTier
from .dispatch import Dispatcher
from .drain import Drain
from .events import NodeEvents
from .framing import FrameLimits
from .handoff import Handoff
from .holdings import Holdings
from .http import make_http_server
from .metrics import NodeMetrics
from .policy import make_policy
from .registration import Registration
from .selfcheck import SelfCheck
from .server import Server
from .store import ChunkStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    """Settings of one node, built once in ``main`` (see ``kvring node --help``)."""

    node_id: str
    memory: int
    host: str = "127.0.0.1"
    data_port: int = 0
    admin_port: int = 0
    advertise_host: str | None = None
    max_chunk_bytes: int = 256 << 20
    policy: str = "lru"
    max_leased_fraction: float = 0.5
    etcd: EtcdSettings | None = None
    lease_ttl: int = 10
    contract: Contract = field(default_factory=Contract)
    handoff: bool = True
    repair_rate: int = 64 << 20  # bytes/s of copies restored to owners that lack them (0: no limit)
    repair_interval: float = 60.0  # seconds between repair passes without a ring change
    drain_poll: float = 1.0  # seconds before the drain key is read again after its watch broke
    self_check_interval: float = 5.0  # seconds between PINGs of its own data plane (0: no check)
    self_check_failures: int = 3  # PINGs missed in a row that take the node off the ring
    receive_budget: int = 32 << 20  # bytes of partly received messages held in all (server.py)
    receive_timeout: float = 10.0  # seconds a connection may stay silent in the middle of a message
    # Testing only: POST /debug/corrupt?key=HEX (from loopback) flips a stored byte, so tests can
    # show that a corrupt chunk is never loaded. Off unless --fault-injection is given.
    fault_injection: bool = False
    tls: ClusterCredentials | None = None  # the cluster's credentials: mutual TLS on the data port
    # The cluster's node token: what the admin port's mutating and prefix-revealing endpoints
    # (flush, present, drain, debug) require as ``Authorization: Bearer``; None: they answer 403.
    node_token: NodeToken | None = None
    # KV events (vLLM's wire format) of the chunks that name their blocks; None: not published.
    events: PublisherSettings | None = None
    disk: DiskConfig | None = None  # the disk tier under memory (--disk-dir); None: memory only

    def __post_init__(self) -> None:
        if not self.node_id or "/" in self.node_id:
            raise ValueError(f"node id {self.node_id!r} must be non-empty and contain no '/'")
        if self.memory <= 0:
            raise ValueError("--memory must be positive, e.g. --memory 4GiB")
        if not 0 < self.max_chunk_bytes <= self.memory:
            raise ValueError(f"--max-chunk-bytes must be in (0, memory={self.memory}]")
        if not 0.0 <= self.max_leased_fraction < 1.0:
            raise ValueError("--max-leased-fraction must be in [0, 1)")
        if self.lease_ttl < 1:
            raise ValueError("--lease-ttl must be at least 1 second")
        if self.repair_rate < 0:
            raise ValueError("--repair-rate must be 0 (no limit) or a size per second, e.g. 64MiB")
        if not self.repair_interval > 0:
            raise ValueError("--repair-interval must be positive seconds")
        if self.self_check_interval < 0 or self.self_check_failures < 1:
            raise ValueError("--self-check-interval must be 0 (off) or positive seconds, failures at least 1")
        if self.receive_budget < 1 << 20:
            raise ValueError("--receive-budget must be at least 1MiB, e.g. --receive-budget 32MiB")
        if not self.receive_timeout > 0:
            raise ValueError("--receive-timeout must be positive seconds, e.g. --receive-timeout 10")
        if not self.drain_poll > 0:
            raise ValueError("drain_poll must be positive seconds")
        make_policy(self.policy)


class CacheNode:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.buffers = BufferPool(limit=min(config.memory // 8, 256 << 20))
        self.store = ChunkStore(config.memory, make_policy(config.policy), config.max_leased_fraction,
                                recycle=self.buffers.give)
        self.metrics = NodeMetrics(self.store)
        cluster = config.etcd.cluster if config.etcd is not None else "default"
        self.disk: DiskTier | None = None
        if config.disk is not None:  # its index is rebuilt before the node answers or registers
            identity = DiskIdentity(cluster, config.node_id, config.contract.to_json().decode())
            self.disk = DiskTier(config.disk, identity, take=self.buffers.take)
            self.disk.open()
        self.events: NodeEvents | None = None
        if config.events is not None:
            self.events = NodeEvents(cluster, config.events)
        limits = FrameLimits(max_header=P.MAX_HEADER_BYTES, max_payloads=4, max_payload=config.max_chunk_bytes,
                             max_total=config.max_chunk_bytes)
        self.server = Server(config.host, config.data_port, handler=lambda conn, msg: None, limits=limits,
                             allocate=self.buffers.take,
                             tls=config.tls.server_context if config.tls is not None else None,
                             receive_budget=config.receive_budget, receive_timeout=config.receive_timeout)
        self.metrics.watch_server(self.server)
        self.data_port = self.server.port
        self.holdings = Holdings(self.store, self.disk, self.server, self.events)
        if self.disk is not None:
            self.metrics.watch_disk(self.disk, rewritten=lambda: self.holdings.rewritten)
        self.dispatcher = Dispatcher(config.node_id, self.holdings, self.metrics, self.server,
                                     config.max_chunk_bytes, self.stats)
        if config.tls is not None:
            config.tls.on_reload(self._credentials_reloaded)
            self.metrics.watch_credentials(config.tls, self.server)
        self.http = make_http_server(self, config.host, config.admin_port,
                                     tls=config.tls.admin_server_context if config.tls is not None else None)
        self.admin_port = self.http.server_address[1]
        adv = config.advertise_host or config.host
        self.record = NodeRecord(
            node_id=config.node_id,
            data_addr=f"tcp://{adv}:{self.data_port}",
            admin_addr=f"{'https' if config.tls is not None else 'http'}://{adv}:{self.admin_port}",
            capacity=config.memory,
            pid=os.getpid(),
            incarnation=secrets.token_hex(8),
            events_addr=f"tcp://{adv}:{self.events.publisher.port}" if self.events else "",
            events_replay_addr=f"tcp://{adv}:{self.events.publisher.replay_port}" if self.events else "",
        )
        self.drain = Drain(config.node_id, state=lambda: self.record.state, set_state=self.set_state,
                           held=self.held)
        self.registration: Registration | None = None
        self.handoff: Handoff | None = None
        self.anchors: AnchorDrops | None = None
        self.fatal: str | None = None
        self.started = time.time()

    # ---- lifecycle --------------------------------------------------------------------------

    def held(self) -> int:
        """Chunks held in memory or on disk (any thread)."""
        if self.disk is None:
            return len(self.store)  # one integer read: no trip to the data loop
        if self.server.on_loop():
            return len(self.holdings)
        return self.server.call(self.holdings.__len__)

    def _credentials_reloaded(self, before: LoadedSet, after: LoadedSet) -> None:
        """New credentials were taken (any thread): with a CA no longer trusted, the connections
        its certificates opened are closed (their peers connect again under what is trusted)."""
        dropped = set(before.trusted) - set(after.trusted)
        if dropped:
            def close() -> None:
                closed = self.server.close_tls_before()
                logger.info("CA %s no longer trusted: closed %d connection(s) it admitted", ", ".join(sorted(dropped)),
                            closed)
            self.server.post(close)

    def _look_at_credentials(self) -> None:
        """Look at the credentials' files every ``RELOAD_CHECK`` seconds (loop thread), so that a
        change takes effect, and is reported in ``/stats``, even while nobody connects."""
        if self.config.tls is not None:
            self.config.tls.refresh()
        if self.config.node_token is not None:
            self.config.node_token.refresh()
        self.server.later(RELOAD_CHECK, self._look_at_credentials)

    def start_background(self) -> None:
        threading.Thread(target=self.http.serve_forever, name="kvring-http", daemon=True).start()
        self.server.post(self._look_at_credentials)
        self.holdings.announce_disk()
        if self.config.etcd is None:
            return
        # The id probe and the self-check PING this node's data port like any client.
        client_tls = self.config.tls.client_context if self.config.tls is not None else None
        check = None
        if self.config.self_check_interval > 0:
            interval = self.config.self_check_interval
            check = SelfCheck(lambda: self.record, self._data_plane_health, interval,
                              self.config.self_check_failures, timeout=min(2.0, interval), tls=client_tls,
                              on_connect=self.server.keep_peer)
        self.registration = Registration(self.config.etcd, self.record, self.config.contract,
                                         self.config.lease_ttl, self.drain, self.config.drain_poll, check,
                                         tls=client_tls)
        self.registration.on_fatal = self._registration_lost
        self.registration.start()  # raises ContractMismatch or NodeIdTaken
        self.metrics.watch_membership(lambda: self.record.state, lambda: self.registration.registered)
        if self.config.handoff:
            self.handoff = Handoff(self.config.node_id, self.config.etcd, self.config.contract,
                                   state=lambda: self.record.state, held=self.held,
                                   on_drained=self.drain.drained, repair_rate=self.config.repair_rate,
                                   repair_interval=self.config.repair_interval, tls=self.config.tls)
            self.drain.handoff = self.handoff
            self.metrics.watch_repair(self.handoff.repair)
            if self.record.state in LEFT_RING_STATES:
                self.handoff.reset_drain()
            self.handoff.start()
        self.anchors = AnchorDrops(lambda: ClusterClient(self.config.etcd, contract=self.config.contract, timeout=2.0,
                                                         tls=self.config.tls, lookup_threads=1,
                                                         buffer_pool_bytes=1 << 20))
        self.holdings.anchors = self.anchors
        self.metrics.watch_anchors(self.anchors.counts)
        self.anchors.start()

    def _registration_lost(self) -> None:
        self.fatal = self.registration.fatal
        self.server.stop()

    def _data_plane_health(self, healthy: bool) -> None:
        """The self-check's verdict: off the ring while the data plane does not answer, back after."""
        if not healthy and self.record.state == NodeState.ACTIVE:
            self.set_state(NodeState.UNHEALTHY)
        elif healthy and self.record.state == NodeState.UNHEALTHY:
            self.set_state(NodeState.ACTIVE)

    def set_state(self, state: NodeState) -> None:
        self.record = msgspec.structs.replace(self.record, state=state)
        if self.registration is not None:
            self.registration.set_state(state)

    def ready(self) -> bool:
        """Serving: registered once (clients can find it), not leaving the ring, and its data plane
        answering its own check.  etcd going away later does not make a node unready: it keeps
        serving, and clients keep its ring."""
        registered = self.config.etcd is None or (
            self.registration is not None and self.registration.registrar.registrations > 0)
        return registered and self.record.state.on_ring

    def stop(self) -> None:
        self.server.stop()

    def serve_forever(self) -> None:
        try:
            self.server.serve_forever()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self.handoff is not None:
            self.handoff.stop()
        if self.anchors is not None:
            self.anchors.stop()
        if self.registration is not None:
            self.registration.leave(drained=self.record.state == NodeState.DRAINED and "etcd" in self.drain.requests)
        self.http.shutdown()
        if self.disk is not None:
            self.disk.close()  # writes what is still queued first
        if self.events is not None:
            self.events.close()

    def stats(self) -> dict:
        """The node's ``/stats`` (run it on the I/O thread: it reads the store)."""
        m = self.metrics
        return {
            "node_id": self.config.node_id,
            "state": self.record.state,
            "data_addr": self.record.data_addr,
            "admin_addr": self.record.admin_addr,
            "capacity": self.store.capacity,
            "used": self.store.used,
            "chunks": len(self.store),
            "evictions": self.store.evictions,
            "leased_bytes": self.store.leased_bytes(),
            "pooled_bytes": self.buffers.bytes,  # freed payload buffers kept for reuse (outside the budget)
            "buffers_reused": self.buffers.reused,
            # hits/misses: what LOOKUPs found (the cache's hit rate); GETs are counted apart.
            "hits": m.tally["lookup_hits"],
            "misses": m.tally["lookup_misses"],
            **m.tally,
            "errors": dict(m.error_tally),
            "registered": bool(self.registration and self.registration.registered),
            "registrations": self.registration.registrar.registrations if self.registration else 0,
            "handed_off": self.handoff.moved if self.handoff else 0,
            "anchors": self.anchors.counts.as_dict() if self.anchors else None,
            "repair": self.handoff.repair.as_dict() if self.handoff else None,
            "namespaces": len(self.store.namespaces()),
            "drain": self.drain.status(),
            "connections": len(self.server.conns),
            # What peers hold of the node (server.py): partly received messages within the budget,
            # connections paused for it or closed for silence, and descriptors.
            "partial_bytes": self.server.held,
            "receive_budget": self.server.receive_budget,
            "connections_paused": self.server.paused,
            "connections_timed_out": self.server.timed_out,
            "connections_shed": self.server.shed,
            "accept_failures": self.server.accept_failures,
            "accept_pauses": self.server.accept_pauses,
            "descriptor_limit": self.server.descriptor_limit,
            "connection_limit": self.server.connection_limit,
            "tls": self.config.tls is not None,
            "tls_refused": self.metrics.refused_count,
            "tls_closed": self.server.tls_closed,
            "credentials": self._credentials_stats(),
            "kv_events": self.events.publisher.stats() if self.events else None,
            "disk": self._disk_stats(),
            "uptime_s": round(time.time() - self.started, 3),
            "pid": os.getpid(),
        }

    def _credentials_stats(self) -> dict:
        """What the node has loaded of its credentials, so that a rotation can tell when every
        node has taken a step: the TLS set's fingerprints and those of the node tokens."""
        tls, token = self.config.tls, self.config.node_token
        return {
            "tls": None if tls is None else {
                **tls.loaded.as_dict(), "reloads": tls.reloads, "reload_error": tls.reload_error},
            "node_token": None if token is None else {
                "accepted": token.fingerprints, "reloads": token.reloads, "reload_error": token.reload_error},
        }

    def _disk_stats(self) -> dict | None:
        if self.disk is None:
            return None
        return {**self.disk.stats(), "prefetched": self.holdings.prefetched,
                "prefetch_skipped": self.holdings.prefetch_skipped,
                "read_timeouts": self.holdings.read_timeouts, "rewritten": self.holdings.rewritten}


def say(line: str) -> None:
    """One line to stdout in one write: ``print`` writes the text and its newline separately, so
    a log record another thread writes to the same pipe (stderr and stdout are one pipe under a
    launcher) could land in between and end up inside the READY line a launcher parses."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_node(config: NodeConfig) -> int:
    """Run a node until SIGTERM/SIGINT; prints one READY line with its addresses for launchers."""
    try:
        node = CacheNode(config)
    except (CredentialsError, DiskError) as exc:
        say(f"error: {exc}")
        return 2
    try:
        node.start_background()
    except (ContractMismatch, NodeIdTaken) as exc:
        logger.error("%s", exc)
        say(f"error: {exc}")
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: node.stop())
    say(f"READY node={config.node_id} data={node.record.data_addr} admin={node.record.admin_addr}")
    node.serve_forever()
    return 2 if node.fatal else 0
