"""Where a cluster's membership lives: etcd endpoints, the cluster's name and key prefix.

Layout under ``<prefix>/<cluster>/`` (default prefix ``/kvring``): ``contract``, ``nodes/<id>``,
``drain/<id>``, ``restart/<id>``, ``repair/<id>`` (see ``kvring.membership.etcd``).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "/kvring"


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: tuple[str, ...]  # "host:port"
    cluster: str = "default"
    prefix: str = DEFAULT_PREFIX
    timeout: float = 2.0

    @classmethod
    def parse(cls, endpoints: str | list[str] | tuple[str, ...], **kw) -> EtcdSettings:
        items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        cleaned = []
        for item in items:
            item = item.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
            host, sep, port = item.rpartition(":")
            if not sep or not port.isdigit() or not host:
                raise ValueError(f"etcd endpoint {item!r} is not host:port (e.g. 127.0.0.1:2379)")
            cleaned.append(f"{host}:{port}")
        if not cleaned:
            raise ValueError("no etcd endpoint given; set --etcd host:port")
        return cls(endpoints=tuple(cleaned), **kw)

    @property
    def call_timeout(self) -> float:
        """The longest one etcd request or watch set-up may take (connecting: ``timeout``)."""
        return self.timeout * 2

    def key(self, *parts: str) -> bytes:
        return "/".join([self.prefix.rstrip("/"), self.cluster, *parts]).encode()

    @property
    def nodes_prefix(self) -> bytes:
        return self.key("nodes") + b"/"

    @property
    def drain_prefix(self) -> bytes:
        return self.key("drain") + b"/"

    @property
    def restart_prefix(self) -> bytes:
        return self.key("restart") + b"/"

    @property
    def repair_prefix(self) -> bytes:
        return self.key("repair") + b"/"


def check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not node_id or "/" in node_id:
        raise ValueError(f"node id {node_id!r} must be non-empty and contain no '/'")
    return node_id
