"""The chart's Prometheus rules (charts/kvring/files/prometheus-rules.yaml), checked by the real
``promtool``: the file parses (``promtool check rules``), and every alert fires on the series of
``alerts_test.yaml`` that should fire it and stays quiet on the others (``promtool test rules``).

The rules may only read series kvring really exports: every metric name in an expression is
either recorded by the file itself or defined on the node's, admin API's, operator's or
connector's registry (built here, not grepped).  promtool comes with Debian's ``prometheus``
package, which ``scripts/setup.sh`` installs; without it these tests fail rather than skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kvring.admin.metrics import AdminMetrics
from kvring.cachenode.disk.identity import DiskIdentity
from kvring.cachenode.disk.tier import DiskConfig, DiskTier
from kvring.cachenode.metrics import NodeMetrics
from kvring.cachenode.policy import make_policy
from kvring.cachenode.repair import RepairProgress
from kvring.cachenode.store import ChunkStore
from kvring.common.tls import generate
from kvring.common.types import NodeState
from kvring.connector.stats import BY_REASON, COUNTERS
from kvring.operator.metrics import OperatorMetrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts/kvring/files/prometheus-rules.yaml"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")
# The alerts the chart promises (README "Monitoring"): a test below fails if one goes missing.
ALERTS = {"KVRingNodeUnhealthy", "KVRingNodeOutOfRing", "KVRingNodeUnreachable", "KVRingCacheClusterDegraded",
          "KVRingRepairNotSettling", "KVRingHitRateCollapsed", "KVRingEvictionsOutpacingPuts",
          "KVRingLookupsPastDeadline", "KVRingTLSRefusals", "KVRingChildrenKeptChanging", "KVRingDiskCorrupt",
          "KVRingCertificateExpiresSoon", "KVRingCredentialsReloadFailing"}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed: run scripts/setup.sh (it installs Debian's prometheus package, "
                    "which brings /usr/bin/promtool)")
    return found


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _alerts() -> dict[str, dict]:
    return {r["alert"]: r for r in _rules() if "alert" in r}


def test_promtool_accepts_the_rules(promtool):
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_promtool_unit_tests_fire_each_alert_where_they_should(promtool):
    done = subprocess.run([promtool, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_fails_a_rule_that_no_longer_fires(promtool, tmp_path):
    """The unit tests bite: the same tests against rules whose thresholds can never be met fail."""
    broken = re.sub(r"for: \d+m", "for: 10h", RULES.read_text())
    (tmp_path / "rules.yaml").write_text(broken)
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    tests["rule_files"] = [str(tmp_path / "rules.yaml")]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    done = subprocess.run([promtool, "test", "rules", str(tmp_path / "tests.yaml")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    for alert in ALERTS:
        assert f"alertname: {alert}," in done.stdout + done.stderr, f"{alert}'s test did not notice"


def test_every_alert_has_a_firing_and_a_quiet_case():
    assert set(_alerts()) == ALERTS
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        names = {s["series"] for s in case["input_series"]}
        for check in case.get("alert_rule_test", []):
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
            # Each firing check also holds series that must not fire (fewer alerts than series).
            if check["exp_alerts"]:
                assert len(check["exp_alerts"]) < len(names), case["name"]
    assert firing == ALERTS and quiet == ALERTS


def test_every_alert_tells_a_person_what_to_do():
    for name, rule in _alerts().items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"].strip(), name
        description = rule["annotations"]["description"]
        assert len(description) > 120, f"{name}: the description should say what to check and do"


_PROMQL_WORDS = {"by", "without", "and", "or", "unless", "offset", "on", "ignoring", "group_left", "group_right",
                 "bool"}


def _metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside label matchers, ranges and strings
    that are neither functions/aggregations (followed by "(") nor keywords nor numbers."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)  # label matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)  # grouping label lists
    expr = re.sub(r"\boffset\s+\w+", " ", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*(?=\s*(\()?)", expr):
        if m.group(1) or m.group(0) in _PROMQL_WORDS:
            continue
        names.add(m.group(0))
    return names


def _exported(registry) -> set[str]:
    names = set()
    for family in registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                    "summary": ("_count", "_sum")}.get(family.type, ("",))
        names.update(family.name + s for s in suffixes)
    return names


def kvring_series() -> set[str]:
    """Every series name the node, the admin API, the operator and the connector define."""
    node = NodeMetrics(ChunkStore(1 << 20, make_policy("lru")))
    node.watch_membership(lambda: NodeState.ACTIVE, lambda: True)
    node.watch_repair(RepairProgress())
    node.watch_disk(DiskTier(DiskConfig("unused", 16 << 20), DiskIdentity("c", "n", "{}"), take=bytearray),
                    rewritten=lambda: 0)
    with tempfile.TemporaryDirectory() as tls_dir:  # a TLS node's gauges, read from real credentials
        node.watch_credentials(generate(tls_dir, "c"), SimpleNamespace(tls_closed=0))
    connector = {f"vllm:kvring_{n}_total" for n in (*COUNTERS, *BY_REASON)}
    return _exported(node.registry) | _exported(AdminMetrics().registry) | _exported(OperatorMetrics().registry) | connector


def test_the_name_parser_finds_the_series_of_an_expression():
    assert _metric_names('sum by (namespace) (rate(a_total{op="x"}[5m] offset 15m)) / b > 0.5 * vllm:c_total '
                         'and on (pod) d') == {"a_total", "b", "vllm:c_total", "d"}


def test_rules_read_only_series_kvring_exports():
    exported = kvring_series()
    assert {"kvring_node_state", "kvring_node_registered", "kvring_node_repair_moving",
            "kvring_operator_cachecluster_condition", "vllm:kvring_lookups_past_deadline_total"} <= exported
    recorded = {r["record"] for r in _rules() if "record" in r}
    for rule in _rules():
        unknown = _metric_names(rule["expr"]) - exported - recorded
        assert not unknown, f"{rule.get('alert') or rule.get('record')} reads series nothing exports: {unknown}"
