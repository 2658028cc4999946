"""``EventPublisher``: KV events on a ZMQ PUB socket, with replay, as vLLM's ``ZmqEventPublisher``.

Wire (what vLLM's subscribers expect):
- PUB: one message per batch, three frames: ``topic``, the batch's sequence number (8 bytes,
  big-endian, from 0 at each start of the publisher), the msgpack batch (``wire.encode_batch``).
- ROUTER (replay): a subscriber sends the first sequence number it wants (8 bytes big-endian,
  after the empty delimiter frame a REQ or DEALER socket sends); it gets every batch still
  buffered from that number on, each as ``"", topic, seq, batch``, then the end marker
  ``"", "", -1 (8 bytes), ""``.  The last ``buffer_batches`` batches are kept, at most
  ``buffer_bytes`` of them (the oldest go first).

Threads: ``publish`` may be called from any thread and never blocks: it appends to a bounded
queue (what it is given is turned into events by ``render`` on the publisher's thread, so a
caller on a busy loop only appends a reference) (past ``max_queued`` events the newest are dropped and counted in ``dropped``: a router
that misses a store only under-credits the pool, and one that misses a removal is corrected by
the next ``AllBlocksCleared``).  One thread of its own owns both sockets; it sends what is
queued as one batch every ``interval`` seconds at most (up to ``max_batch`` events each).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from .wire import Event, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class PublisherSettings:
    host: str = "127.0.0.1"  # the interface both sockets bind
    port: int = 0  # PUB port (0: any free one)
    replay_port: int = 0  # ROUTER port (0: any free one)
    topic: str = ""
    buffer_batches: int = 10_000
    buffer_bytes: int = 64 << 20  # what the replay buffer may hold, encoded
    max_queued: int = 100_000
    max_batch: int = 1_000
    interval: float = 0.01
    hwm: int = 100_000
    # XPUB instead of PUB: ``on_subscribe`` is called (on the publisher's thread) each time a
    # subscriber joins, so the caller can publish what a newcomer needs (the pool stream's snapshot).
    xpub: bool = False


class EventPublisher:
    """``render`` turns each published item into its event on the publisher's thread (default:
    items are events already)."""

    def __init__(self, settings: PublisherSettings, render: Callable[[Any], Event] | None = None,
                 on_subscribe: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self._render = render or (lambda event: event)
        self._on_subscribe = on_subscribe
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB if settings.xpub else zmq.PUB)
        if settings.xpub:
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first only
        self._pub.set_hwm(settings.hwm)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self.port = self._bind(self._pub, settings.port)
        self.replay_port = self._bind(self._replay, settings.replay_port)
        self._topic = settings.topic.encode()
        self._queue: deque[Any] = deque()
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered_bytes = 0
        self._seq = 0
        self._wake = threading.Event()
        self._stopping = False
        self.published_events = 0
        self.published_batches = 0
        self.dropped = 0
        self.replays = 0
        self.subscriptions = 0
        self._thread = threading.Thread(target=self._run, name="kvring-events", daemon=True)
        self._thread.start()

    def _bind(self, sock: zmq.Socket, port: int) -> int:
        host = self.settings.host
        host = f"[{host}]" if ":" in host else host
        if ":" in self.settings.host:
            sock.setsockopt(zmq.IPV6, 1)
        if port:
            sock.bind(f"tcp://{host}:{port}")
            return port
        return sock.bind_to_random_port(f"tcp://{host}")

    def publish(self, *events: Any) -> None:
        """Queue ``events`` (or items ``render`` makes events of) for the next batch (from any
        thread; never blocks)."""
        room = self.settings.max_queued - len(self._queue)
        if room < len(events):
            self.dropped += len(events) - max(room, 0)
            events = events[:max(room, 0)]
        self._queue.extend(events)
        self._wake.set()

    @property
    def backlog(self) -> int:
        """Events queued, not sent yet."""
        return len(self._queue)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close both sockets."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._ctx.destroy(linger=0)

    def stats(self) -> dict[str, int]:
        return {"published_events": self.published_events, "published_batches": self.published_batches,
                "dropped_events": self.dropped, "replays": self.replays, "subscriptions": self.subscriptions,
                "last_seq": self._seq - 1,
                "replay_buffer_batches": len(self._buffer), "replay_buffer_bytes": self._buffered_bytes}

    # ---- the publisher's thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._replay.poll(0):
                    self._serve_replay()
                if self.settings.xpub and self._pub.poll(0):
                    self._subscribed(self._pub.recv())
                if self._queue:
                    self._send_batch()
                    time.sleep(self.settings.interval)  # let the next batch gather
                elif self._stopping:
                    return
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except zmq.ZMQError as exc:
            if not self._stopping:
                logger.error("kvring: the KV-event publisher stopped: %s", exc)

    def _send_batch(self) -> None:
        events = []
        while self._queue and len(events) < self.settings.max_batch:
            events.append(self._render(self._queue.popleft()))
        payload = encode_batch(events)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._buffered_bytes += len(payload)
        while len(self._buffer) > self.settings.buffer_batches or self._buffered_bytes > self.settings.buffer_bytes:
            self._buffered_bytes -= len(self._buffer.popleft()[1])
        self.published_events += len(events)
        self.published_batches += 1

    def _subscribed(self, message: bytes) -> None:
        if message[:1] == b"\x01":  # a subscription (b"\x00": one going away)
            self.subscriptions += 1
            if self._on_subscribe is not None:
                self._on_subscribe()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kvring: ignored a KV-event replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.replays += 1
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
