"""Settings of the admin API, built once in ``kvring admin``'s ``main`` and passed to ``create_app``."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from kvring.common.nodetoken import NodeToken
from kvring.common.tls import ClusterCredentials
from kvring.common.units import format_size
from kvring.membership.settings import EtcdSettings

MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class AdminSettings:
    """What the admin API serves and how.

    ``token`` guards the mutating endpoints (drain, flush): ``None`` disables them (they answer
    403 saying how to set one) — the API is never open by default.

    ``node_token`` is the cluster's node token, a different credential: the admin sends it on its
    presence queries and flushes to the nodes' admin ports, which refuse them without it.  With
    ``None`` the endpoints that need those (lookup, key owners, flush) answer 503 saying so.

    ``tls``: the cluster's credentials, for nodes that serve their admin port over TLS (every
    node started with them); the admin then asks them over TLS and never in plain text.
    """

    etcd: EtcdSettings
    token: str | None = field(default=None, repr=False)
    node_token: NodeToken | None = None
    tls: ClusterCredentials | None = None
    # Seconds to wait for one node's admin port (its /stats, key queries, flushes); a node that
    # does not answer /stats in time is listed as unreachable.
    node_timeout: float = 2.0
    # Longest prompt a lookup accepts, in tokens (bounds the work one request can cause).
    max_lookup_tokens: int = 1 << 20
    # Largest request body, in bytes: a larger one is refused with 413 before any of it is
    # parsed (by its Content-Length, or by counting a chunked body as it arrives).  1 MiB of
    # JSON holds a lookup of roughly 100k token ids.
    max_body_bytes: int = 1 << 20
    # Seconds between two reads of the cluster view the read endpoints answer from (etcd's
    # members, contract and drain requests, and each node's /stats).
    view_interval: float = 1.0
    # Longest one read of the view may take; past it the read counts as failed and the last
    # view is kept, marked stale.
    view_timeout: float = 10.0
    # A view older than this is marked stale even while no read has failed yet.
    view_stale_after: float = 5.0
    # Queries that ask the nodes (lookups, key owners, flushes) running at once; more wait.
    max_concurrent_queries: int = 32
    # Longest such a query may take, waiting for its turn included; past it the answer is 503.
    query_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.token is not None:
            if len(self.token) < MIN_TOKEN_CHARS:
                raise ValueError(f"the admin token must have at least {MIN_TOKEN_CHARS} characters; generate "
                                 "one with `openssl rand -hex 32` and pass it as KVRING_ADMIN_TOKEN")
            if not self.token.isascii() or not self.token.isprintable() or " " in self.token:
                raise ValueError("the admin token must be printable ASCII without spaces (it travels in an "
                                 "HTTP header)")
        for name in ("node_timeout", "view_interval", "view_timeout", "view_stale_after", "query_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive seconds, got {getattr(self, name)!r}")
        if self.max_lookup_tokens < 1:
            raise ValueError("max_lookup_tokens must be at least 1")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024 (1 KiB), got {self.max_body_bytes}")
        if self.max_concurrent_queries < 1:
            raise ValueError("max_concurrent_queries must be at least 1")
        if self.query_timeout <= self.node_timeout:
            raise ValueError(f"query_timeout ({self.query_timeout}s) must exceed node_timeout ({self.node_timeout}s), "
                             "so that one slow node counts as not holding a key instead of failing every query")
        if self.view_timeout <= self.node_timeout:
            raise ValueError(f"view_timeout ({self.view_timeout}s) must exceed node_timeout ({self.node_timeout}s), "
                             "so that one slow node is listed as unreachable instead of failing every view read")

    @property
    def body_limit_text(self) -> str:
        """The body limit for people: ``1 MiB (1048576 bytes)``."""
        return f"{format_size(self.max_body_bytes)} ({self.max_body_bytes} bytes)"

    @property
    def node_tls(self) -> ssl.SSLContext | None:
        """The client context for the nodes' admin ports (the credentials as they are now), or None
        without ``tls``."""
        return self.tls.client_context() if self.tls is not None else None
