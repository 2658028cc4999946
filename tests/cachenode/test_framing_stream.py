"""``FrameReader`` on real loopback TCP connections, plain and TLS (the cluster's credentials),
read the way the node's loop and the client read: poll for input, then ``read``.  A sender
thread writes messages cut anywhere, with pauses, while the reader takes large payloads straight
from the socket (TLS records in a tight loop) under a receive low-water mark: every byte comes
out as sent, and no wait outlasts the sender (a mark the remaining bytes cannot reach would)."""

from __future__ import annotations

import os
import random
import select
import socket
import threading
import time

import numpy as np
import pytest
import xxhash

from kvring.cachenode import framing
from kvring.cachenode.framing import LOW_WATER, FrameLimits, FrameReader, pack
from kvring.cachenode.landing import Landed, Landing
from kvring.common.tls import generate

LIMITS = FrameLimits(max_header=1 << 20, max_payloads=8, max_payload=8 << 20, max_total=32 << 20)
STALL = 5.0  # seconds without a message although the sender is done: the reader is stuck


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("tls"), "framing")


def _connected(credentials, tls: bool) -> tuple[socket.socket, socket.socket]:
    """(sender, receiver) over loopback TCP; over TLS when asked, handshakes done."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
    if not tls:
        return sender, receiver
    done: dict = {}
    server = threading.Thread(target=lambda: done.update(
        sock=credentials.server_context().wrap_socket(receiver, server_side=True)))
    server.start()
    sender = credentials.client_context().wrap_socket(sender, server_hostname="kvring")
    server.join(10)
    return sender, done["sock"]


def _messages(rng: random.Random) -> list[tuple[bytes, list[bytes]]]:
    sizes = [0, 3, 16_000, 65_536, 70_000, 100_000, LOW_WATER - 1, LOW_WATER + (17 << 10), 300_000,
             (1 << 20) + 5, 3 << 20]
    return [(os.urandom(rng.choice([5, 300, 20_000, 70_000])),
             [os.urandom(rng.choice(sizes)) for _ in range(rng.choice([1, 2, 4, 8]))]) for _ in range(60)]


class _Sender(threading.Thread):
    """Sends each message in pieces of any size, now and then after a pause, and the next one
    only once the reader has it, as a client waits for its reply: a message the reader leaves
    unread although its bytes arrived stops the exchange, and ``stuck`` says which."""

    def __init__(self, sock: socket.socket, messages: list[bytes], rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.sock, self.messages, self.rng = sock, messages, rng
        self.read = threading.Semaphore(0)
        self.stuck: int | None = None

    def run(self) -> None:
        for i, data in enumerate(self.messages):
            sent = 0
            while sent < len(data):
                n = self.rng.choice([1, 7, 5000, 70_000, 300_000, 1 << 20])
                self.sock.sendall(data[sent:sent + n])
                sent += n
                if self.rng.random() < 0.05:
                    time.sleep(0.002)
            if not self.read.acquire(timeout=STALL):
                self.stuck = i
                return


@pytest.mark.parametrize("tls,budget,eager", [(False, None, False), (True, None, False), (True, 1, False),
                                              (False, None, True), (True, None, True), (True, 1, True)],
                         ids=["plain", "tls", "tls-one-record-a-turn", "plain-eager", "tls-eager",
                              "tls-eager-one-record-a-turn"])
def test_large_payloads_read_under_a_low_water_mark_come_out_whole_and_never_stall(credentials, tls, budget, eager,
                                                                                   monkeypatch):
    """With a read budget of one record per turn, turns end with their budget spent, at times
    with the rest of a record decrypted inside OpenSSL: the turn must take those bytes too, since
    no poll sees them.  An eager reader (the client's) takes a payload's buffer before its first
    byte is read, at times on a wake-up that brings no whole record: it keeps that buffer and
    fills it on the next turns, and reads consecutive large payloads of a message into one
    buffer, cut into the payloads once full."""
    if budget is not None:
        monkeypatch.setattr(framing, "TLS_READ_BYTES", budget)
    messages = _messages(random.Random(11))
    frames = [b"".join(bytes(memoryview(x)) for x in pack(h, p)) for h, p in messages]
    sender, receiver = _connected(credentials, tls)
    with sender, receiver:
        thread = _Sender(sender, frames, random.Random(5))
        thread.start()
        receiver.setblocking(False)
        poller = select.poll()
        poller.register(receiver.fileno(), select.POLLIN)
        allocated: list[int] = []
        reader = FrameReader(LIMITS, eager=eager, allocate=lambda n: allocated.append(n) or np.empty(n, np.uint8))
        got, marks = [], set()
        while len(got) < len(messages):
            assert thread.stuck is None, f"message {thread.stuck} arrived but was never read out"
            if not poller.poll(100):  # read only when poll says so, as the node's loop does
                continue
            new = reader.read(receiver)  # one turn, as the node's loop takes it
            marks.add(receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
            got += new
            for _ in new:
                thread.read.release()
        thread.join(10)
        assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1  # between messages
    assert max(marks) == LOW_WATER  # the mark was used on the large payloads
    shared = 0  # payloads that came out of a buffer shared with the payload before them
    for (header, payloads), message in zip(messages, got):
        assert bytes(message.header) == header
        assert [bytes(memoryview(p)) for p in message.payloads] == payloads
        shared += sum(isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.base is not None
                      and a.base is b.base for a, b in zip(message.payloads, message.payloads[1:]))
    assert reader.held == 0
    # An eager reader fills consecutive large payloads of a message into one buffer (one pass,
    # one allocation); the other reader gives each its own.
    assert (shared > 0) == eager
    # ... but never more than one payload may declare in all: a longer run is cut into several.
    assert any(sum(n for n in p_sizes if n >= 64 << 10) > LIMITS.max_payload
               for p_sizes in ([len(p) for p in payloads] for _, payloads in messages))
    assert max(allocated) <= LIMITS.max_payload


def test_an_eager_reader_shares_a_buffer_among_payloads_up_to_what_one_payload_may_declare():
    """A message of four 3 MiB payloads whose header is read first: the eager reader fills them
    two at a time (6 MiB, within ``max_payload`` of 8 MiB), never all 12 MiB at once, and every
    byte comes out."""
    payloads = [os.urandom(3 << 20) for _ in range(4)]
    frame = b"".join(bytes(memoryview(x)) for x in pack(b"head", payloads))
    first = len(frame) - sum(map(len, payloads))  # the prefix, the sizes and the header
    sender, receiver = socket.socketpair()
    with sender, receiver:
        receiver.setblocking(False)
        allocated: list[int] = []
        reader = FrameReader(LIMITS, eager=True, allocate=lambda n: allocated.append(n) or np.empty(n, np.uint8))
        sender.sendall(frame[:first])
        assert reader.read(receiver) == []  # the header parsed; no payload byte here yet
        thread = threading.Thread(target=sender.sendall, args=(frame[first:],))
        thread.start()
        got = []
        while not got:
            select.select([receiver], [], [], 5)
            got = reader.read(receiver)
        thread.join(10)
    assert allocated == [6 << 20, 6 << 20]
    assert [bytes(memoryview(p)) for p in got[0].payloads] == payloads


class _Places:
    """The ``land`` callback of a test: every other large payload gets a landing in one shared
    destination, cut into pieces placed anywhere in it (as a chunk's rows land in scattered cache
    blocks), with some pieces dropped (rows the caller does not want); ``wanted`` turns false
    after ``take_back_after`` receives into the destination (an abandoned load)."""

    def __init__(self, rng: random.Random, take_back_after: int | None = None) -> None:
        self.rng = rng
        self.dest = np.zeros(64 << 20, np.uint8)
        self.free = 0
        self.lock = threading.Lock()
        self.landings: list[tuple[int, int, list[tuple[int, int, int | None]]]] = []  # (message, payload, pieces)
        self.receives = 0
        self.take_back_after = take_back_after
        self.message = 0

    def wanted(self) -> bool:
        assert self.lock.locked()  # only ever asked under the guard
        self.receives += 1
        return self.take_back_after is None or self.receives <= self.take_back_after

    def __call__(self, header: bytearray, index: int, size: int):
        if index % 2:
            return None
        pieces, segments, at = [], [], 0  # (offset in the payload, size, place in dest or None: dropped)
        while at < size:
            n = min(size - at, self.rng.choice([1, 100, 4096, 70_000, 1 << 20]))
            if self.rng.random() < 0.2:
                pieces.append((at, n, None))
                segments.append(n)
            else:
                place = self.free
                self.free += n + self.rng.choice([0, 8, 4096])
                pieces.append((at, n, place))
                segments.append(memoryview(self.dest)[place:place + n])
            at += n
        self.landings.append((self.message, index, pieces))
        return Landing(segments, self.lock, self.wanted, xxhash.xxh3_64())


@pytest.mark.parametrize("tls,budget", [(False, None), (True, None), (True, 1)],
                         ids=["plain", "tls", "tls-one-record-a-turn"])
def test_payloads_land_in_their_places_byte_for_byte_with_their_digest(credentials, tls, budget, monkeypatch):
    """An eager reader with a ``land`` callback receives each landed payload into its scattered
    views and drops its dropped pieces: every placed byte is the payload's, nothing outside the
    places is written, the digest is the whole payload's XXH3, and the other payloads and
    messages come out as sent.  Cuts anywhere put a payload's first bytes in the receive buffer
    (copied into its landing) or not (received straight into it)."""
    if budget is not None:
        monkeypatch.setattr(framing, "TLS_READ_BYTES", budget)
    messages = _messages(random.Random(12))
    frames = [b"".join(bytes(memoryview(x)) for x in pack(h, p)) for h, p in messages]
    places = _Places(random.Random(3))
    got = _read_all(credentials, tls, frames, len(messages), places)
    written = np.zeros(len(places.dest), bool)
    landed = 0
    for m, index, pieces in places.landings:
        payload = np.frombuffer(messages[m][1][index], np.uint8)
        part = got[m].payloads[index]
        assert isinstance(part, Landed) and part.complete and part.nbytes == len(payload)
        assert part.digest == xxhash.xxh3_64_intdigest(payload)
        for at, n, place in pieces:
            if place is not None:
                assert np.array_equal(places.dest[place:place + n], payload[at:at + n])
                written[place:place + n] = True
        landed += 1
    assert landed > 10
    assert not places.dest[~written].any()  # nothing written outside the places
    _assert_the_rest_as_sent(messages, got)


def test_a_landing_taken_back_midway_gets_no_byte_after_and_the_stream_goes_on(credentials):
    """``wanted`` turns false after a few receives (a load abandoned): from then on nothing is
    written to any place (the rest of the payload, and later landings, are read and dropped),
    the payload is ``complete=False`` with the whole payload's digest still, and every later
    message comes out whole."""
    messages = _messages(random.Random(13))
    frames = [b"".join(bytes(memoryview(x)) for x in pack(h, p)) for h, p in messages]
    places = _Places(random.Random(4), take_back_after=20)
    got = _read_all(credentials, True, frames, len(messages), places)
    incomplete = [(m, i) for m, i, _ in places.landings if not got[m].payloads[i].complete]
    assert incomplete and places.receives > 20
    for m, index, _ in places.landings:
        assert got[m].payloads[index].digest == xxhash.xxh3_64_intdigest(messages[m][1][index])
    # What the places hold is exactly the bytes of the first 20 receives: a prefix of the landed
    # pieces, in order, and zeros after it.
    order = [(m, i, at, n, place) for m, i, pieces in places.landings for at, n, place in pieces if place is not None]
    ends = [place + n for *_, n, place in order]
    last = max((k for k, (m, i, at, n, place) in enumerate(order) if places.dest[place:place + n].any()), default=-1)
    assert last >= 0 and not places.dest[ends[last]:].any()
    for m, i, at, n, place in order[:last]:  # the pieces before the cut: all there
        assert np.array_equal(places.dest[place:place + n], np.frombuffer(messages[m][1][i], np.uint8)[at:at + n])
    _assert_the_rest_as_sent(messages, got)


def _assert_the_rest_as_sent(messages: list, got: list) -> None:
    """Every header, and every payload that did not land, came out as sent."""
    for m, (header, payloads) in enumerate(messages):
        assert bytes(got[m].header) == header
        for i, p in enumerate(payloads):
            if not isinstance(got[m].payloads[i], Landed):
                assert bytes(memoryview(got[m].payloads[i])) == p


def _read_all(credentials, tls: bool, frames: list[bytes], count: int, places: _Places) -> list:
    sender, receiver = _connected(credentials, tls)
    with sender, receiver:
        thread = _Sender(sender, frames, random.Random(6))
        thread.start()
        receiver.setblocking(False)
        poller = select.poll()
        poller.register(receiver.fileno(), select.POLLIN)
        reader = FrameReader(LIMITS, eager=True)
        reader.land = places
        got: list = []
        while len(got) < count:
            assert thread.stuck is None, f"message {thread.stuck} arrived but was never read out"
            if not poller.poll(100):
                continue
            places.message = len(got)  # the message under way: the sender waits for each one's reading
            new = reader.read(receiver)
            got += new
            for _ in new:
                thread.read.release()
        thread.join(10)
    assert reader.held == 0
    return got
