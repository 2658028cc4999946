"""The admin API's endpoints.  State lives on ``app.state`` (set by ``create_app``), never in globals."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvring.common.errors import MembershipError, NoOwners
from kvring.common.hashing import chained_hashes
from kvring.common.protocol import MAX_KEY_BYTES
from kvring.common.types import LEFT_RING_STATES
from kvring.connector.keys import KeyScope, KVLayout, MMSpan, request_keys

from .auth import require_token
from .cluster import ClusterHandle, states_of
from .metrics import AdminMetrics
from .models import (
    ChunkView,
    ClusterInfo,
    ContractView,
    DrainView,
    FlushView,
    Health,
    LookupIn,
    LookupView,
    NodesView,
    NodeView,
    OwnersView,
)
from .settings import AdminSettings

router = APIRouter()
MUTATING = [Depends(require_token)]
MUTATING_RESPONSES = {401: {"description": "No or wrong bearer token; nothing was changed."},
                      403: {"description": "No admin token is configured, so mutating endpoints are off."}}


def cluster_of(request: Request) -> ClusterHandle:
    return request.app.state.cluster


def settings_of(request: Request) -> AdminSettings:
    return request.app.state.settings


async def _known_node(cluster: ClusterHandle, node_id: str):
    members, _ = await cluster.members()
    if node_id not in members:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            f"no node {node_id!r} in cluster {cluster.settings.etcd.cluster!r}; members: "
                            f"{', '.join(sorted(members)) or '(none)'}")
    return members


@router.get("/healthz", response_model=Health, tags=["health"])
async def healthz() -> Health:
    """The admin process is up (does not look at etcd or the nodes)."""
    return Health()


@router.get("/v1/cluster", response_model=ClusterInfo, tags=["cluster"])
async def cluster_info(cluster: ClusterHandle = Depends(cluster_of)) -> ClusterInfo:
    """The cluster's hashing contract, ring epoch and members by state (read from etcd now)."""
    members, revision = await cluster.members()
    contract = await cluster.etcd.read_contract()
    drains = await cluster.etcd.drain_requests()
    states: dict[str, int] = {}
    for rec in members.values():
        states[rec.state] = states.get(rec.state, 0) + 1
    return ClusterInfo(
        cluster=cluster.settings.etcd.cluster,
        etcd=list(cluster.settings.etcd.endpoints),
        contract=ContractView(**vars(contract)) if contract is not None else None,
        ring_epoch=cluster.ring_epoch(revision),
        etcd_revision=revision,
        nodes=len(members),
        nodes_on_ring=sum(1 for v in members.values() if v.state not in LEFT_RING_STATES),
        states=dict(sorted(states.items())),
        drain_requests=sorted(drains),
    )


@router.get("/v1/nodes", response_model=NodesView, tags=["nodes"])
async def nodes(cluster: ClusterHandle = Depends(cluster_of)) -> NodesView:
    """Every registered node with its state, capacity, usage and LOOKUP hit/miss counters.

    A node whose ``/stats`` does not answer is listed with state ``unreachable``."""
    members, _ = await cluster.members()
    return NodesView(nodes=await cluster.node_views(members))


@router.get("/v1/nodes/{node_id}", response_model=NodeView, tags=["nodes"], responses={404: {}})
async def node(node_id: str, cluster: ClusterHandle = Depends(cluster_of)) -> NodeView:
    """One node, as in ``/v1/nodes`` (with its drain progress while it drains)."""
    members = await _known_node(cluster, node_id)
    return (await cluster.node_views({node_id: members[node_id]}))[0]


@router.get("/v1/keys/{key_hex}/owners", response_model=OwnersView, tags=["keys"], responses={422: {}})
async def owners(key_hex: str, cluster: ClusterHandle = Depends(cluster_of)) -> OwnersView:
    """The nodes that own a chunk key on the current ring (primary first) and those that hold it."""
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"key {key_hex!r} is not hex; give the chunk key as hex digits (kvring keys are 16 "
                            "bytes = 32 hex digits)") from None
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"a key has 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    snap = await cluster.snapshot()
    if not snap.ring.nodes:
        raise NoOwners(f"no active node in cluster {cluster.settings.etcd.cluster!r}")
    held = (await cluster.holders(snap, [key]))[0]
    return OwnersView(key=key.hex(), owners=snap.ring.owners(key), held_by=held, ring_epoch=snap.epoch)


@router.post("/v1/lookup", response_model=LookupView, tags=["keys"], responses={422: {}})
async def lookup(body: LookupIn, cluster: ClusterHandle = Depends(cluster_of),
                 settings: AdminSettings = Depends(settings_of)) -> LookupView:
    """How many leading tokens of a prompt are cached, and where each chunk is.

    Keys are computed exactly as the connector computes them (``kvring.connector.keys``), owners
    come from the same ring, and a chunk counts towards the prefix when one of its owners holds
    it (where the connector's lookup looks), so a router sees what a vLLM instance would load.
    Nothing is leased.  The connector may load a few tokens less than ``matched_tokens``: it
    always recomputes the prompt's last token and loads whole vLLM blocks."""
    n = len(body.token_ids)
    if n > settings.max_lookup_tokens:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"{n} tokens exceed this admin's limit of {settings.max_lookup_tokens}")
    for span in body.mm_spans:
        if span.offset + span.length > n:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"mm span [{span.offset}, {span.offset + span.length}) ends past the prompt's "
                                f"{n} tokens")
    snap = await cluster.snapshot()
    chunk_size = snap.contract.chunk_size
    if body.layout is not None:
        layout = KVLayout(**body.layout.model_dump())
        if layout.chunk_size != chunk_size:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"layout.chunk_size is {layout.chunk_size} but the cluster's chunk size is "
                                f"{chunk_size}; keys computed with it would never match")
        scope = KeyScope(cache_salt=body.cache_salt or "", adapter=body.adapter, weights_epoch=body.weights_epoch)
        namespace = layout.namespace(scope)
        keys = request_keys(layout, body.token_ids, scope, [MMSpan(**s.model_dump()) for s in body.mm_spans])
    else:
        namespace = body.namespace
        keys = chained_hashes(namespace, body.token_ids, chunk_size)

    if keys and not snap.ring.nodes:
        raise NoOwners(f"no active node in cluster {cluster.settings.etcd.cluster!r}")
    held = await cluster.holders(snap, keys)
    owner_lists = snap.ring.owners_many(keys) if keys else []
    matched = 0
    for owners, holders in zip(owner_lists, held):
        if not set(owners) & set(holders):
            break
        matched += 1
    epoch = snap.epoch
    return LookupView(
        namespace=namespace, chunk_size=chunk_size, prompt_tokens=n, chunks_total=len(keys),
        matched_chunks=matched, matched_tokens=matched * chunk_size, ring_epoch=epoch,
        chunks=[ChunkView(index=i, key=k.hex(), tokens=(i * chunk_size, (i + 1) * chunk_size), in_prefix=i < matched,
                          owners=o, held_by=h) for i, (k, o, h) in enumerate(zip(keys, owner_lists, held))],
    )


@router.post("/v1/nodes/{node_id}/drain", response_model=DrainView, status_code=status.HTTP_202_ACCEPTED,
             tags=["nodes"], dependencies=MUTATING, responses={**MUTATING_RESPONSES, 404: {}})
async def drain(node_id: str, cluster: ClusterHandle = Depends(cluster_of)) -> DrainView:
    """Ask a node to leave the ring and hand every chunk to its new owners (through etcd).

    The node reports ``draining`` at once and ``drained`` when it holds nothing; follow it with
    ``GET /v1/nodes/{node_id}``.  With no other active node it keeps its chunks and stays
    ``draining`` (its drain progress says why)."""
    members = await _known_node(cluster, node_id)
    await cluster.etcd.request_drain(node_id)
    return DrainView(node_id=node_id, state=members[node_id].state, drain_requested=True,
                     message="drain requested: the node leaves the ring, hands its chunks to their new owners "
                             f"and then reports 'drained' (GET /v1/nodes/{node_id})")


@router.delete("/v1/nodes/{node_id}/drain", response_model=DrainView, tags=["nodes"], dependencies=MUTATING,
               responses={**MUTATING_RESPONSES, 404: {}})
async def cancel_drain(node_id: str, cluster: ClusterHandle = Depends(cluster_of)) -> DrainView:
    """Withdraw a drain request; a node still running goes back to ``active``."""
    members, _ = await cluster.members()
    pending = await cluster.etcd.drain_requests()
    if node_id not in members and node_id not in pending:
        await _known_node(cluster, node_id)  # raises the 404
    await cluster.etcd.cancel_drain(node_id)
    state = members[node_id].state if node_id in members else "absent"
    return DrainView(node_id=node_id, state=state, drain_requested=False,
                     message="drain request withdrawn; a running node returns to 'active'")


@router.delete("/v1/namespaces/{namespace:path}", response_model=FlushView, tags=["keys"], dependencies=MUTATING,
               responses={**MUTATING_RESPONSES, 422: {}, 502: {"model": FlushView,
                                                              "description": "Some nodes did not confirm."}})
async def flush(namespace: str, cluster: ClusterHandle = Depends(cluster_of)):
    """Delete every chunk of a namespace on every node (e.g. ``kvring/v1/<hex>``, as the
    connector's ``KVLayout.namespace(scope)`` gives it).  Chunks stored without a
    namespace are never touched, and an empty namespace is refused."""
    if not namespace:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            "refusing to flush an empty namespace: it would mean every chunk stored without one; "
                            "give the namespace, e.g. DELETE /v1/namespaces/kvring/v1/<hex>")
    per_node = await cluster.flush(await cluster.snapshot(), namespace)
    done = {n: r for n, r in per_node.items() if isinstance(r, int)}
    failed = {n: r for n, r in per_node.items() if isinstance(r, str)}
    view = FlushView(namespace=namespace, deleted=sum(done.values()), nodes=done, failed=failed)
    return JSONResponse(view.model_dump(), status_code=status.HTTP_502_BAD_GATEWAY if failed else status.HTTP_200_OK)


@router.get("/metrics", tags=["health"], response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format."}})
async def metrics(request: Request, cluster: ClusterHandle = Depends(cluster_of)) -> Response:
    """Prometheus metrics: the admin's requests, and cluster gauges read from etcd and the nodes now."""
    m: AdminMetrics = request.app.state.metrics
    try:
        members, revision = await cluster.members()
        views = await cluster.node_views(members)
        m.set_cluster(views, states_of(views), cluster.ring_epoch(revision))
    except MembershipError:
        m.set_etcd_down()
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
