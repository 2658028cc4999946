"""The connector's settings, read once from ``kv_connector_extra_config`` and ``KVRING_*``.

Precedence: an explicit ``kv_connector_extra_config`` entry wins over the environment, which
wins over the default.  Bad values raise ``ValueError`` naming the setting and what to set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

LOAD_MODES = ("layerwise", "bulk", "async")
ADAPTER_IDENTITIES = ("content", "name")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings of one KVRingConnector (both roles read the same)."""

    # etcd endpoints of the cluster, "host:port[,host:port]" (what `kvring up` prints).
    etcd: str
    # Cluster name: the key prefix in etcd.
    cluster: str = "default"
    # Directory of the cluster's credentials (ca.crt, tls.crt, tls.key), for a cluster whose
    # nodes require TLS ("": plain TCP).  `kvring up` prints it; on Kubernetes the chart mounts it.
    tls_dir: str = ""
    # layerwise: load layer l+1.. while layer l computes; bulk: load all layers before the forward;
    # async: load between steps while the request waits (a slow load delays that request only).
    load_mode: str = "layerwise"
    # Also save a prompt's last, partial chunk (LMCache's save_unfull_chunk).  It is keyed by its
    # exact tokens, so it only hits for a prompt that ends where the stored one ended (a repeat).
    save_unfull_chunk: bool = False
    # Also save the whole chunks that decoding fills (prompt + generated tokens), so a follow-up
    # turn that carries the answer in its prompt loads it too.
    save_decode_cache: bool = False
    # How long vLLM's start waits for the cluster (etcd and its contract), in milliseconds;
    # past it vLLM serves without it (every request recomputes) until it is reached.
    attach_wait_ms: float = 10_000.0
    # Seconds to wait for a node before its chunks count as failed (then recomputed).
    timeout: float = 5.0
    # How long a lookup protects the chunks it found from eviction, in milliseconds.
    lookup_lease_ms: int = 30_000
    # A request whose lookup has not answered this many milliseconds after it arrived is a miss
    # (recomputed): a hung or slow node delays the requests whose chunks it owns by at most this.
    lookup_deadline_ms: float = 250.0
    # The scheduler may wait this long per step, in total, for lookups already in flight, so a
    # request is not put off a whole step for a lookup that answers in a millisecond (0: never).
    lookup_wait_ms: float = 2.0
    # Abandon a load (its blocks recompute) after this many milliseconds; 0 = twice the predicted
    # recompute time, within [200 ms, timeout] for async, [1 s, timeout] for layerwise and bulk.
    load_deadline_ms: float = 0.0
    # A chunk a lookup finds with its anchor (the part that names its blocks to the pool's KV
    # events) but without another part a load needs is checked again this many milliseconds
    # later; if no owner holds that part, its anchor is deleted, so routers stop being told the
    # pool holds it (0: never).
    withdraw_broken_after_ms: float = 5000.0
    # Do not start a load that is predicted to take longer than recomputing its tokens (from
    # the load bandwidth and the prefill speed this instance measured).
    load_admission: bool = True
    # How a LoRA adapter is named in chunk keys: "content" (a digest of its files) or "name"
    # (its lora_name; give each version of an adapter its own name).
    adapter_identity: str = "content"
    # Your name for the model's weights (checkpoint step, revision), folded into every key:
    # instances serving other weights under the same model name never share chunks.
    weights_version: str = ""
    # MiB of receive memory the worker maps when it starts: loads are read into it and it is
    # reused from load to load, so not even the first load pays the page faults of fresh memory
    # (a streamed load cycles through about 64 MiB whatever its size; 0: map on demand).
    receive_buffer_mb: int = 64
    # Tokens per chunk; must equal the cluster's (None: take the cluster's).
    chunk_size: int | None = None
    # Append one JSON line per load (chunks, bytes, seconds) to this file ("": off);
    # `kvring bench e2e` reads it for the achieved load bandwidth.
    stats_path: str = ""

    def __post_init__(self) -> None:
        if not self.etcd:
            raise ValueError('KVRingConnector needs the cluster\'s etcd endpoints: set "etcd" in '
                             'kv_connector_extra_config or KVRING_ETCD (kvring up prints both)')
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {self.load_mode!r} "
                             "(kv_connector_extra_config 'load_mode' or KVRING_LOAD_MODE)")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {self.timeout} (KVRING_TIMEOUT)")
        if not 0 <= self.receive_buffer_mb <= 1 << 20:
            raise ValueError(f"receive_buffer_mb must be 0..{1 << 20} MiB, got {self.receive_buffer_mb} "
                             "(KVRING_RECEIVE_BUFFER_MB)")
        if self.lookup_lease_ms < 0:
            raise ValueError(f"lookup_lease_ms must be >= 0, got {self.lookup_lease_ms} (KVRING_LOOKUP_LEASE_MS)")
        for name in ("lookup_deadline_ms", "lookup_wait_ms", "load_deadline_ms", "withdraw_broken_after_ms",
                     "attach_wait_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 milliseconds, got {getattr(self, name)} "
                                 f"(KVRING_{name.upper()})")
        if self.adapter_identity not in ADAPTER_IDENTITIES:
            raise ValueError(f"adapter_identity must be one of {ADAPTER_IDENTITIES}, got {self.adapter_identity!r} "
                             "(kv_connector_extra_config 'adapter_identity' or KVRING_ADAPTER_IDENTITY)")

    @classmethod
    def from_sources(cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> ConnectorConfig:
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            env = environ.get(f"KVRING_{name.upper()}")
            raw = extra.get(name, env)
            if raw is None:
                continue
            values[name] = _convert(name, raw, f.type)
        if "etcd" not in values:
            values["etcd"] = ""
        return cls(**values)


def _convert(name: str, raw: Any, type_name: str) -> Any:
    try:
        if type_name == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError
        if type_name in ("int", "int | None"):
            if isinstance(raw, bool):
                raise ValueError
            return int(raw)
        if type_name == "float":
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a {type_name}, got {raw!r} (kv_connector_extra_config "
                         f"'{name}' or KVRING_{name.upper()})") from None
