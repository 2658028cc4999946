"""A short workload that shows the data plane at work: prompts with shared prefixes are
chunked and hashed, their (synthetic) KV chunks are placed on the ring, looked up by prefix,
and read back byte-identical — whole and layer by layer."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.common.hashing import chained_hashes
from kvring.common.tls import ClusterCredentials
from kvring.common.units import format_size

# A small Llama-like layout: 6 layers x (K, V) x 256 tokens x 4 KV heads x 64 head_dim, bf16.
LAYOUT = (6, 2, 256, 4, 64)


def _kv_for(key: bytes) -> np.ndarray:
    """Deterministic stand-in KV bytes for a chunk (bf16 carried as uint16)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 1 << 16, size=LAYOUT, dtype=np.uint16)


def demo_workload(etcd: str, cluster: str, echo: Callable[[str], None] = print,
                  tls: ClusterCredentials | None = None) -> bool:
    console = Console()
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, size=1024).tolist()  # a shared 4-chunk system prompt
    prompts = {
        "user A": system + rng.integers(0, 32000, size=768).tolist(),
        "user B": system + rng.integers(0, 32000, size=512).tolist(),
        "user A again": None,
    }
    prompts["user A again"] = prompts["user A"] + rng.integers(0, 32000, size=300).tolist()
    ok = True
    with ClusterClient(etcd, cluster=cluster, tls=tls) as client:
        client.wait_for_nodes(1)
        chunk_size = client.contract.chunk_size
        table = Table(title="prompts through kvring (chunk size %d tokens)" % chunk_size)
        for col in ("prompt", "tokens", "chunks", "cached before", "stored now", "read back", "owners"):
            table.add_column(col)
        for name, tokens in prompts.items():
            keys = chained_hashes("demo-model", tokens, chunk_size)
            hit = client.lookup_prefix(keys)
            new = keys[hit:]
            client.put_many([ChunkItem.of(k, _kv_for(k), LAYOUT, "bfloat16", chunk_size) for k in new])
            chunks = client.get(keys)
            layer3 = client.get(keys, layers=(3, 4))
            lb = _kv_for(keys[0])[3:4].nbytes
            good = all(c is not None and np.array_equal(c.data.view(np.uint16).reshape(LAYOUT), _kv_for(k))
                       and np.array_equal(l.data, _kv_for(k)[3:4].reshape(-1).view(np.uint8)[:lb])
                       for k, c, l in zip(keys, chunks, layer3))
            ok &= good
            owners = ",".join(client.owners(k)[0].removeprefix("node-") for k in keys)
            table.add_row(name, str(len(tokens)), str(len(keys)), f"{hit} chunks", f"{len(new)} chunks",
                          "identical" if good else "MISMATCH", f"nodes {owners}")
        console.print(table)
        stats = client.stats()
        for node_id, st in sorted(stats.items()):
            echo(f"  {node_id}: {st.get('chunks', '?')} chunks, {format_size(st.get('used', 0))} used, "
                 f"{st.get('hits', 0)} hits / {st.get('misses', 0)} misses")
    echo("workload: all chunks read back byte-identical" if ok else "workload: MISMATCH (see table)")
    return ok
