"""The chart's Grafana dashboard against real series: every panel's query, evaluated by a real
Prometheus (Debian's ``prometheus``, started here) that scrapes a local cluster's nodes and a real
``vllm serve`` with the kvring connector under a short workload, returns data; and the workload's
events show in the panels meant to show them.

The workload (one vLLM server, a random tiny Llama, 3 nodes of 1.5 MiB each):

- 7 prompts of 1,100 tokens, each computed (saved: 8 chunk parts of 128 KiB) and sent again
  (loaded): hits, bytes loaded and saved, time to first token; the pool holds 4.5 MiB, so the
  later prompts evict the earlier ones' chunks;
- the last prompt's chunk part is corrupted on its node (``--fault-injection``) before it is sent
  again: failed blocks;
- every node is paused (SIGSTOP) while a new prompt is sent: its lookup passes the connector's
  deadline (the request recomputes);
- a fourth node joins: the others copy it the chunks it now owns (rebalancing).

Grafana's variables are substituted as Grafana would: ``$__rate_interval`` from the query step and
the scrape interval, ``$cachecluster`` by the cluster's name (the label the chart's PodMonitor
gives node series; the test's scrape targets carry the same labels).  With
``KVRING_DASHBOARD_PNG=docs/dashboard.png`` the test also writes the PNG the README shows.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from dashboard_plot import render
from faults import inject
from polling import wait_for
from prometheus_server import LocalPrometheus, rate_interval

from kvring.cachenode.client import ClusterClient
from kvring.common.contract import transfer_config
from kvring.engine.serve import VLLMServer, parse_metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "charts" / "kvring" / "files" / "grafana-dashboard.json"
NODE_MEMORY = 3 << 19  # 1.5 MiB: 7 prompts of 1 MiB each cannot all stay
PROMPTS = 7
PROMPT_TOKENS = 1100  # 4 whole chunks of 256 + 76
PARTS = 4 * 2  # chunk parts a prompt stores (2 KV heads)
LOADED = 4 * 256
# A lookup's deadline: the paused nodes' lookup passes it; a served one must not, on this VM's two
# cores shared by three TLS nodes, Prometheus and vLLM (at 500 ms one in a few runs did).
DEADLINE_MS = 1500.0
SCRAPE_S = 1.0
STEP_S = 1.0
PACE_S = 1.5  # between the workload's steps, so that each shows in the panels (4 s rate windows)
# Series that may stay at zero: nothing in the workload makes them move (no lookup fails outright,
# admission is off, repair's counts of a pass in progress are back at 0 once it is done, every
# node is in the ring).  Every other target must show a value above zero at some point.
ZERO_OK = {
    # Prefill avoided less load time: on this tiny model loading can cost more than computing.
    ("Time to first token saved per request (estimated)", "A"),
    ("Lookups past their deadline", "B"),
    ("Failed blocks by reason", "B"),
    ("Repair and rebalancing", "B"),
    ("Repair and rebalancing", "C"),
    ("Nodes by state", "B"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvring.engine.run import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


def _node_values(cluster, node) -> dict[str, float]:
    with urllib.request.urlopen(f"{node.admin_addr}/metrics", timeout=5, context=cluster.admin_tls) as r:
        return parse_metrics(r.read().decode())


def _stored_ever(cluster) -> float:
    """Chunk parts the nodes hold, plus those they evicted, plus the anchors deleted for chunks
    that lost a part to an eviction: every part ever stored (nothing else deletes here)."""
    return sum(v.get("kvring_node_chunks", 0) + v.get("kvring_node_evictions_total", 0)
               + v.get("kvring_node_anchor_anchors_deleted_total", 0)
               for v in (_node_values(cluster, n) for n in cluster.nodes))


def _keys(client: ClusterClient) -> set[tuple[str, bytes]]:
    return {(node, key) for node in client.members for key in client.list_keys(node)}


def _substitute(expr: str, cachecluster: str) -> str:
    """The query Grafana sends for a panel at ``STEP_S`` with the cluster selected."""
    expr = expr.replace("$__rate_interval", rate_interval(STEP_S, SCRAPE_S))
    expr = expr.replace("$cachecluster", cachecluster)
    assert "$" not in expr, f"a variable the test does not substitute: {expr}"
    return expr


def _finite(result: list[dict]) -> list[float]:
    return [float(v) for s in result for _, v in s["values"] if math.isfinite(float(v))]


def _workload(cluster, server: VLLMServer, prom: LocalPrometheus, events: list[tuple[float, str]]) -> None:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(10, 2000, size=PROMPT_TOKENS).tolist() for _ in range(PROMPTS)]
    with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls) as client:
        assert client.wait_for_nodes(3)
        for i, prompt in enumerate(prompts):
            last = i == len(prompts) - 1
            before = _keys(client) if last else set()
            computed = server.complete(prompt)
            wait_for(lambda i=i: _stored_ever(cluster) >= (i + 1) * PARTS, timeout=30,
                     what=f"prompt {i}'s chunk parts stored\n{server.log_tail()}")
            if last:  # corrupt one of its parts: that chunk's blocks fail to load
                node_id, key = sorted(_keys(client) - before)[0]
                assert inject(cluster, node_id, f"corrupt?key={key.hex()}") == 200  # a stored byte flipped
                events.append((time.time(), "a chunk part corrupted"))
            loaded = server.complete(prompt)
            assert loaded["tokens"] == computed["tokens"], f"prompt {i}\n{server.log_tail()}"
            if not last:
                assert loaded["cached"] == LOADED, f"prompt {i}: {loaded['cached']} tokens loaded\n{server.log_tail()}"
            time.sleep(PACE_S)
        assert sum(_node_values(cluster, n).get("kvring_node_evictions_total", 0) for n in cluster.nodes) > 0

        # Every node paused: a new prompt's lookup passes its deadline, the request recomputes.
        events.append((time.time(), "nodes paused"))
        for node in cluster.nodes:
            os.kill(node.pid, signal.SIGSTOP)
        try:
            paused = server.complete(rng.integers(10, 2000, size=PROMPT_TOKENS).tolist())
        finally:
            for node in cluster.nodes:
                os.kill(node.pid, signal.SIGCONT)
        assert paused["cached"] == 0, server.log_tail()
        time.sleep(PACE_S)

        # A node joins: the others copy it the chunks it now owns.
        joined = cluster.add_node()
        prom.add_target(joined.admin_addr, job="kvring-nodes", namespace="kvring", pod=joined.node_id,
                        cachecluster=cluster.cluster)
        events.append((time.time(), f"{joined.node_id} joins"))
        wait_for(lambda: prom.query(f'up{{pod="{joined.node_id}"}} == 1'), timeout=30,
                 what=f"Prometheus's first scrape of {joined.node_id}\n{prom.log_tail()}")
        wait_for(lambda: sum(_node_values(cluster, n).get("kvring_node_repair_copied_total", 0) for n in cluster.nodes),
                 timeout=30, what="repair copies to the joined node")
        time.sleep(PACE_S)


def test_every_dashboard_query_returns_data_in_a_real_prometheus(cluster_factory, model, tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] == "timeseries"]
    assert len(panels) == len([p for p in dashboard["panels"] if p["type"] != "row"]), "a panel this test cannot draw"
    # TLS, as `kvring up` and the operator run it: Prometheus scrapes the nodes over HTTPS.
    cluster = cluster_factory(nodes=3, memory=NODE_MEMORY, node_args=["--fault-injection"], tls=True)
    assert re.fullmatch(r"[\w-]+", cluster.cluster)  # substituted into a regex matcher as it is
    # Admission off: on this tiny model recomputing can be predicted faster than loading, and
    # every prompt sent twice should load.
    config = transfer_config(cluster.etcd, cluster.cluster, load_admission=False, lookup_deadline_ms=DEADLINE_MS,
                             timeout=2.0, tls_dir=str(cluster.tls.directory))
    server = VLLMServer(model, config, name="dashboard")
    prom = LocalPrometheus(scrape_s=SCRAPE_S, ca_file=str(cluster.tls.ca))
    events: list[tuple[float, str]] = []
    try:
        server.start(wait=False)
        for node in cluster.nodes:
            prom.add_target(node.admin_addr, job="kvring-nodes", namespace="kvring", pod=node.node_id,
                            cachecluster=cluster.cluster)
        prom.add_target(server.url, job="vllm", namespace="serving", pod="vllm-0")
        prom.start()
        server.wait_ready()
        start = time.time()
        _workload(cluster, server, prom, events)
        # Prometheus has scraped everything the workload did (the last events first of all).
        # The connector's estimate of the prefill its loads spared counts (it measured the prefill speed).
        for expr in ('sum(kvring_node_repair_copied_total) > 0', 'sum(vllm:kvring_failed_blocks_total) > 0',
                     'sum(vllm:kvring_lookups_past_deadline_total) > 0',
                     'sum(vllm:kvring_prefill_seconds_avoided_total) > 0'):
            wait_for(lambda expr=expr: prom.query(expr), timeout=15, what=f"{expr} in Prometheus\n{prom.log_tail()}")
        time.sleep(2 * SCRAPE_S)
        end = time.time()
        # Every target answered scrapes during the workload (a scrape may time out on a busy machine).
        scraped = {s["metric"]["pod"]: float(s["value"][1])
                   for s in prom.query(f"avg_over_time(up[{math.ceil(end - start)}s])", at=end)}
        assert set(scraped) == {"vllm-0", *(n.node_id for n in cluster.nodes)}, scraped
        assert min(scraped.values()) > 0.5, f"share of scrapes answered: {scraped}\n{prom.log_tail()}"

        # The dashboard's variable lists the cluster (label_values(kvring_node_capacity_bytes, cachecluster)).
        assert cluster.cluster in prom.api("label/cachecluster/values", **{"match[]": "kvring_node_capacity_bytes"})

        series: dict[tuple[int, str], list[dict]] = {}
        empty, flat = [], []
        for panel in panels:
            for target in panel["targets"]:
                result = prom.query_range(_substitute(target["expr"], cluster.cluster), start, end, STEP_S)
                series[panel["id"], target["refId"]] = result
                values = _finite(result)
                if not values:
                    empty.append(f"{panel['title']} [{target['refId']}]: {target['expr']}")
                elif (panel["title"], target["refId"]) not in ZERO_OK and max(values) <= 0:
                    flat.append(f"{panel['title']} [{target['refId']}]: {target['expr']}")
        assert not empty, "queries that returned no data:\n" + "\n".join(empty)
        assert not flat, "queries that stayed at zero through the workload meant to move them:\n" + "\n".join(flat)

        # The budget line is the nodes' --memory, one per node (the joined one included).
        (memory,) = [p for p in panels if p["title"] == "Memory used per node against its budget"]
        budgets = series[memory["id"], "B"]
        assert {s["metric"]["pod"] for s in budgets} == {n.node_id for n in cluster.nodes}
        assert {v for s in budgets for _, v in s["values"]} == {str(NODE_MEMORY)}
        # The failed blocks are the corrupt chunk's: by a reason, not by "error".
        (failed,) = [p for p in panels if p["title"] == "Failed blocks by reason"]
        reasons = {s["metric"]["reason"] for s in series[failed["id"], "A"] if any(v > 0 for v in _finite([s]))}
        assert reasons and reasons <= {"missing", "unusable"}, reasons

        png = tmp_path / "dashboard.png"
        outputs = [png] + ([Path(os.environ["KVRING_DASHBOARD_PNG"])] if os.environ.get("KVRING_DASHBOARD_PNG") else [])
        for path in outputs:
            path.parent.mkdir(parents=True, exist_ok=True)
            render(path, panels, series, start,
                   title=f"kvring dashboard, from a real Prometheus scraping 3 nodes (+1 joining) and vLLM with the "
                         f"connector ({PROMPTS} prompts computed and loaded, then the marked events)",
                   events=events)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        server.terminate()
        server.stop()
        prom.close()
