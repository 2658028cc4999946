"""``create_app(settings)``: the cluster admin API (FastAPI; OpenAPI docs at ``/docs`` and ``/redoc``,
served with their scripts and styles from the admin itself: no CDN).

Read endpoints (health, cluster, nodes, key owners, prefix lookup, metrics) are open; the
mutating ones (drain, flush) need the bearer token (``auth.py``).

Threads and tasks: uvicorn's event loop (the *serving loop*) runs the middleware and every
handler, and never waits on etcd or a node.  Cluster, node and metrics reads answer from the
cluster view that the view thread reads in the background (``view.py``); lookups and key
owners ask the nodes from the queries thread, a bounded number at a time (``queries.py``).
Bodies over ``max_body_bytes`` are refused before they are parsed, and every error is one line
of JSON (``middleware.py``, ``errors.py``).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

import kvring

from .cluster import ClusterHandle
from .errors import install_error_handlers
from .metrics import AdminMetrics
from .middleware import BodyLimit, GuardErrors, ObserveRequests
from .routes import router
from .settings import AdminSettings

logger = logging.getLogger(__name__)

DESCRIPTION = """\
The admin API of one kvring cluster: its contract and ring, its nodes, where a chunk or a
prompt's prefix is cached, and the operations that change it (drain a node, flush a
namespace), which need `Authorization: Bearer <token>`.

Reads answer from a view of the cluster that the admin reads in the background about once a
second; each answer says how old it is (`view.as_of`, `view.age_s`) and whether it is `stale`.
Request bodies over the admin's limit (1 MiB unless configured) are refused with 413.
"""


def create_app(settings: AdminSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cluster = ClusterHandle(settings)
        app.state.cluster = cluster
        await cluster.start()
        # What exists now (the imported modules, the app) lives as long as the process: keep it out
        # of the collector's full passes, which otherwise stall the serving loop ~100 ms under load.
        gc.freeze()
        try:
            yield
        finally:
            await cluster.close()

    # /docs (Swagger UI) and /redoc load their scripts and styles from the admin itself (the package
    # fastapi-offline ships them, under /static-offline-docs), never from a CDN: they work where the
    # admin has no internet.  validatorUrl None: Swagger UI does not send the schema to a validator.
    app = FastAPIOffline(title="kvring admin API", version=kvring.__version__, description=DESCRIPTION,
                         lifespan=lifespan, swagger_ui_parameters={"validatorUrl": None})
    app.state.settings = settings
    app.state.metrics = AdminMetrics()
    # add_middleware puts each one outside those added before: the last added runs first.
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, limit_text=settings.body_limit_text)
    app.add_middleware(GuardErrors)
    app.add_middleware(ObserveRequests, metrics=app.state.metrics)
    app.include_router(router)
    install_error_handlers(app, settings)
    return app
