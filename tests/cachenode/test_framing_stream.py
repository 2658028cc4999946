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

import pytest

from kvring.cachenode.framing import LOW_WATER, FrameLimits, FrameReader, pack
from kvring.common.tls import generate

LIMITS = FrameLimits(max_header=1 << 20, max_payloads=8, max_payload=8 << 20, max_total=32 << 20)
STALL = 10.0  # seconds without a message although the sender is done: the reader is stuck


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
    sizes = [0, 3, 16_000, 65_536, 70_000, LOW_WATER - 1, LOW_WATER + (17 << 10), 300_000,
             (1 << 20) + 5, 3 << 20]
    return [(os.urandom(rng.choice([5, 300, 70_000])),
             [os.urandom(rng.choice(sizes)) for _ in range(rng.choice([1, 2, 4]))]) for _ in range(24)]


def _send(sock: socket.socket, data: bytes, rng: random.Random) -> None:
    """The bytes in pieces of any size, now and then after a pause."""
    sent = 0
    while sent < len(data):
        n = rng.choice([1, 7, 5000, 70_000, 300_000, 1 << 20])
        sock.sendall(data[sent:sent + n])
        sent += n
        if rng.random() < 0.1:
            time.sleep(0.005)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_large_payloads_read_under_a_low_water_mark_come_out_whole_and_never_stall(credentials, tls):
    rng = random.Random(11)
    messages = _messages(rng)
    data = b"".join(b"".join(bytes(memoryview(x)) for x in pack(h, p)) for h, p in messages)
    sender, receiver = _connected(credentials, tls)
    with sender, receiver:
        thread = threading.Thread(target=_send, args=(sender, data, random.Random(5)), daemon=True)
        thread.start()
        receiver.setblocking(False)
        poller = select.poll()
        poller.register(receiver.fileno(), select.POLLIN)
        reader = FrameReader(LIMITS)
        got, marks, last = [], set(), time.monotonic()
        while len(got) < len(messages):
            poller.poll(100)
            new = reader.read(receiver)  # one turn, as the node's loop takes it
            got += new
            marks.add(receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
            if new:
                last = time.monotonic()
            assert thread.is_alive() or time.monotonic() - last < STALL, \
                f"stuck after {len(got)} of {len(messages)} messages with the sender done"
        thread.join(10)
        assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1  # between messages
    assert max(marks) == LOW_WATER  # the mark was used on the large payloads
    for (header, payloads), message in zip(messages, got):
        assert bytes(message.header) == header
        assert [bytes(memoryview(p)) for p in message.payloads] == payloads
    assert reader.held == 0
