"""A client's TLS connection whose records are decrypted from memory, not read by OpenSSL.

``ssl.SSLSocket`` lets OpenSSL read the socket: two ``recv`` calls for every record (its 5-byte
header, then its body), and a record holds at most 16 KiB.  A load is many megabytes of records
(100 MB for an 8k-token prompt of ``bench e2e``'s small model), so those calls cost the loading
thread a quarter of its CPU: in an interleaved A/B of 768 frames of 128 KiB from 3 nodes into a
paged cache, the loader took 0.76 of its CPU with this stream and moved 1.28x the GB/s.
``TlsStream`` reads the socket itself, up to ``RAW_READ`` bytes a call, into an
``ssl.MemoryBIO`` that OpenSSL decrypts from (``SSLContext.wrap_bio``), and encrypts into one
that it sends from.  Nodes keep ``SSLSocket`` (their loop, ``server.py``, is built on it).

It is the non-blocking ``SSLSocket`` that ``FrameReader`` and ``SendQueue`` use, in the calls
they make:

- ``read(n, buf)`` / ``recv_into(buf)``: decrypted bytes, or ``ssl.SSLWantReadError`` (or
  ``BlockingIOError``) when no whole record is here; 0 at the peer's end of the stream (a
  ragged end too, as ``SSLSocket`` with ``suppress_ragged_eofs``).
- ``pending()``: bytes here that no poll would announce: decrypted ones, and records (or a part
  of one) read off the socket and not yet decrypted.  A reader keeps reading while it is not 0,
  so a turn ends only with nothing whole left here.
- ``send(data)``: the plaintext taken (at most ``SEND_PIECE`` bytes a call), encrypted and sent
  as far as the socket takes it; records it did not take are ``unsent`` and go first on the next
  call (``flush``).  A ``SendQueue`` counts them as its own, so its owner polls for ``POLLOUT``
  until they are out.

The handshake runs in the constructor, blocking, within the socket's timeout.
"""

from __future__ import annotations

import socket
import ssl

RAW_READ = 1 << 20  # bytes read off the socket a call (the A/B above: 256 KiB did as well)
# Plaintext encrypted a call, its records then sent as far as the socket takes them.  Interleaved
# 32 MiB PUTs to a node: 64 KiB as fast as ``SSLSocket`` (0.90-1.17 GB/s against 0.91-1.03), 16
# KiB slower (a call per record), 256 KiB slower too (the node waits while a piece is encrypted).
SEND_PIECE = 64 << 10


class TlsStream:
    """TLS over ``sock`` (connected, blocking with a timeout) with ``context``'s settings."""

    __slots__ = ("sock", "_tls", "_incoming", "_outgoing", "_raw", "_unsent")

    def __init__(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        self.sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing)  # names unchecked: see common/tls.py
        self._unsent = memoryview(b"")
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._send_all(self._outgoing.read())
                data = sock.recv(65536)
                if not data:
                    raise ConnectionResetError("the peer closed the connection during the TLS handshake")
                self._incoming.write(data)
        self._send_all(self._outgoing.read())
        self._raw = memoryview(bytearray(RAW_READ))

    def _send_all(self, data: bytes) -> None:
        if data:
            self.sock.sendall(data)

    # ---- the socket's own calls -------------------------------------------------------------

    def fileno(self) -> int:
        return self.sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)

    def close(self) -> None:
        self.sock.close()

    # ---- receiving ---------------------------------------------------------------------------

    def read(self, n: int, buf) -> int:
        """Up to ``n`` decrypted bytes into ``buf`` (see the module docstring)."""
        while True:
            try:
                return self._tls.read(n, buf)
            except ssl.SSLWantReadError:
                if self._incoming.eof:
                    return 0
                got = self.sock.recv_into(self._raw)  # BlockingIOError: nothing here, say so
                if not got:
                    self._incoming.write_eof()
                    continue
                self._incoming.write(self._raw[:got])
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    def recv_into(self, buf, nbytes: int = 0) -> int:
        return self.read(nbytes or memoryview(buf).nbytes, buf)

    def pending(self) -> int:
        return self._tls.pending() + self._incoming.pending

    # ---- sending -----------------------------------------------------------------------------

    @property
    def unsent(self) -> int:
        """Bytes of records encrypted and not yet taken by the socket."""
        return self._unsent.nbytes

    def flush(self) -> None:
        """Send what the socket takes of the records not yet sent."""
        while self._unsent:
            try:
                sent = self.sock.send(self._unsent)
            except (BlockingIOError, InterruptedError):
                return
            self._unsent = self._unsent[sent:]

    def send(self, data) -> int:
        """Take up to ``SEND_PIECE`` bytes of ``data`` (see the module docstring); raises
        ``ssl.SSLWantWriteError`` while earlier records are still waiting for the socket."""
        self.flush()
        if self._unsent:
            raise ssl.SSLWantWriteError("earlier records are waiting for the socket")
        piece = memoryview(data)[:SEND_PIECE]
        taken = self._tls.write(piece)
        self._unsent = memoryview(self._outgoing.read())
        self.flush()
        return taken
