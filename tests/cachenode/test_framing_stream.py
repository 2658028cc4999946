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
import ssl
import threading
import time

import numpy as np
import pytest

from kvring.cachenode import framing
from kvring.cachenode.framing import LOW_WATER, FrameLimits, FrameReader, pack
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
