"""The rolling update of a disk cluster as pure decisions (``operator/rollout.py``): which pod goes
next, what it waits for, which restart markers are set and removed, and what the status says."""

from __future__ import annotations

import msgspec
import pytest

from kvring.common.records import RepairReport
from kvring.operator.render import render_statefulset
from kvring.operator.rollout import (
    ROLLOUT_ANNOTATION,
    NodeView,
    PodView,
    RollInput,
    Step,
    annotation_patch,
    disk_change,
    held_partition,
    plan_roll,
    update_revision,
)
from kvring.operator.spec import ClusterSpec

OLD, NEW = "c-old", "c-new"


def pods(*revisions: str, ready: bool = True) -> dict[int, PodView]:
    return {k: PodView(rev, ready) for k, rev in enumerate(revisions) if rev}


def nodes(n: int = 3, written: int = 10) -> dict[str, NodeView]:
    return {f"c-{k}": NodeView("active", f"inc-{k}", written) for k in range(n)}


def inp(**kw) -> RollInput:
    base = dict(name="c", replicas=3, partition=3, update_revision=NEW, pods=pods(OLD, OLD, OLD), nodes=nodes(),
                now=1000.0)
    return RollInput(**{**base, **kw})


def report(k: int, epoch: int, **kw) -> RepairReport:
    return RepairReport(node_id=f"c-{k}", incarnation=f"inc-{k}", epoch=epoch, passes=1, **kw)


def test_a_held_template_lets_the_highest_old_pod_go_marked_first():
    plan = plan_roll(inp())
    assert (plan.mark, plan.partition) == ("c-2", 2)
    assert plan.step == Step("c-2", NEW, 1000.0)
    assert plan.status == {"revision": NEW, "updated": 0, "total": 3, "partition": 2, "waitingFor": "c-2",
                           "reason": "PodRestarting", "message": "marked c-2 restarting and let it go"}
    assert (plan.condition.type, plan.condition.status) == ("Progressing", True)
    assert [e[1] for e in plan.events] == ["RollingPod"]


@pytest.mark.parametrize(("pod", "reason"), [
    (None, "PodRestarting"),  # deleted, not recreated yet
    (PodView(OLD, True), "PodRestarting"),  # the controller has not replaced it yet
    (PodView(NEW, False), "PodRestarting"),  # back, rebuilding its index
    (PodView(NEW, True, deleting=True), "PodRestarting"),
])
def test_the_next_pod_waits_until_the_last_is_ready_on_the_new_revision(pod, reason):
    p = pods(OLD, OLD, "")
    if pod is not None:
        p[2] = pod
    plan = plan_roll(inp(partition=2, pods=p, step=Step("c-2", NEW, 990.0), restarting=frozenset({"c-2"})))
    assert (plan.status["reason"], plan.waiting_for, plan.mark, plan.partition, plan.unmark) == \
        (reason, "c-2", None, None, ())
    assert plan.step == Step("c-2", NEW, 990.0)


def test_a_ready_pod_must_also_be_active_in_etcd():
    p = {**pods(OLD, OLD), 2: PodView(NEW, True)}
    n = {**nodes(), "c-2": NodeView("joining", "inc-9", 20)}
    plan = plan_roll(inp(partition=2, pods=p, nodes=n, step=Step("c-2", NEW, 990.0)))
    assert (plan.status["reason"], plan.mark) == ("NodeNotActive", None)
    assert plan_roll(inp(partition=2, pods=p, nodes=None, step=Step("c-2", NEW, 990.0))).status["reason"] == \
        "EtcdUnreachable"


def test_with_one_copy_a_ready_pod_lets_the_next_go_and_loses_its_marker():
    p = {**pods(OLD, OLD), 2: PodView(NEW, True)}
    plan = plan_roll(inp(partition=2, pods=p, step=Step("c-2", NEW, 990.0), restarting=frozenset({"c-2"})))
    assert (plan.mark, plan.partition, plan.unmark) == ("c-1", 1, ("c-2",))
    assert plan.status["updated"] == 1 and plan.waiting_for == "c-1"
    assert [e[1] for e in plan.events] == ["PodRolled", "RollingPod"]


def test_with_two_copies_the_next_pod_waits_for_repair_to_settle_on_every_node():
    p = {**pods(OLD, OLD), 2: PodView(NEW, True)}
    back = {**nodes(written=10), "c-2": NodeView("active", "inc-2", 50)}  # c-2's record: written at 50
    common = dict(partition=2, pods=p, nodes=back, replication=2, restarting=frozenset({"c-2"}))
    step = Step("c-2", NEW, 990.0)
    # c-0's last pass ran on a ring before c-2 came back; c-1 is still running one.
    reports = {0: report(0, 40), 1: report(1, 50, running=True), 2: report(2, 55)}
    plan = plan_roll(inp(step=step, reports={f"c-{k}": r for k, r in reports.items()}, **common))
    assert (plan.status["reason"], plan.waiting_for, plan.mark) == ("RepairInProgress", "c-2", None)
    assert plan.status["message"].endswith("c-0, c-1")
    assert plan.step == Step("c-2", NEW, 990.0, back_revision=50, back_at=1000.0)  # remembered from here on
    assert plan.unmark == ()

    # A pass still to retry, or a report from a previous incarnation, is not settled either.
    settled = {f"c-{k}": report(k, 60) for k in range(3)}
    for other in (msgspec.structs.replace(settled["c-1"], pending=True),
                  msgspec.structs.replace(settled["c-1"], incarnation="inc-old")):
        plan = plan_roll(inp(step=plan.step, reports={**settled, "c-1": other}, now=1010.0, **common))
        assert plan.status["reason"] == "RepairInProgress" and "c-1" in plan.status["message"]

    plan = plan_roll(inp(step=plan.step, reports=settled, now=1020.0, **common))
    assert (plan.mark, plan.partition, plan.unmark) == ("c-1", 1, ("c-2",))


def test_repair_that_does_not_settle_in_time_lets_the_roll_go_on_with_a_warning():
    p = {**pods(OLD, OLD), 2: PodView(NEW, True)}
    step = Step("c-2", NEW, 900.0, back_revision=50, back_at=900.0)
    plan = plan_roll(inp(partition=2, pods=p, replication=2, step=step, repair_timeout=60.0))
    assert plan.mark == "c-1"
    warning = next(e for e in plan.events if e[1] == "RepairTimeout")
    assert warning[0] == "Warning" and "did not settle within 60s" in warning[2]


def test_no_pod_goes_while_another_is_not_ready_or_a_scale_in_drains():
    plan = plan_roll(inp(pods={**pods(OLD, OLD, OLD), 0: PodView(OLD, False)}))
    assert (plan.status["reason"], plan.waiting_for, plan.mark, plan.partition) == ("PodsNotReady", "c-0", None, None)
    assert plan_roll(inp(scale_in=True)).status["reason"] == "ScaleIn"


def test_a_finished_roll_resets_the_partition_and_removes_every_marker():
    plan = plan_roll(inp(partition=0, pods=pods(NEW, NEW, NEW), step=Step("c-0", NEW, 990.0),
                         restarting=frozenset({"c-0"})))
    assert (plan.partition, plan.unmark, plan.step) == (None, ("c-0",), None)
    assert (plan.condition.status, plan.condition.reason) == (False, "RolloutComplete")
    assert plan.status["reason"] == "Complete" and plan.status["updated"] == 3
    assert [e[1] for e in plan.events] == ["PodRolled", "RolloutComplete"]
    # Pods already on the new revision are skipped; at rest the partition goes back to 0.
    plan = plan_roll(inp(partition=1, pods=pods(NEW, NEW, NEW)))
    assert (plan.partition, plan.events) == (0, ())


def test_stale_markers_go_but_never_from_a_pod_on_its_way_out():
    p = {**pods(OLD, OLD), 2: PodView(NEW, False)}
    plan = plan_roll(inp(partition=2, pods=p, step=None, restarting=frozenset({"c-0", "c-2", "c-9"})))
    assert plan.unmark == ("c-0", "c-9")  # c-2's pod is not back: its marker stays


def test_a_new_revision_in_the_middle_of_a_roll_starts_over_from_the_top():
    plan = plan_roll(inp(update_revision="c-newer", pods=pods(OLD, OLD, NEW), step=Step("c-1", NEW, 990.0),
                         restarting=frozenset({"c-1"})))
    assert (plan.mark, plan.partition, plan.unmark) == ("c-2", 2, ("c-1",))


def test_nothing_moves_until_the_controller_has_seen_the_spec():
    plan = plan_roll(inp(update_revision=None))
    assert (plan.mark, plan.partition, plan.status["reason"]) == (None, None, "WaitingForController")
    sts = {"metadata": {"generation": 4}, "status": {"observedGeneration": 3, "updateRevision": NEW}}
    assert update_revision(sts) is None
    sts["status"]["observedGeneration"] = 4
    assert update_revision(sts) == NEW


def test_held_partition():
    spec = ClusterSpec.from_dict({"memoryPerNode": "1Gi", "disk": {"size": "10Gi"}})
    current = render_statefulset("c", "ns", spec, partition=0)
    assert held_partition(None, current) == 0
    assert held_partition(current, render_statefulset("c", "ns", spec)) == 0  # same template: left as it is
    current["spec"]["updateStrategy"]["rollingUpdate"]["partition"] = 1  # a roll under way
    assert held_partition(current, render_statefulset("c", "ns", spec)) == 1
    newer = ClusterSpec.from_dict({"memoryPerNode": "1Gi", "disk": {"size": "10Gi"}, "image": "kvring:0.2.0"})
    assert held_partition(current, render_statefulset("c", "ns", newer)) == 3  # every pod held


def test_disk_change_is_refused_with_what_to_do():
    def rendered(**disk):
        return render_statefulset("c", "ns", ClusterSpec.from_dict({"memoryPerNode": "1Gi", **disk}))
    with_disk = rendered(disk={"size": "10Gi"})
    assert disk_change(None, with_disk) == ""
    assert disk_change(with_disk, rendered(disk={"size": "10Gi", "capacity": "5Gi"})) == ""
    # The API server filled in the default storage class: still the same claim.
    served = dict(with_disk, spec=dict(with_disk["spec"], volumeClaimTemplates=[
        {**with_disk["spec"]["volumeClaimTemplates"][0],
         "spec": {**with_disk["spec"]["volumeClaimTemplates"][0]["spec"], "storageClassName": "standard",
                  "volumeMode": "Filesystem"}}]))
    assert disk_change(served, rendered(disk={"size": "10Gi"})) == ""
    for other in (rendered(), rendered(disk={"size": "20Gi"}), rendered(disk={"size": "10Gi", "storageClassName": "x"})):
        assert "spec.disk cannot change on an existing cluster" in disk_change(served, other)
    assert "immutable" in disk_change(rendered(), with_disk)


def test_the_step_round_trips_through_its_annotation():
    step = Step("c-2", NEW, 1000.25, back_revision=50, back_at=1010.5)
    assert Step.from_annotation(step.to_annotation()) == step
    assert Step.from_annotation("{") is None and Step.from_annotation(None) is None
    plan = plan_roll(inp())
    assert annotation_patch(plan, {}) == {ROLLOUT_ANNOTATION: plan.step.to_annotation()}
    assert annotation_patch(plan, {ROLLOUT_ANNOTATION: plan.step.to_annotation()}) == {}
