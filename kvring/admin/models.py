"""Request and response bodies of the admin API (pydantic, so they appear in the OpenAPI docs)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvring.connector.parts import STATE

TokenId = Annotated[int, Field(ge=0, lt=2**32, description="A token id (hashed as uint32, as the connector does).")]


class Health(BaseModel):
    status: str = "ok"


class ViewAge(BaseModel):
    """How current the cached cluster view behind an answer is.

    The admin reads the cluster (etcd and each node's /stats) in the background every
    ``view_interval`` seconds and answers reads from the latest read."""

    as_of: datetime = Field(description="When the read this answer comes from began (UTC): all of it is newer.")
    age_s: float = Field(description="Seconds since then.")
    stale: bool = Field(description="True when the latest read failed (e.g. etcd is away) or the view has not "
                                    "been read again for longer than expected: this is the last view read.")
    stale_reason: str | None = Field(default=None, description="Why the view is stale.")


class ContractView(BaseModel):
    hash_algorithm: str
    chunk_size: int
    format_version: int
    vnodes: int
    replication: int


class PoolEventsView(BaseModel):
    """Where the pool's KV events are published as one stream: register it with a KV-aware router
    as one worker (vLLM's wire format; a new subscriber first gets the whole pool)."""

    events_addr: str = Field(description="ZMQ PUB endpoint of the pool stream.")
    replay_addr: str = Field(description="ZMQ ROUTER endpoint replaying its recent batches.")
    topic: str = ""


class ClusterInfo(BaseModel):
    cluster: str
    etcd: list[str]
    contract: ContractView | None = Field(description="None until the first node has recorded it.")
    ring_epoch: int = Field(description="etcd revision of the membership the admin's ring was built from.")
    etcd_revision: int = Field(description="etcd revision of the view's read.")
    nodes: int
    nodes_on_ring: int
    states: dict[str, int] = Field(description="Registered nodes per state.")
    drain_requests: list[str] = Field(description="Node ids with a pending drain request.")
    rebalancing: list[str] = Field(description="Nodes restoring copies their co-owners lack (after a node was lost "
                                               "or came back empty) or draining: chunks are moving.")
    pool_events: PoolEventsView | None = Field(default=None, description="The pool's KV events as one stream, "
                                               "when `kvring events` (or `kvring up`) publishes them.")
    view: ViewAge


class NodeView(BaseModel):
    node_id: str
    state: str = Field(description="The node's state (joining, active, draining, drained, unhealthy), or "
                                   "'unreachable' when "
                                   "it is registered but its /stats did not answer.")
    registered_state: str = Field(description="The state in the node's etcd record.")
    on_ring: bool
    data_addr: str
    admin_addr: str
    events_addr: str = Field(default="", description="ZMQ PUB endpoint of the node's KV events (vLLM's wire "
                                                     "format); empty if it publishes none.")
    events_replay_addr: str = Field(default="", description="ZMQ ROUTER endpoint replaying its recent KV-event "
                                                            "batches.")
    capacity: int = Field(description="Cache budget in bytes.")
    used: int | None = Field(description="Bytes stored (None if unreachable).")
    chunks: int | None
    hits: int | None = Field(description="Keys found by LOOKUPs.")
    misses: int | None = Field(description="Keys not found by LOOKUPs.")
    drain: dict[str, Any] | None = Field(default=None, description="Drain progress, as the node reports it.")
    repair: dict[str, Any] | None = Field(default=None, description="The node's current or last repair pass "
                                          "(copies restored to co-owners, chunks handed off), as it reports it.")
    kv_events: dict[str, Any] | None = Field(default=None, description="KV events published, dropped and "
                                             "replayed, as the node reports them.")
    error: str | None = Field(default=None, description="Why the node's stats could not be read.")


class NodeDetail(NodeView):
    view: ViewAge


class NodesView(BaseModel):
    nodes: list[NodeView]
    view: ViewAge


class OwnersView(BaseModel):
    key: str
    owners: list[str] = Field(description="Owners on the current ring, primary first.")
    held_by: list[str] = Field(description="Members that hold the key now (owners, or previous owners right "
                                           "after a ring change).")
    ring_epoch: int
    view: ViewAge = Field(description="The view the ring comes from (who holds the key is asked now).")


class LayoutIn(BaseModel):
    """The connector's ``KVLayout`` (``kvring.connector.keys``): what a chunk's bytes depend on."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    config_fingerprint: str
    kv_dtype: str
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_size: int = Field(ge=1)
    block_layout: str
    chunk_size: int = Field(ge=1)
    weights_version: str = ""
    latent: bool = Field(False, description="An MLA model: one latent of head_size per token and layer.")
    windows: list[int] = Field(default_factory=list, description=(
        "A sliding-window hybrid served with vLLM's hybrid KV-cache manager, or a model with recurrent state: "
        "each layer's window in tokens (0: full attention, -1: a recurrent-state layer), num_layers of them; "
        "empty for every other model."))
    state_format: str = Field("", description="A model with recurrent state: its state's format, as the "
                                              "connector's layout gives it; empty for every other model.")

    @model_validator(mode="after")
    def _windows_per_layer(self) -> LayoutIn:
        if self.windows and (len(self.windows) != self.num_layers or min(self.windows) < STATE):
            raise ValueError(f"windows needs one window >= 0 (or -1: recurrent state) per layer ({self.num_layers}), "
                             f"got {len(self.windows)}")
        if (STATE in self.windows) != bool(self.state_format):
            raise ValueError("a layout with recurrent-state layers (window -1) gives its 'state_format', and only it")
        return self


class MMSpanIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    offset: int = Field(ge=0)
    length: int = Field(ge=1)
    item_hash: str = Field(min_length=1)


class LookupIn(BaseModel):
    """A prompt to look up: its token ids and what its chunk keys are computed in.

    Give either ``layout`` (the connector's KV layout, plus ``cache_salt`` and any multimodal
    ``mm_spans``, the LoRA ``adapter`` identity and the ``weights_epoch``), or ``namespace``
    (``KVLayout.namespace(KeyScope(...))``, already computed).
    """

    model_config = ConfigDict(extra="forbid")

    token_ids: list[TokenId]
    namespace: str | None = Field(default=None, min_length=1)
    layout: LayoutIn | None = None
    cache_salt: str | None = None
    adapter: str = Field(default="", description="The LoRA adapter's identity as the connector keys it "
                                                 "('content:<digest>' or 'name:<lora_name>'); empty for the "
                                                 "base model.")
    weights_epoch: int = Field(default=0, ge=0, description="The instance's weights epoch (reset_cache count).")
    mm_spans: list[MMSpanIn] = Field(default_factory=list)
    num_kv_heads: int | None = Field(default=None, ge=1, le=4096,
                                     description="With 'namespace': the model's KV heads (a chunk is stored as "
                                                 "one part per head); with 'layout' it comes from the layout.")
    num_layers: int | None = Field(default=None, ge=1, le=4096,
                                   description="With 'namespace': the model's layers; with 'layout' it comes "
                                               "from the layout.")
    stages: list[tuple[int, int]] | None = Field(
        default=None, max_length=256, description="The layer range [first, end) of each pipeline stage of the "
                                                  "instance, as vLLM splits them; default: one stage.")
    state_shards: int = Field(default=1, ge=1, le=4096,
                              description="A model with recurrent state: the slices its state is stored in (the "
                                          "instance's tensor-parallel size; 1 where every rank holds it whole).")

    @model_validator(mode="after")
    def _one_namespace_source(self) -> LookupIn:
        if (self.namespace is None) == (self.layout is None):
            raise ValueError("give exactly one of 'namespace' (a computed namespace string) or 'layout' (the "
                             "connector's KV layout fields)")
        if self.namespace is not None and (self.cache_salt is not None or self.mm_spans):
            raise ValueError("'cache_salt' and 'mm_spans' go with 'layout'; a given 'namespace' already has the "
                             "salt folded in, and multimodal keys need the layout")
        if self.namespace is not None and (self.num_kv_heads is None or self.num_layers is None):
            raise ValueError("with 'namespace', give 'num_kv_heads' and 'num_layers' too: a chunk is stored as "
                             "one part per KV head, and its part keys need them")
        if self.layout is not None and (self.num_kv_heads is not None or self.num_layers is not None):
            raise ValueError("'num_kv_heads' and 'num_layers' go with 'namespace'; 'layout' has its own")
        layers = self.layout.num_layers if self.layout is not None else self.num_layers
        if self.stages is not None:
            expected = 0
            for first, end in self.stages:
                if first != expected or end <= first:
                    break
                expected = end
            else:
                if expected == layers:
                    return self
            raise ValueError(f"'stages' must cut layers [0, {layers}) into consecutive non-empty ranges, got "
                             f"{self.stages}")
        return self


class ChunkView(BaseModel):
    index: int
    key: str = Field(description="The chunk key, hex.")
    tokens: tuple[int, int] = Field(description="Token range [start, end) of the prompt.")
    in_prefix: bool = Field(description="Part of the cached prefix (every chunk before it is cached too).")
    owners: list[str] = Field(description="Owners of its parts on the current ring.")
    held_by: list[str] = Field(description="Members that hold one of its parts now (empty: not cached).")
    parts: int = Field(description="Parts it is stored as: one per KV head and pipeline stage.")
    parts_held: int = Field(description="Of them, held by one of their owners now; cached only when all are.")


class LookupView(BaseModel):
    namespace: str
    chunk_size: int
    prompt_tokens: int
    chunks_total: int = Field(description="Whole chunks of the prompt (a partial last chunk is never cached).")
    matched_chunks: int = Field(description="Leading chunks cached: what the connector's lookup reports.")
    matched_tokens: int
    ring_epoch: int
    chunks: list[ChunkView]
    view: ViewAge = Field(description="The view the ring comes from (who holds each chunk is asked now).")


class DrainView(BaseModel):
    node_id: str
    state: str
    drain_requested: bool
    message: str


class FlushView(BaseModel):
    namespace: str
    deleted: int = Field(description="Chunk copies deleted across the cluster.")
    nodes: dict[str, int] = Field(description="Copies deleted per node.")
    failed: dict[str, str] = Field(description="Nodes that did not confirm, and why (flush again later).")
