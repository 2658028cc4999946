"""The admin API's pure ASGI middleware, outermost first: ``ObserveRequests`` (metrics),
``GuardErrors`` (a bug answers one line of JSON, not a traceback), ``BodyLimit`` (413 before
parsing).  Each runs on the serving loop, once per request.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import HTTPException, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import AdminMetrics

logger = logging.getLogger(__name__)


async def send_json(send: Send, code: int, detail: str, close: bool = False) -> None:
    """Answer ``{"detail": detail}`` with ``code``; ``close``: and end the connection after it."""
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _ResponseStarted:
    """Wraps ``send`` to note whether the response has begun and with which status."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status: int | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)


class ObserveRequests:
    """Counts each request by method, route template and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: AdminMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        noted = _ResponseStarted(send)
        try:
            await self.app(scope, receive, noted)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe(scope["method"], route, noted.status or 500, started)


class GuardErrors:
    """An exception that no handler turned into an answer is a bug: log it with its traceback
    (logger ``kvring.admin.middleware``) and answer 500 with one line of JSON.  It is not raised
    further, so the server does not print the traceback a second time."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        noted = _ResponseStarted(send)
        try:
            await self.app(scope, receive, noted)
        except Exception as exc:
            where = f"{scope['method']} {scope['path'][:200]!r}"  # a path may hold anything, even newlines
            logger.error("admin API bug while serving %s: %s: %s", where, type(exc).__name__, exc, exc_info=exc)
            if noted.status is None:
                await send_json(send, status.HTTP_500_INTERNAL_SERVER_ERROR,
                                f"internal error ({type(exc).__name__}) while serving {where}; the admin's "
                                "log has the details", close=True)


class BodyTooLarge(HTTPException):
    """A body passed the limit while it was read.  An ``HTTPException``, so FastAPI's body parsing
    passes it on as it is (it turns other errors into 400) and the app answers 413."""

    def __init__(self, detail: str) -> None:
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, detail, headers={"Connection": "close"})


class BodyLimit:
    """Refuses a request body over ``limit`` bytes with 413 before the app parses any of it.

    A declared ``Content-Length`` over the limit is answered at once: the app is not called and
    no byte of the body is read.  Any other body (chunked ones have no length) is counted as the
    app reads it, and the read that passes the limit raises ``BodyTooLarge``; the rest is never
    read.  A 413 says ``Connection: close``, so the server stops reading the connection there: a
    client that keeps sending is cut off rather than drained.
    """

    def __init__(self, app: ASGIApp, limit: int, limit_text: str) -> None:
        self.app = app
        self.limit = limit
        self.message = (f"the request body is larger than this admin API's limit of {limit_text}; send a smaller "
                        "one (a prefix lookup of a longer prompt: send the ids of its first tokens, whose cached "
                        "prefix is the same up to their length), or raise the admin's max_body_bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await send_json(send, status.HTTP_413_CONTENT_TOO_LARGE, self.message, close=True)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.message)
            return message

        noted = _ResponseStarted(send)
        try:
            await self.app(scope, counted_receive, noted)
        except BodyTooLarge:
            if noted.status is not None:
                raise
            await send_json(send, status.HTTP_413_CONTENT_TOO_LARGE, self.message, close=True)


def _content_length(scope: Scope) -> int | None:
    """The declared body length; ``None`` if there is none (the server has already refused a
    malformed one, so anything unreadable here is left to the counting)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
