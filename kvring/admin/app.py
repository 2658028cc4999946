"""``create_app(settings)``: the cluster admin API (FastAPI; OpenAPI docs at ``/docs``).

Read endpoints (health, cluster, nodes, key owners, prefix lookup, metrics) are open; the
mutating ones (drain, flush) need the bearer token (``auth.py``).  Errors are JSON
``{"detail": ...}`` with a message that says what to do: 404 for an unknown node, 422 for a
bad key or body, 503 when etcd or the cluster cannot be reached.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import kvring
from kvring.common.errors import KVRingError, MembershipError, NodeUnavailable, NoOwners

from .cluster import ClusterHandle, NoContract
from .metrics import AdminMetrics
from .routes import router
from .settings import AdminSettings

logger = logging.getLogger(__name__)

DESCRIPTION = """\
The admin API of one kvring cluster: its contract and ring, its nodes, where a chunk or a
prompt's prefix is cached, and the operations that change it (drain a node, flush a
namespace), which need `Authorization: Bearer <token>`.
"""


class _ObserveRequests:
    """Pure ASGI middleware: counts each request by method, route template and status."""

    def __init__(self, app, metrics: AdminMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        code = 500

        async def send_and_note(message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe(scope["method"], route, code, started)


def _error(code: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=code)


def create_app(settings: AdminSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cluster = ClusterHandle(settings)
        app.state.cluster = cluster
        await cluster.start()
        try:
            yield
        finally:
            await cluster.close()

    app = FastAPI(title="kvring admin API", version=kvring.__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = AdminMetrics()
    app.add_middleware(_ObserveRequests, metrics=app.state.metrics)
    app.include_router(router)
    etcd = ",".join(settings.etcd.endpoints)

    @app.exception_handler(MembershipError)
    async def etcd_down(_: Request, exc: MembershipError) -> JSONResponse:
        return _error(503, f"etcd at {etcd} cannot be reached ({exc}); the cluster view needs it — check that "
                           "etcd runs and that --etcd points at it")

    @app.exception_handler(NoContract)
    async def no_contract(_: Request, exc: NoContract) -> JSONResponse:
        return _error(503, str(exc))

    @app.exception_handler(NoOwners)
    async def no_owners(_: Request, exc: NoOwners) -> JSONResponse:
        return _error(503, str(exc))

    @app.exception_handler(NodeUnavailable)
    async def node_down(_: Request, exc: NodeUnavailable) -> JSONResponse:
        return _error(503, f"a node did not answer: {exc}")

    @app.exception_handler(KVRingError)
    async def kvring_error(_: Request, exc: KVRingError) -> JSONResponse:
        logger.warning("admin request failed: %s", exc)
        return _error(502, f"the cluster answered with an error: {exc}")

    return app
