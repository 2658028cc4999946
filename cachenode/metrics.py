"""Prometheus metrics of one cache node, on a registry of its own (no process globals)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvring.common.errors import ErrorCode
from kvring.common.types import NodeState

OPS = ("ping", "lookup", "get", "put", "delete", "stats", "keys", "flush")
_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class NodeMetrics:
    def __init__(self, store) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("kvring_node_bytes_used", "Bytes of chunks stored", registry=r).set_function(lambda: store.used)
        Gauge("kvring_node_capacity_bytes", "The node's cache budget in bytes", registry=r).set_function(
            lambda: store.capacity)
        Gauge("kvring_node_chunks", "Chunks stored", registry=r).set_function(lambda: len(store))
        Gauge("kvring_node_leased_bytes", "Bytes under lookup leases", registry=r).set_function(
            store.leased_bytes)
        self.evictions = Gauge("kvring_node_evictions_total", "Chunks evicted to make room", registry=r)
        self.evictions.set_function(lambda: store.evictions)
        hits = Counter("kvring_node_hits", "Keys found, by operation (lookup or get)", ["op"], registry=r)
        misses = Counter("kvring_node_misses", "Keys not found, by operation (lookup or get)", ["op"], registry=r)
        self.tally = {"lookup_hits": 0, "lookup_misses": 0, "get_hits": 0, "get_misses": 0}
        self._hits = {op: hits.labels(op) for op in ("lookup", "get")}
        self._misses = {op: misses.labels(op) for op in ("lookup", "get")}
        self.errors = Counter("kvring_node_errors", "Requests answered with an error, by kind", ["kind"], registry=r)
        self.bytes_in = Counter("kvring_node_received_bytes", "Payload bytes received (PUT)", registry=r)
        self.bytes_out = Counter("kvring_node_sent_bytes", "Payload bytes sent (GET)", registry=r)
        self.latency = Histogram("kvring_node_op_seconds", "Time to handle a request, by operation", ["op"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self._op_latency = {op: self.latency.labels(op) for op in OPS}
        self._errors = {code: self.errors.labels(code) for code in ErrorCode}
        self.error_tally = dict.fromkeys(ErrorCode, 0)
        self.refused = Counter("kvring_node_tls_refused", "Connections refused at the TLS handshake (no or wrong "
                               "cluster credentials, or plain text)", registry=r)
        self.refused_count = 0

    def watch_server(self, server) -> None:
        """Gauges of what peers hold of the data port (``server.Server``): read when scraped."""
        r = self.registry
        for name, doc, read in (
            ("kvring_node_connections", "Open data-port connections", lambda: len(server.conns)),
            ("kvring_node_partial_bytes", "Bytes of partly received messages held (within --receive-budget)",
             lambda: server.held),
            ("kvring_node_receive_budget_bytes", "The budget for partly received messages",
             lambda: server.receive_budget),
            ("kvring_node_connections_paused", "Connections not read until the receive budget has room",
             lambda: server.paused),
            ("kvring_node_connections_timed_out_total", "Connections closed for silence in the middle of a message "
             "(or of a TLS handshake)", lambda: server.timed_out),
            ("kvring_node_connections_shed_total", "Idle connections closed to make room for new ones",
             lambda: server.shed),
            ("kvring_node_accept_failures_total", "Accepts that failed (out of descriptors, mostly)",
             lambda: server.accept_failures),
            ("kvring_node_accept_pauses_total", "Times the node stopped accepting for a while (at its connection "
             "limit with nothing to shed, or after a failed accept)", lambda: server.accept_pauses),
            ("kvring_node_descriptor_limit", "The process's file-descriptor limit (RLIMIT_NOFILE)",
             lambda: server.descriptor_limit),
            ("kvring_node_connection_limit", "Connections accepted at most (the descriptor limit less a reserve)",
             lambda: server.connection_limit),
        ):
            Gauge(name, doc, registry=r).set_function(read)

    def watch_credentials(self, tls, server) -> None:
        """Gauges of the node's TLS credentials (``common.tls.ClusterCredentials``): when the
        certificate it shows expires, how often a new set was taken, whether the files now in
        place failed to load (the last good set is still in use), and connections closed when a
        CA was dropped (``server.Server``)."""
        r = self.registry
        for name, doc, read in (
            ("kvring_node_tls_cert_expiry_timestamp_seconds", "When the certificate the node shows expires "
             "(Unix seconds)", lambda: tls.loaded.not_after),
            ("kvring_node_tls_reloads_total", "New TLS credentials taken from the mounted files without a restart",
             lambda: tls.reloads),
            ("kvring_node_tls_reload_failing", "1 while the credentials' files in place do not load (the last good "
             "set stays in use)", lambda: 1 if tls.reload_error else 0),
            ("kvring_node_tls_closed_total", "Connections closed because the CA that admitted them is no longer "
             "trusted", lambda: server.tls_closed),
        ):
            Gauge(name, doc, registry=r).set_function(read)

    def watch_disk(self, disk, rewritten: Callable[[], int]) -> None:
        """Gauges of the disk tier (``disk.tier.DiskTier``) and ``rewritten()``, the chunks the node
        wrote to it again as their segment went (``Holdings``): read when scraped."""
        r, counts = self.registry, disk.counts
        Gauge("kvring_node_disk_bytes_used", "Bytes of the disk tier's segments", registry=r).set_function(
            lambda: disk.index.bytes)
        Gauge("kvring_node_disk_capacity_bytes", "The disk tier's budget in bytes", registry=r).set_function(
            lambda: disk.config.capacity)
        Gauge("kvring_node_disk_chunks", "Chunks on disk", registry=r).set_function(lambda: len(disk))
        Gauge("kvring_node_disk_queued_bytes", "Bytes of chunks waiting to be written to disk",
              registry=r).set_function(lambda: disk.queued_bytes)
        for name, key, doc in (
            ("written", "written", "Chunks written to disk"),
            ("read", "reads", "Chunks read back from disk, checked"),
            ("corrupt", "corrupt", "Chunks read from disk that failed their checks (dropped, answered as misses)"),
            ("full", "full", "Writes that found the filesystem full (ENOSPC): the chunk stays in memory only"),
            ("write_skipped", "write_skipped", "Chunks not written because the write queue was full"),
            ("evicted", "evicted", "Chunks evicted from disk past its budget"),
            ("carried", "carried", "Chunks read from disk since they were written, carried to the newest segment "
                                   "as theirs was evicted (second-chance eviction)"),
            ("scrubbed_bytes", "scrubbed_bytes", "Bytes of chunks the scrub read again and checked"),
            ("scrub_passes", "scrub_passes", "Passes of the scrub over every chunk on disk"),
        ):
            Gauge(f"kvring_node_disk_{name}_total", doc, registry=r).set_function(lambda key=key: counts[key])
        Gauge("kvring_node_disk_rewritten_total", "Chunks written to disk again as their segment was evicted (memory "
              "still held them)", registry=r).set_function(rewritten)

    def watch_membership(self, state, registered) -> None:
        """Gauges of the node's place in the ring: ``state()`` (a ``NodeState``) and ``registered()``
        (its record is in etcd under a live lease).  Only for a node that registers (with etcd)."""
        r = self.registry
        gauge = Gauge("kvring_node_state", "1 for the node's current state (joining, active, draining, drained, "
                      "unhealthy), 0 for the others", ["state"], registry=r)
        for s in NodeState:
            gauge.labels(s.value).set_function(lambda s=s: 1 if state() == s else 0)
        Gauge("kvring_node_registered", "1 while the node's record is in etcd under a live lease (0: clients "
              "and peers cannot find it)", registry=r).set_function(lambda: 1 if registered() else 0)

    def watch_repair(self, progress) -> None:
        """Gauges of the node's repair passes (``repair.RepairProgress``, written by the handoff thread)."""
        r = self.registry
        for name, doc, read in (
            ("active", "1 while a repair pass runs", lambda: progress.active),
            ("moving", "1 while a repair pass restores copies its co-owners lack", lambda: progress.moving),
            ("incomplete", "1 if the last finished pass left work (an owner did not answer; it runs again)",
             lambda: progress.incomplete),
            ("missing", "Owner copies the current (or last) pass found missing", lambda: progress.missing),
            ("copied", "Of those, copies made so far", lambda: progress.copied),
            ("passes_total", "Repair passes finished or broken off", lambda: progress.passes),
            ("copied_total", "Copies repair made, all passes", lambda: progress.copied_total),
            ("copied_bytes_total", "Bytes of the copies repair made, all passes",
             lambda: progress.copied_bytes_total),
        ):
            Gauge(f"kvring_node_repair_{name}", doc, registry=r).set_function(lambda read=read: int(read()))

    def watch_anchors(self, counts) -> None:
        """Counters of the anchors deleted for parts the node let go (``anchors.AnchorCounts``)."""
        for name, doc in (
            ("parts", "Parts naming an anchor that the node let go by itself, taken up"),
            ("held_elsewhere", "Of those, held by another owner (their chunk kept)"),
            ("anchors_deleted", "Anchor copies deleted for parts held nowhere"),
            ("skipped", "Parts not taken up: too many waited"),
            ("failed", "Parts whose anchors could not be deleted (the cluster out of reach)"),
        ):
            Gauge(f"kvring_node_anchor_{name}_total", doc, registry=self.registry).set_function(
                lambda name=name: getattr(counts, name))

    def refuse(self) -> None:
        self.refused.inc()
        self.refused_count += 1

    def observe(self, op: str, seconds: float) -> None:
        hist = self._op_latency.get(op)
        if hist is not None:
            hist.observe(seconds)

    def found(self, op: str, hits: int, misses: int) -> None:
        """Count the keys an operation found and missed (op: lookup or get)."""
        self._hits[op].inc(hits)
        self._misses[op].inc(misses)
        self.tally[f"{op}_hits"] += hits
        self.tally[f"{op}_misses"] += misses

    def error(self, code: ErrorCode) -> None:
        self._errors[code].inc()
        self.error_tally[code] += 1
