"""Status and conditions of a CacheCluster from observations: pure functions, plain data."""

from __future__ import annotations

import pytest
from crd_schema import schema_errors

from kvring.common.records import PoolEventsRecord
from kvring.operator import status as st
from kvring.operator.status import Condition, Member, Observation, ScaleInView

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
SELECTOR = "app.kubernetes.io/name=kvring,app.kubernetes.io/instance=c,app.kubernetes.io/component=cachenode"


def sts(replicas: int, ready: int, pods: int | None = None) -> dict:
    return {"spec": {"replicas": replicas}, "status": {"replicas": replicas if pods is None else pods,
                                                       "readyReplicas": ready}}


def active(*ids: str, state: str = "active") -> dict[str, Member]:
    return {i: Member(i, state, 64 << 20, f"http://{i}:8080") for i in ids}


def obs(**kw) -> Observation:
    base = dict(name="c", generation=3, desired=3, statefulset=sts(3, 3), members=active("c-0", "c-1", "c-2"),
                revision=100)
    return Observation(**{**base, **kw})


def conditions(o: Observation, previous: dict | None = None) -> dict[str, Condition]:
    nodes = st.node_summaries(o)
    return {c.type: c for c in st.observed_conditions(o, nodes, previous)}


# ---- merge_conditions ---------------------------------------------------------------------------

def test_new_conditions_get_the_current_time_and_generation():
    got = st.merge_conditions(None, [Condition("Ready", True, "AllNodesReady", "3 of 3")], 7, T0)
    assert got == [{"type": "Ready", "status": "True", "reason": "AllNodesReady", "message": "3 of 3",
                    "observedGeneration": 7, "lastTransitionTime": T0}]


def test_an_unchanged_status_keeps_its_transition_time_even_when_the_reason_changes():
    before = st.merge_conditions(None, [Condition("Ready", False, "Creating")], 1, T0)
    after = st.merge_conditions(before, [Condition("Ready", False, "PodsNotReady", "1 of 3")], 2, T1)
    assert after[0]["lastTransitionTime"] == T0
    assert after[0]["reason"] == "PodsNotReady" and after[0]["observedGeneration"] == 2


def test_a_changed_status_takes_the_new_time():
    before = st.merge_conditions(None, [Condition("Ready", False, "Creating")], 1, T0)
    after = st.merge_conditions(before, [Condition("Ready", True, "AllNodesReady")], 1, T1)
    assert after[0]["lastTransitionTime"] == T1 and after[0]["status"] == "True"


def test_other_types_are_kept_and_the_order_is_fixed():
    before = st.merge_conditions(None, [Condition("ConfigMismatch", True, "InvalidSpec", "x"),
                                        Condition("Ready", False, "InvalidSpec")], 1, T0)
    after = st.merge_conditions(before, [Condition("Degraded", None, "EtcdUnreachable")], 1, T1)
    assert [c["type"] for c in after] == ["Ready", "Degraded", "ConfigMismatch"]
    assert after[1]["status"] == "Unknown"
    assert after[2] == before[1]  # ConfigMismatch untouched


def test_an_unknown_condition_type_is_refused():
    with pytest.raises(ValueError, match="unknown condition type 'Happy'"):
        Condition("Happy", True, "Yes")


# ---- nodes and epoch --------------------------------------------------------------------------------

def test_nodes_list_expected_ordinals_and_extra_members_in_ordinal_order():
    members = {**active("c-0", "c-10"), **active("c-2", state="draining")}
    o = obs(statefulset=sts(11, 11), desired=11, members=members,
            stats={"c-0": {"used": 5, "capacity": 64 << 20}, "c-10": {"used": "junk"}})
    nodes = st.node_summaries(o)
    assert [n["id"] for n in nodes] == [f"c-{i}" for i in range(11)]
    assert nodes[0] == {"id": "c-0", "state": "active", "ready": True, "capacityBytes": 64 << 20, "usedBytes": 5}
    assert nodes[1] == {"id": "c-1", "state": "missing", "ready": False}
    assert nodes[2]["state"] == "draining" and not nodes[2]["ready"]
    assert "usedBytes" not in nodes[10]  # a malformed stat is left out, not reported


def test_a_member_outside_the_statefulset_is_listed_and_no_etcd_means_unknown():
    o = obs(statefulset=sts(2, 2), members=active("c-0", "c-1", "c-2"))
    assert [n["id"] for n in st.node_summaries(o)] == ["c-0", "c-1", "c-2"]
    down = st.node_summaries(obs(members=None))
    assert {n["state"] for n in down} == {"unknown"} and not any(n["ready"] for n in down)


def test_epoch_follows_membership_changes_only():
    o = obs()
    first = st.build_status(o, None, selector=SELECTOR, connector="{}", now=T0)
    assert first["epoch"] == 100
    same = st.build_status(obs(revision=250), first, selector=SELECTOR, connector="{}", now=T1)
    assert same["epoch"] == 100  # other writes to etcd move the revision, not the ring
    changed = st.build_status(obs(revision=300, members=active("c-0", "c-1")), same, selector=SELECTOR,
                              connector="{}", now=T1)
    assert changed["epoch"] == 300
    state_change = st.build_status(obs(revision=310, members={**active("c-0", "c-1"), **active("c-2", state="joining")}),
                                   changed, selector=SELECTOR, connector="{}", now=T1)
    assert state_change["epoch"] == 310
    blind = st.build_status(obs(members=None, revision=0), state_change, selector=SELECTOR, connector="{}", now=T1)
    assert blind["epoch"] == 310
    empty = st.build_status(obs(members={}, revision=400), None, selector=SELECTOR, connector="{}", now=T0)
    assert empty["epoch"] == 0  # no ring yet


# ---- conditions from observations ---------------------------------------------------------------

@pytest.mark.parametrize("o, ready_reason", [
    (obs(members=None, etcd_error="cannot connect"), "EtcdUnreachable"),
    (obs(statefulset=None), "Creating"),
    (obs(statefulset=sts(3, 1)), "PodsNotReady"),
    (obs(members=active("c-0", "c-1")), "NodesNotActive"),
    (obs(members={**active("c-0", "c-1"), **active("c-2", state="joining")}), "NodesNotActive"),
    (obs(), "AllNodesReady"),
    (obs(desired=0, statefulset=sts(0, 0), members={}), "AllNodesReady"),
])
def test_ready(o, ready_reason):
    ready = conditions(o)["Ready"]
    assert ready.reason == ready_reason
    assert ready.status is (ready_reason == "AllNodesReady")


def test_ready_message_names_the_nodes_that_are_not_active():
    ready = conditions(obs(members={**active("c-0"), **active("c-2", state="draining")}))["Ready"]
    assert ready.message == "1 of 3 nodes active in etcd; not active: c-1 (missing), c-2 (draining)"


def test_a_cluster_coming_up_is_not_degraded_but_one_that_lost_nodes_is():
    starting = conditions(obs(statefulset=sts(3, 1)))
    assert starting["Degraded"].status is False and starting["Degraded"].reason == "Starting"
    was_ready = {"conditions": st.merge_conditions(None, [Condition("Ready", True, "AllNodesReady")], 1, T0)}
    lost = conditions(obs(members=active("c-0", "c-1")), was_ready)
    assert lost["Degraded"].status is True and lost["Degraded"].reason == "NodesUnavailable"
    assert "c-2 (missing)" in lost["Degraded"].message
    # Still degraded on the next pass (Ready is False by then), until everything is back.
    still = {"conditions": st.merge_conditions(None, [Condition("Degraded", True, "NodesUnavailable")], 1, T0)}
    assert conditions(obs(statefulset=sts(3, 2)), still)["Degraded"].status is True
    assert conditions(obs(), still)["Degraded"].status is False


def test_etcd_unreachable_is_degraded_and_rebalancing_unknown():
    c = conditions(obs(members=None, etcd_error="boom"))
    assert c["Degraded"].status is True and "boom" in c["Degraded"].message
    assert c["Rebalancing"].status is None


def test_rebalancing_during_a_scale_in_and_while_nodes_move():
    scale_in = conditions(obs(scale_in=ScaleInView(target=1, leaving=("c-2", "c-1"))))["Rebalancing"]
    assert scale_in.status is True and scale_in.reason == "ScaleIn"
    assert scale_in.message == "draining c-2, c-1 before shrinking to 1 nodes"
    moving = conditions(obs(members={**active("c-0", "c-1"), **active("c-2", state="drained")}))["Rebalancing"]
    assert moving.status is True and moving.message == "c-2 drained"
    assert conditions(obs())["Rebalancing"].status is False


def test_rebalancing_while_a_node_restores_copies_its_co_owners_lack():
    restoring = {"c-1": {"repair": {"active": True, "moving": True, "missing": 1300, "copied": 400}},
                 "c-0": {"repair": {"active": True, "moving": False, "missing": 0, "copied": 0}}}
    cond = conditions(obs(stats=restoring))["Rebalancing"]
    assert (cond.status, cond.reason) == (True, "RestoringCopies")
    assert cond.message == "c-1 restored 400 of 1300 missing copies so far"
    done = {"c-1": {"repair": {"active": False, "moving": False, "missing": 1300, "copied": 1300}}}
    assert conditions(obs(stats=done))["Rebalancing"].status is False
    assert conditions(obs(stats={"c-0": {"repair": None}}))["Rebalancing"].status is False  # a node without handoff


# ---- whole status objects -----------------------------------------------------------------------

def cr(status: dict) -> dict:
    return {"apiVersion": "kvring.io/v1alpha1", "kind": "CacheCluster", "metadata": {"name": "c"},
            "spec": {"memoryPerNode": "1Gi"}, "status": status}


def test_built_status_has_every_field_and_passes_the_crd_schema():
    o = obs(stats={"c-0": {"used": 10, "capacity": 64 << 20}}, scale_in=ScaleInView(2, ("c-2",)))
    got = st.build_status(o, None, selector=SELECTOR, connector='{"kv_connector":"KVRingConnector"}', now=T0)
    assert set(got) == {"observedGeneration", "replicas", "readyReplicas", "selector", "epoch", "nodes",
                        "conditions", "connector"}
    assert (got["observedGeneration"], got["replicas"], got["readyReplicas"]) == (3, 3, 3)
    assert [c["type"] for c in got["conditions"]] == list(st.CONDITION_TYPES[:-1])  # Progressing: disk clusters
    assert schema_errors(cr(got)) == []


def test_a_disk_cluster_status_shows_its_rollout_and_passes_the_crd_schema():
    rollout = {"revision": "c-7d9f", "updated": 1, "total": 3, "partition": 1, "waitingFor": "c-1",
               "reason": "RepairInProgress", "message": "c-1 is back; waiting for repair to settle on c-0"}
    o = obs(rollout=rollout, progressing=Condition("Progressing", True, "RepairInProgress", rollout["message"]))
    got = st.build_status(o, None, selector=SELECTOR, connector="{}", now=T0)
    assert got["rollout"] == rollout
    assert [c["type"] for c in got["conditions"]] == list(st.CONDITION_TYPES)
    assert got["conditions"][-1]["reason"] == "RepairInProgress"
    assert schema_errors(cr(got)) == []
    assert "rollout" not in st.build_status(obs(), None, selector=SELECTOR, connector="{}", now=T0)


def test_a_disk_change_the_statefulset_cannot_take_is_a_config_mismatch():
    c = conditions(obs(spec_problem="spec.disk cannot change on an existing cluster"))
    assert (c["ConfigMismatch"].status, c["ConfigMismatch"].reason) == (True, "DiskImmutable")
    assert c["Ready"].status is True  # the nodes keep running as they are


def test_invalid_status_keeps_the_rest_and_passes_the_crd_schema():
    previous = st.build_status(obs(), None, selector=SELECTOR, connector="{}", now=T0)
    got = st.invalid_status(previous, 4, "invalid CacheCluster spec:\n  - spec.memoryPerNode 1Mi ...", T1)
    assert set(got) == {"observedGeneration", "conditions"}
    by_type = {c["type"]: c for c in got["conditions"]}
    assert by_type["ConfigMismatch"]["status"] == "True" and "1Mi" in by_type["ConfigMismatch"]["message"]
    assert by_type["Ready"]["reason"] == "InvalidSpec" and by_type["Ready"]["lastTransitionTime"] == T1
    assert by_type["Degraded"] == next(c for c in previous["conditions"] if c["type"] == "Degraded")
    assert schema_errors(cr({**previous, **got})) == []


def test_changed_fields_is_a_minimal_patch():
    previous = st.build_status(obs(), None, selector=SELECTOR, connector="{}", now=T0)
    again = st.build_status(obs(), previous, selector=SELECTOR, connector="{}", now=T1)
    assert st.changed_fields(previous, again) == {}
    moved = st.build_status(obs(statefulset=sts(3, 2)), previous, selector=SELECTOR, connector="{}", now=T1)
    assert set(st.changed_fields(previous, moved)) == {"readyReplicas", "conditions"}


STREAM = PoolEventsRecord("tcp://c-events.ns.svc:5557", "tcp://c-events.ns.svc:5558", "kv")


def test_the_event_stream_shows_while_recorded_and_goes_when_its_record_does():
    shown = st.build_status(obs(pool_events=STREAM), None, selector=SELECTOR, connector="{}", now=T0)
    assert shown["poolEvents"] == {"events": "tcp://c-events.ns.svc:5557", "replay": "tcp://c-events.ns.svc:5558",
                                   "topic": "kv"}
    assert schema_errors(cr(shown)) == []
    # etcd unreadable: the last known endpoints stay (as the nodes' states do).
    kept = st.build_status(obs(members=None, etcd_error="timeout"), shown, selector=SELECTOR, connector="{}", now=T1)
    assert kept["poolEvents"] == shown["poolEvents"]
    assert st.changed_fields(shown, kept, whole=True).get("poolEvents", "same") == "same"
    # Read, and no stream recorded (stopped, turned off, its lease ran out): removed.
    gone = st.build_status(obs(), shown, selector=SELECTOR, connector="{}", now=T1)
    assert "poolEvents" not in gone
    assert st.changed_fields(shown, gone, whole=True)["poolEvents"] is None  # a merge patch's delete
    assert "poolEvents" not in st.changed_fields(gone, gone, whole=True)
    # A partial status (an invalid spec's) leaves it alone.
    assert "poolEvents" not in st.changed_fields(shown, st.invalid_status(shown, 4, "bad", T1))


def test_ordinal():
    assert st.ordinal("c", "c-12") == 12
    assert st.ordinal("c", "cc-1") is None and st.ordinal("c", "c-x") is None and st.ordinal("c-1", "c-1") is None
