"""JSON over HTTP/1.0 to one node's admin port (``cachenode/http.py``), on an asyncio loop.

The admin's threads ask the nodes often: every node's ``/stats`` at each view read, and
``/v1/present`` for every batch of lookups.  The node's server answers one request per
connection (HTTP/1.0, ``Content-Length``, then close), so a request here is: connect, send, read
to the end, parse.  An ``httpx.AsyncClient`` did the same for several times the CPU (connection
pooling, name resolution on a worker thread, its hooks and logging): with both threads sharing
the GIL with the serving loop, that CPU delayed every request the admin served.

``request_json`` raises ``NodeHTTPError`` for anything but a JSON answer with status 200 —
no connection, a timeout, another status (in ``status``), an answer over ``MAX_ANSWER_BYTES``,
or not JSON.  With ``token`` the request carries ``Authorization: Bearer <token>`` (the node
token that ``/v1/present`` and ``/v1/flush`` require).  An ``https://`` node is asked over TLS
with ``tls`` (the cluster's client context, whose certificate the guarded endpoints also
require); ``tls.admin_context`` refuses the mismatches.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any
from urllib.parse import urlsplit

from kvring.common.tls import CredentialsError, admin_context

MAX_ANSWER_BYTES = 64 << 20


class NodeHTTPError(Exception):
    """A node's admin port did not give a JSON answer with status 200 (``status``: the one it
    gave, None when there was no HTTP answer at all)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NodeTLSMismatch(NodeHTTPError):
    """Nothing was sent: the node's address is ``https://`` and no credentials were given, or it
    is ``http://`` while they were (``tls.admin_context``)."""


async def request_json(base_url: str, method: str, path: str, body: Any = None, *, timeout: float,
                       token: str | None = None, tls: ssl.SSLContext | None = None) -> Any:
    """``method path`` on ``base_url`` (``http(s)://host:port``) with ``body`` as JSON; the decoded answer."""
    url = urlsplit(base_url)
    if not url.hostname or not url.port:
        raise NodeHTTPError(f"{base_url!r} is not an http(s)://host:port address")
    try:
        context = admin_context(base_url, tls)
    except CredentialsError as exc:
        raise NodeTLSMismatch(str(exc)) from None
    payload = b"" if body is None else json.dumps(body).encode()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (f"{method} {path} HTTP/1.0\r\nHost: {url.netloc}\r\nAccept: application/json\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    try:
        async with asyncio.timeout(timeout):
            raw = await _exchange(url.hostname, url.port, head.encode() + payload, context)
    except TimeoutError:
        raise NodeHTTPError(f"no answer within {timeout:g}s") from None
    except OSError as exc:  # ssl.SSLError included: a node whose certificate the cluster CA did not sign
        raise NodeHTTPError(f"{type(exc).__name__}: {exc}") from None
    return _parse(raw)


async def _exchange(host: str, port: int, request: bytes, tls: ssl.SSLContext | None) -> bytes:
    reader, writer = await asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls else None)
    try:
        writer.write(request)
        chunks, size = [], 0
        while chunk := await reader.read(1 << 16):
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise NodeHTTPError(f"the answer is longer than {MAX_ANSWER_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()


def _parse(raw: bytes) -> Any:
    head, sep, body = raw.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if not sep or len(status_line) < 2 or not status_line[0].startswith(b"HTTP/") or not status_line[1].isdigit():
        raise NodeHTTPError(f"not an HTTP answer: {raw[:80]!r}")
    status = int(status_line[1])
    if status != 200:
        raise NodeHTTPError(f"HTTP {status}: {body[:200].decode(errors='replace').strip()}", status)
    try:
        return json.loads(body)
    except ValueError as exc:
        raise NodeHTTPError(f"the answer is not JSON ({exc})") from None
