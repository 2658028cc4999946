"""`kvring bench disk`, part 4: time to first token of B when its chunks come from disk.

The demo's set-up (``demo.py``): a local 3-node cluster, here with a disk tier per node, and
separate vLLM instances (real CPU engines, each its own process) on a random Llama.  Instance A
computes one prompt and saves its chunks.  Instance B (vLLM's own prefix caching off, so every
hit comes from kvring), after a warm-up prompt of its own, runs ``repetitions`` rounds of:

1. gets the prompt while the chunks are in the nodes' memory (``B from memory``);
2. waits while every node is restarted in turn (SIGTERM: memory emptied, disk kept; the node
   writes what it still had queued before it stops), the nodes' segment files are dropped from
   the page cache, then gets the prompt again: every chunk comes from disk (``B from disk``;
   the nodes' ``disk.reads`` counters say how many chunks were read; a round's "from memory"
   after the first finds the chunks the disk load promoted);
3. recomputes the prompt under a cache salt of its own (nothing can load): the recompute
   baseline in the very same engine.

Every greedy token of B (from memory, from disk) and of A is compared with the recompute's.
The model runs in float32, as the demo does (in bfloat16 the different shapes of the same
computation round differently enough to flip a random model's near ties).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvring.bench.disk_io import drop_page_cache
from kvring.bench.report import summary
from kvring.local.cluster import LocalCluster

MAX_TOKENS = 8


def _disk_reads(client) -> int:
    return sum(s["disk"]["reads"] for s in client.stats().values() if s.get("disk"))


def measure_ttft(tmp: Path, tokens: int, layers: int, hidden: int, memory: int, disk: int, repetitions: int,
                 step: Callable[[str], None]) -> dict:
    import numpy as np

    from kvring.cachenode.client import ClusterClient
    from kvring.engine.run import run_instance, start_instance, write_tiny_llama

    step("writing a random Llama (no download)")
    model = str(write_tiny_llama(tmp / "model", layers=layers, hidden=hidden, heads=8, kv_heads=4, vocab=32000,
                                 head_dim=128))
    prompt = np.random.default_rng(11).integers(10, 30000, size=tokens).tolist()
    marks = {f"{what}-{r}": tmp / f"b-{what}-{r}" for r in range(repetitions) for what in ("memory", "restarted", "disk")}
    b_steps: list[dict] = [{"tokens": list(range(100, 356)), "salt": "warm-up"}]
    for r in range(repetitions):
        b_steps += [{"tokens": prompt}, {"touch": str(marks[f"memory-{r}"])},
                    {"wait_for": str(marks[f"restarted-{r}"]), "timeout": 900},
                    {"tokens": prompt}, {"touch": str(marks[f"disk-{r}"])},
                    {"tokens": prompt, "salt": f"recompute-{r}"}]
    step("starting etcd and 3 cache nodes with a disk tier each")
    reads = {"memory": [], "disk": []}
    in_memory = []
    with LocalCluster(nodes=3, memory=memory, cluster="bench-disk-ttft", disk=disk) as cluster, \
            ClusterClient(cluster.etcd, cluster=cluster.cluster) as client:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_mode": "layerwise"}
        spec = {"model": model, "connector": conn, "max_tokens": MAX_TOKENS, "dtype": "float32",
                "max_model_len": max(8192, tokens + 64)}
        step("instance A: computing the prompt, saving it to kvring")
        a = run_instance(tmp, "A", {**spec, "prompts": [{"tokens": prompt}]})
        step(f"instance B: warm-up, then {repetitions} rounds: from memory, every node restarted, from disk, "
             "recomputed")
        b = start_instance(tmp, "B", {**spec, "prompts": b_steps})
        try:
            last = _disk_reads(client)
            for r in range(repetitions):
                b.wait_file(marks[f"memory-{r}"], timeout=900)
                now = _disk_reads(client)
                reads["memory"].append(now - last)
                for i in range(len(cluster.nodes)):  # SIGTERM: what is queued is written first
                    cluster.restart(i, timeout=120)
                if not client.wait_for_nodes(3, timeout=30, exact=True):
                    raise RuntimeError("the restarted nodes did not all rejoin the ring")
                in_memory.append(sum(s["chunks"] for s in client.stats().values()))
                for node in cluster.nodes:
                    drop_page_cache(node.disk_dir)
                last = _disk_reads(client)
                time.sleep(1.0)  # B's client sees the nodes back (it follows etcd) before it looks up
                marks[f"restarted-{r}"].touch()
                b.wait_file(marks[f"disk-{r}"], timeout=900)
                now = _disk_reads(client)
                reads["disk"].append(now - last)
                last = now
            out = b.result(timeout=900)
        finally:
            b.stop()
    res = out["results"][1:]  # after the warm-up: memory, disk, recompute per round
    rounds = [dict(zip(("memory", "disk", "recompute"), res[3 * r:3 * r + 3])) for r in range(repetitions)]
    a_run = a["results"][0]
    return {"tokens": tokens, "layers": layers, "hidden": hidden, "dtype": "float32", "max_tokens": MAX_TOKENS,
            "repetitions": repetitions, "a_ttft": a_run["ttft"],
            **{f"{k}_ttft": summary([x[k]["ttft"] for x in rounds]) for k in ("memory", "disk", "recompute")},
            "rounds": [{k: {"ttft": x[k]["ttft"], "loaded_tokens": x[k]["cached"],
                            "identical": x[k]["tokens"] == x["recompute"]["tokens"]} for k in x} for x in rounds],
            "chunks_read_from_disk": reads, "chunks_in_memory_after_restart": in_memory,
            "identical": {"A": a_run["tokens"] == rounds[0]["recompute"]["tokens"],
                          "B from memory": all(x["memory"]["tokens"] == x["recompute"]["tokens"] for x in rounds),
                          "B from disk": all(x["disk"]["tokens"] == x["recompute"]["tokens"] for x in rounds)}}
