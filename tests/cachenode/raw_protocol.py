"""A raw data-protocol connection for tests that send what no ClusterClient would."""

from __future__ import annotations

import select
import socket
import time

from kvring.cachenode.client.transport import REPLY_LIMITS
from kvring.cachenode.framing import FrameReader, Message, pack
from kvring.common import protocol as P


class RawConnection:
    def __init__(self, data_addr: str, timeout: float = 10.0) -> None:
        host, _, port = data_addr.removeprefix("tcp://").rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        self.reader = FrameReader(REPLY_LIMITS)
        self.inbox: list[Message] = []

    def send(self, header: bytes, payloads=()) -> None:
        self.sock.setblocking(True)
        self.sock.settimeout(self.timeout)
        self.sock.sendmsg(pack(header, payloads)) if sum(len(memoryview(p)) for p in payloads) < (1 << 20) \
            else self.sock.sendall(b"".join(bytes(memoryview(b)) for b in pack(header, payloads)))

    def send_raw(self, data: bytes) -> None:
        self.sock.setblocking(True)
        self.sock.sendall(data)

    def receive(self, timeout: float | None = None) -> Message:
        """The next message (raises TimeoutError, or ConnectionClosed if the node closed)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        self.sock.setblocking(False)
        while not self.inbox:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply")
            select.select([self.sock], [], [], left)
            self.inbox.extend(self.reader.read(self.sock))
        return self.inbox.pop(0)

    def reply(self, timeout: float | None = None):
        return P.decode_reply(self.receive(timeout).header)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
