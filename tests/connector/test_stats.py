"""The connector's counters as vLLM collects them: summed over workers and steps, refusals and
failed blocks by reason, and the loads' per-node transfers carried to admission (bounded)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvring.cachenode.client import Transfer
from kvring.connector.stats import MAX_TRANSFERS, Counters, KVRingPromMetrics, KVRingStats, transfers_of


def test_counts_by_reason_and_transfers_add_up_over_workers_and_steps():
    a, b = Counters(), Counters()
    a.by_reason("loads_refused", "slower")
    a.by_reason("loads_refused", "node_failing", 2)
    a.failed("missing", 3)
    a.transfers([Transfer("n1", 100, 0.1, 0.01, 0, True), Transfer("n2", 0, 5.0, 5.0, 0, False)])
    b.by_reason("loads_refused", "slower")
    b.transfers([Transfer("n1", 50, 0.05, 0.01, 0, True)])
    total = a.take().aggregate(b.take())
    assert total.data["loads_refused"] == {"slower": 2, "node_failing": 2}
    assert total.data["failed_blocks"] == {"missing": 3} and total.data["node_failures"] == 1
    assert [t.node_id for t in transfers_of(total.data)] == ["n1", "n2", "n1"]
    assert transfers_of(total.data)[1] == Transfer("n2", 0, 5.0, 5.0, 0, False)
    line = total.reduce()
    assert (line["kvring_loads_refused_slower"], line["kvring_loads_refused_node_failing"]) == (2, 2)
    assert a.take() is None  # taken: nothing left


def test_transfers_stay_bounded_however_long_nobody_collects_them():
    c = Counters()
    for i in range(3 * MAX_TRANSFERS):
        c.transfers([Transfer(f"n{i}", 1, 0.1, 0.0, 0, True)])
    kept = transfers_of(c.take().data)
    assert len(kept) == MAX_TRANSFERS and kept[-1].node_id == f"n{3 * MAX_TRANSFERS - 1}"  # the newest


def test_refusals_reach_prometheus_by_reason():
    registry = CollectorRegistry()

    def bound(cls):  # vLLM's metric classes, on a registry of the test's own
        return lambda *args, **kw: cls(*args, registry=registry, **kw)

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    prom = KVRingPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    stats = KVRingStats(data={"loads_admitted": 3, "loads_refused": {"node_failing": 2},
                              "transfers": [["n1", 1, 0.1, 0.0, 0, True]]})
    prom.observe(stats.data, 0)
    value = registry.get_sample_value
    assert value("vllm:kvring_loads_refused_total", {"engine": "0", "reason": "node_failing"}) == 2
    assert value("vllm:kvring_loads_refused_total", {"engine": "0", "reason": "slower"}) == 0
    assert value("vllm:kvring_loads_admitted_total", {"engine": "0"}) == 3
