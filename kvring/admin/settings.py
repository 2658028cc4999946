"""Settings of the admin API, built once in ``kvring admin``'s ``main`` and passed to ``create_app``."""

from __future__ import annotations

from dataclasses import dataclass

from kvring.membership.settings import EtcdSettings

MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class AdminSettings:
    """What the admin API serves and how.

    ``token`` guards the mutating endpoints (drain, flush): ``None`` disables them (they answer
    403 saying how to set one) — the API is never open by default.
    """

    etcd: EtcdSettings
    token: str | None = None
    # Seconds to wait for one node's admin port (its /stats, key queries, flushes); a node that
    # does not answer /stats in time is listed as unreachable.
    node_timeout: float = 2.0
    # Longest prompt a lookup accepts, in tokens (bounds the work one request can cause).
    max_lookup_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        if self.token is not None:
            if len(self.token) < MIN_TOKEN_CHARS:
                raise ValueError(f"the admin token must have at least {MIN_TOKEN_CHARS} characters; generate "
                                 "one with `openssl rand -hex 32` and pass it as KVRING_ADMIN_TOKEN")
            if not self.token.isascii() or not self.token.isprintable() or " " in self.token:
                raise ValueError("the admin token must be printable ASCII without spaces (it travels in an "
                                 "HTTP header)")
        if not self.node_timeout > 0:
            raise ValueError("node_timeout must be positive seconds")
        if self.max_lookup_tokens < 1:
            raise ValueError("max_lookup_tokens must be at least 1")
