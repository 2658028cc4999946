"""The admin API's endpoints.  State lives on ``app.state`` (set by ``create_app``), never in globals.

Every handler runs on the serving loop.  Reads answer from the cached view (``cluster.view()``,
a memory read); lookups (``prefix.py``) and key owners ask the nodes through ``cluster.queries``
inside a bounded slot; the mutating endpoints read and write etcd through ``ClusterHandle`` (on
the view thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import msgspec
from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from kvring.common.errors import NoOwners
from kvring.common.protocol import MAX_KEY_BYTES
from kvring.common.records import NodeRecord
from kvring.common.ring import HashRing
from kvring.common.types import LEFT_RING_STATES

from . import prefix
from .auth import require_token
from .cluster import ClusterHandle, states_of
from .metrics import AdminMetrics
from .models import (
    ClusterInfo,
    ContractView,
    DrainView,
    FlushView,
    Health,
    LookupIn,
    LookupView,
    NodeDetail,
    NodesView,
    OwnersView,
    PoolEventsView,
)
from .settings import AdminSettings
from .view import ClusterView

router = APIRouter()
MUTATING = [Depends(require_token)]
MUTATING_RESPONSES = {401: {"description": "No or wrong bearer token; nothing was changed."},
                      403: {"description": "No admin token is configured, so mutating endpoints are off."}}


# The dependencies are coroutines so that FastAPI runs them inline: it runs a plain function on
# its thread pool, a hop per request that costs more than the read itself.
async def cluster_of(request: Request) -> ClusterHandle:
    return request.app.state.cluster


async def settings_of(request: Request) -> AdminSettings:
    return request.app.state.settings


def _unknown_node(node_id: str, members: Iterable[str], cluster: str) -> HTTPException:
    known = ", ".join(sorted(members)) or "(none)"
    return HTTPException(status.HTTP_404_NOT_FOUND, f"no node {node_id!r} in cluster {cluster!r}; members: {known}")


def _ring_of(view: ClusterView, cluster: str) -> HashRing:
    if view.ring is None or not view.ring.nodes:
        raise NoOwners(f"no active node in cluster {cluster!r}")
    return view.ring


def _answer(model: BaseModel) -> Response:
    """``model`` as JSON, serialized once by pydantic.  (Returned as a model, FastAPI would
    validate it again and serialize it in several passes: on the hot read endpoints that is most
    of a request's time.  ``response_model`` still documents the schema.)"""
    return Response(model.model_dump_json(), media_type="application/json")


@router.get("/healthz", response_model=Health, tags=["health"])
async def healthz() -> Response:
    """The admin process is up (does not look at etcd or the nodes)."""
    return _answer(Health())


@router.get("/v1/cluster", response_model=ClusterInfo, tags=["cluster"], responses={503: {}})
async def cluster_info(cluster: ClusterHandle = Depends(cluster_of)) -> Response:
    """The cluster's hashing contract, ring epoch and members by state, from the cached view."""
    view, age = cluster.view()
    states: dict[str, int] = {}
    for rec in view.members.values():
        states[rec.state] = states.get(rec.state, 0) + 1
    return _answer(ClusterInfo(
        cluster=cluster.settings.etcd.cluster,
        etcd=list(cluster.settings.etcd.endpoints),
        contract=ContractView(**vars(view.contract)) if view.contract is not None else None,
        ring_epoch=view.ring_epoch,
        etcd_revision=view.revision,
        nodes=len(view.members),
        nodes_on_ring=sum(1 for v in view.members.values() if v.on_ring),
        states=dict(sorted(states.items())),
        drain_requests=sorted(view.drain_requests),
        rebalancing=sorted(n.node_id for n in view.nodes
                           if (n.repair or {}).get("moving") or n.state in LEFT_RING_STATES),
        pool_events=PoolEventsView(**msgspec.structs.asdict(view.pool_events)) if view.pool_events else None,
        view=age,
    ))


@router.get("/v1/nodes", response_model=NodesView, tags=["nodes"], responses={503: {}})
async def nodes(cluster: ClusterHandle = Depends(cluster_of)) -> Response:
    """Every registered node with its state, capacity, usage and LOOKUP hit/miss counters, from
    the cached view.

    A node whose ``/stats`` did not answer is listed with state ``unreachable``."""
    view, age = cluster.view()
    return _answer(NodesView(nodes=list(view.nodes), view=age))


@router.get("/v1/nodes/{node_id}", response_model=NodeDetail, tags=["nodes"], responses={404: {}, 503: {}})
async def node(node_id: str, cluster: ClusterHandle = Depends(cluster_of)) -> Response:
    """One node, as in ``/v1/nodes`` (with its drain progress while it drains)."""
    view, age = cluster.view()
    found = view.node(node_id)
    if found is None:
        raise _unknown_node(node_id, view.members, cluster.settings.etcd.cluster)
    return _answer(NodeDetail(**found.model_dump(), view=age))


@router.get("/v1/keys/{key_hex}/owners", response_model=OwnersView, tags=["keys"], responses={422: {}, 503: {}})
async def owners(key_hex: str, cluster: ClusterHandle = Depends(cluster_of)) -> Response:
    """The nodes that own a chunk key on the current ring (primary first) and those that hold it."""
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"key {key_hex[:80]!r} is not hex; give the chunk key as hex digits (kvring keys are "
                            "16 bytes = 32 hex digits)") from None
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"a key has 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    view, age = cluster.view()
    owners_ = _ring_of(view, cluster.settings.etcd.cluster).owners(key)
    async with cluster.queries.slot("key owners query"):
        held = (await cluster.queries.holders(view.members, [key], [owners_], what="key owners query"))[0]
    return _answer(OwnersView(key=key.hex(), owners=owners_, held_by=held, ring_epoch=view.ring_epoch, view=age))


@router.post("/v1/lookup", response_model=LookupView, tags=["keys"], responses={413: {}, 422: {}, 503: {}})
async def lookup(body: LookupIn, cluster: ClusterHandle = Depends(cluster_of),
                 settings: AdminSettings = Depends(settings_of)) -> Response:
    """How many leading tokens of a prompt are cached, and where each chunk is.

    Keys are computed exactly as the connector computes them (``kvring.connector.keys``), owners
    come from the same ring, and a chunk counts towards the prefix when each of its parts (one
    per KV head and pipeline stage) is held by one of its owners (where the connector's lookup
    looks), so a router sees what a vLLM instance would load.
    Nothing is leased.  The connector may load a few tokens less than ``matched_tokens``: it
    always recomputes the prompt's last token and loads whole vLLM blocks.

    The nodes are asked now (a bounded number of queries at a time; 503 past the admin's query
    timeout, or when the admin was started without the cluster's node token); the ring comes
    from the cached view."""
    view, age = cluster.view()
    chunk_size = cluster.contract(view).chunk_size
    prefix.check(body, settings, chunk_size)
    async with cluster.queries.slot("lookup"):
        args = (body, chunk_size, view.ring, cluster.settings.etcd.cluster)
        if len(body.token_ids) <= prefix.INLINE_KEY_TOKENS:
            keys = prefix.keys_and_owners(*args)
        else:
            keys = await asyncio.to_thread(prefix.keys_and_owners, *args)
        held = await cluster.queries.holders(view.members, keys.parts, keys.part_owners)
    matched, chunks = prefix.chunk_views(keys, held, chunk_size)
    return _answer(LookupView(
        namespace=keys.namespace, chunk_size=chunk_size, prompt_tokens=len(body.token_ids),
        chunks_total=len(keys.chunks),
        matched_chunks=matched, matched_tokens=matched * chunk_size, ring_epoch=view.ring_epoch, chunks=chunks,
        view=age,
    ))


async def _known_node(cluster: ClusterHandle, node_id: str) -> dict[str, NodeRecord]:
    """The members read from etcd now (a mutating endpoint must not act on a stale view); 404 if
    ``node_id`` is not one of them."""
    members = await cluster.members_now()
    if node_id not in members:
        raise _unknown_node(node_id, members, cluster.settings.etcd.cluster)
    return members


@router.post("/v1/nodes/{node_id}/drain", response_model=DrainView, status_code=status.HTTP_202_ACCEPTED,
             tags=["nodes"], dependencies=MUTATING, responses={**MUTATING_RESPONSES, 404: {}, 503: {}})
async def drain(node_id: str, cluster: ClusterHandle = Depends(cluster_of)) -> DrainView:
    """Ask a node to leave the ring and hand every chunk to its new owners (through etcd).

    The node reports ``draining`` at once and ``drained`` when it holds nothing; follow it with
    ``GET /v1/nodes/{node_id}``.  With no other active node it keeps its chunks and stays
    ``draining`` (its drain progress says why)."""
    members = await _known_node(cluster, node_id)
    await cluster.request_drain(node_id)
    return DrainView(node_id=node_id, state=members[node_id].state, drain_requested=True,
                     message="drain requested: the node leaves the ring, hands its chunks to their new owners "
                             f"and then reports 'drained' (GET /v1/nodes/{node_id})")


@router.delete("/v1/nodes/{node_id}/drain", response_model=DrainView, tags=["nodes"], dependencies=MUTATING,
               responses={**MUTATING_RESPONSES, 404: {}, 503: {}})
async def cancel_drain(node_id: str, cluster: ClusterHandle = Depends(cluster_of)) -> DrainView:
    """Withdraw a drain request; a node still running goes back to ``active``."""
    members = await cluster.members_now()
    if node_id not in members and node_id not in await cluster.drain_requests_now():
        raise _unknown_node(node_id, members, cluster.settings.etcd.cluster)
    await cluster.cancel_drain(node_id)
    state = members[node_id].state if node_id in members else "absent"
    return DrainView(node_id=node_id, state=state, drain_requested=False,
                     message="drain request withdrawn; a running node returns to 'active'")


@router.delete("/v1/namespaces/{namespace:path}", response_model=FlushView, tags=["keys"], dependencies=MUTATING,
               responses={**MUTATING_RESPONSES, 422: {}, 503: {}, 502: {"model": FlushView,
                                                                        "description": "Some nodes did not confirm."}})
async def flush(namespace: str, cluster: ClusterHandle = Depends(cluster_of)):
    """Delete every chunk of a namespace on every node (e.g. ``kvring/v1/<hex>``, as the
    connector's ``KVLayout.namespace(scope)`` gives it).  Chunks stored without a
    namespace are never touched, and an empty namespace is refused."""
    if not namespace:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            "refusing to flush an empty namespace: it would mean every chunk stored without one; "
                            "give the namespace, e.g. DELETE /v1/namespaces/kvring/v1/<hex>")
    members = await cluster.members_now()
    async with cluster.queries.slot("flush"):
        per_node = await cluster.queries.flush(members, namespace)
    done = {n: r for n, r in per_node.items() if isinstance(r, int)}
    failed = {n: r for n, r in per_node.items() if isinstance(r, str)}
    view = FlushView(namespace=namespace, deleted=sum(done.values()), nodes=done, failed=failed)
    return JSONResponse(view.model_dump(), status_code=status.HTTP_502_BAD_GATEWAY if failed else status.HTTP_200_OK)


@router.get("/metrics", tags=["health"], response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format."}})
async def metrics(request: Request, cluster: ClusterHandle = Depends(cluster_of)) -> Response:
    """Prometheus metrics: the admin's requests, and cluster gauges from the cached view (with its age)."""
    m: AdminMetrics = request.app.state.metrics
    status_ = cluster.refresher.status
    if status_.view is None:
        m.set_no_view()
    else:
        fresh = cluster.refresher.freshness(status_)
        view = status_.view
        m.set_cluster(list(view.nodes), states_of(view.nodes), view.ring_epoch, etcd_up=status_.error is None,
                      age_s=fresh.age_s)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
