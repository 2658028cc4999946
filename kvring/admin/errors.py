"""How the admin API answers errors: always JSON ``{"detail": "<one line>"}`` that says what to
do, never a traceback.

- What the caller sent: 413 for a body over the limit (``middleware.BodyLimit``), 400 for a
  body that is not UTF-8 or cannot be parsed at all, 422 for invalid JSON or JSON of the wrong
  shape (the first few problems, each as ``where: what``), 404/405 for an unknown path or
  method, 401/403 for the token (``auth.py``).  The input itself is never echoed: it may be
  huge, binary, or hold values JSON cannot carry back (``1e400``).
- What the cluster cannot do now: 503 (no view yet, etcd away for a write, no node, a node or a
  query over its time, no node token for what asks the nodes; ``Retry-After`` where waiting
  helps), 502 when it answered an error.
- Anything else is a bug, answered 500 by ``middleware.GuardErrors``.

5xx answers are logged at WARNING on ``kvring.admin.errors`` (except "no view yet", which the
view refresher has already logged once), 4xx at DEBUG: a client sending junk cannot flood the log.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvring.common.errors import KVRingError, MembershipError, NodeUnavailable, NoOwners

from .cluster import NoContract
from .queries import Busy, NoNodeToken
from .settings import AdminSettings
from .view import NoView

logger = logging.getLogger(__name__)

MAX_DETAIL_CHARS = 1000
MAX_PROBLEMS = 5
# pydantic's error types for a body that is absent or not an object at all (not a wrong field).
NOT_AN_OBJECT = frozenset({"missing", "model_attributes_type", "model_type", "dict_type"})


def one_line(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` on one line (control characters become spaces), cut to ``limit`` characters."""
    flat = "".join(c if c.isprintable() else " " for c in text[:limit + 1])
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def error(code: int, detail: str, headers: dict[str, str] | None = None, logged: bool = True) -> JSONResponse:
    """The answer ``{"detail": detail}`` (on one line), logged: 5xx at WARNING unless ``logged``
    is False (the cause was logged already), 4xx at DEBUG."""
    line = one_line(detail)
    logger.log(logging.WARNING if code >= 500 and logged else logging.DEBUG, "answered %d: %s", code, line)
    return JSONResponse({"detail": line}, status_code=code, headers=headers)


def validation_message(problems: Sequence[dict[str, Any]]) -> str:
    """pydantic's problems as one line: ``where: what; ...`` without the input values."""
    for p in problems:
        if p.get("type") == "json_invalid":
            loc = p.get("loc", ())
            at = f" at character {loc[-1]}" if len(loc) > 1 else ""
            reason = (p.get("ctx") or {}).get("error", "malformed")
            return (f"the request body is not valid JSON ({reason}{at}); send a JSON object with "
                    "Content-Type: application/json")
    whole = [p.get("type") for p in problems if tuple(p.get("loc", ())) == ("body",)]
    if whole and whole[0] in NOT_AN_OBJECT:
        what = "is missing" if whole[0] == "missing" else "is not a JSON object"
        return f"the request body {what}; send a JSON object with Content-Type: application/json (schemas at /docs)"
    parts = []
    for p in problems[:MAX_PROBLEMS]:
        where = ".".join(str(part) for part in p.get("loc", ())[1:]) or "body"
        parts.append(f"{where}: {one_line(str(p.get('msg', 'invalid')), 200)}")
    more = f" (and {len(problems) - MAX_PROBLEMS} more)" if len(problems) > MAX_PROBLEMS else ""
    return "invalid request: " + "; ".join(parts) + more + " (the schemas are at /docs)"


def _http_detail(request: Request, exc: HTTPException) -> str:
    cause = exc.__cause__
    if exc.status_code == status.HTTP_400_BAD_REQUEST and isinstance(cause, UnicodeDecodeError):
        return f"the request body is not UTF-8 ({cause.reason} at byte {cause.start}); send JSON encoded as UTF-8"
    if exc.status_code == status.HTTP_400_BAD_REQUEST and cause is not None:
        return (f"the request body could not be parsed ({type(cause).__name__}: {cause}); send a JSON object "
                "with Content-Type: application/json")
    if exc.status_code == status.HTTP_404_NOT_FOUND and exc.detail == "Not Found":
        return f"no endpoint {request.method} {request.url.path}; the endpoints are listed at /docs"
    if exc.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
        return f"{request.method} is not allowed on {request.url.path}; the endpoints are listed at /docs"
    return str(exc.detail)


def install_error_handlers(app: FastAPI, settings: AdminSettings) -> None:
    etcd = ",".join(settings.etcd.endpoints)
    retry = {"Retry-After": "1"}

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, _http_detail(request, exc), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(status.HTTP_422_UNPROCESSABLE_CONTENT, validation_message(exc.errors()))

    @app.exception_handler(NoView)
    async def no_view(_: Request, exc: NoView) -> JSONResponse:
        return error(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc), retry, logged=False)  # the view logs why

    @app.exception_handler(Busy)
    async def busy(_: Request, exc: Busy) -> JSONResponse:
        return error(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc), retry)

    @app.exception_handler(NoNodeToken)
    async def no_node_token(_: Request, exc: NoNodeToken) -> JSONResponse:
        return error(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc), logged=False)  # `kvring admin` warned at start

    @app.exception_handler(MembershipError)
    async def etcd_down(_: Request, exc: MembershipError) -> JSONResponse:
        return error(status.HTTP_503_SERVICE_UNAVAILABLE,
                     f"etcd at {etcd} cannot be reached ({exc}); this endpoint needs it — check that etcd runs and "
                     "that --etcd points at it", retry)

    @app.exception_handler(NoContract)
    async def no_contract(_: Request, exc: NoContract) -> JSONResponse:
        return error(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc))

    @app.exception_handler(NoOwners)
    async def no_owners(_: Request, exc: NoOwners) -> JSONResponse:
        return error(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc))

    @app.exception_handler(NodeUnavailable)
    async def node_down(_: Request, exc: NodeUnavailable) -> JSONResponse:
        return error(status.HTTP_503_SERVICE_UNAVAILABLE, f"a node did not answer: {exc}", retry)

    @app.exception_handler(KVRingError)
    async def kvring_error(_: Request, exc: KVRingError) -> JSONResponse:
        return error(status.HTTP_502_BAD_GATEWAY, f"the cluster answered with an error: {exc}")
