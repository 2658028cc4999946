"""Scale-in decisions: which nodes drain, when the StatefulSet shrinks, what survives a restart."""

from __future__ import annotations

import json

import pytest

from kvring.operator import scaling
from kvring.operator.scaling import ScaleIn
from kvring.operator.status import Member


def m(node_id: str, state: str = "active") -> Member:
    return Member(node_id, state)


@pytest.mark.parametrize("desired, current, replicas, leaving", [
    (3, None, 3, ()),  # no StatefulSet yet
    (5, 3, 5, ()),  # scale-out
    (3, 3, 3, ()),  # nothing to do
    (2, 5, 5, ("c-4", "c-3", "c-2")),  # scale-in: keep five pods, drain the highest three first
    (0, 1, 1, ("c-0",)),
])
def test_plan_replicas(desired, current, replicas, leaving):
    plan = scaling.plan_replicas("c", desired, current, None, now=1000.0)
    assert plan.replicas == replicas and plan.request_drains == leaving
    if leaving:
        assert plan.scale_in == ScaleIn(source=current, target=desired, leaving=leaving, started=1000.0)
    else:
        assert plan.scale_in is None


def test_a_scale_in_already_under_way_keeps_its_start_time():
    pending = ScaleIn(source=5, target=2, leaving=("c-4", "c-3", "c-2"), started=900.0)
    assert scaling.plan_replicas("c", 2, 5, pending, now=1000.0).scale_in == pending


def test_a_different_target_starts_a_new_scale_in():
    pending = ScaleIn(source=5, target=3, leaving=("c-4", "c-3"), started=900.0)
    plan = scaling.plan_replicas("c", 2, 5, pending, now=1000.0)
    assert plan.scale_in.started == 1000.0 and plan.scale_in.leaving == ("c-4", "c-3", "c-2")


def test_scale_out_during_a_scale_in_drops_it_and_withdraws_every_drain():
    pending = ScaleIn(source=5, target=2, leaving=("c-4", "c-3", "c-2"), started=900.0)
    plan = scaling.plan_replicas("c", 6, 5, pending, now=1000.0)
    assert plan.replicas == 6 and plan.scale_in is None and plan.request_drains == ()
    assert scaling.annotations_patch(plan, {scaling.SCALE_IN_ANNOTATION: pending.to_annotation()}) == {
        scaling.SCALE_IN_ANNOTATION: None}
    requested = {"c-4", "c-3", "c-2", "other-1", "c-x"}
    assert scaling.stale_drains("c", requested, plan.staying) == ["c-2", "c-3", "c-4"]


def test_a_smaller_scale_in_withdraws_only_the_drains_of_nodes_that_now_stay():
    pending = ScaleIn(source=5, target=2, leaving=("c-4", "c-3", "c-2"), started=900.0)
    plan = scaling.plan_replicas("c", 4, 5, pending, now=1000.0)
    assert plan.replicas == 5 and plan.scale_in.leaving == ("c-4",) and plan.request_drains == ("c-4",)
    assert scaling.stale_drains("c", {"c-4", "c-3", "c-2"}, plan.staying) == ["c-2", "c-3"]
    # While the same scale-in goes on, nothing is withdrawn (no cancel-then-request flapping).
    again = scaling.plan_replicas("c", 4, 5, plan.scale_in, now=1001.0)
    assert scaling.stale_drains("c", {"c-4"}, again.staying) == []


def test_drained_or_gone_nodes_let_the_statefulset_shrink():
    pending = ScaleIn(source=4, target=2, leaving=("c-3", "c-2"), started=1000.0)
    waiting = scaling.drain_progress(pending, {"c-3": m("c-3", "drained"), "c-2": m("c-2", "draining")}, 1010.0, 120)
    assert not waiting.done and waiting.waiting == ("c-2",)
    done = scaling.drain_progress(pending, {"c-3": m("c-3", "drained")}, 1010.0, 120)  # c-2's record is gone
    assert done.done and not done.timed_out


def test_the_drain_timeout_shrinks_anyway_and_says_who_was_late():
    pending = ScaleIn(source=4, target=2, leaving=("c-3", "c-2"), started=1000.0)
    members = {"c-3": m("c-3", "draining"), "c-2": m("c-2", "drained")}
    assert not scaling.drain_progress(pending, members, 1119.9, 120).done
    late = scaling.drain_progress(pending, members, 1120.0, 120)
    assert late.done and late.timed_out and late.waiting == ("c-3",)
    assert scaling.describe(pending, late).startswith("c-3 did not report drained in time; shrinking from 4 to 2")
    assert scaling.describe(pending) == "draining c-3, c-2 before shrinking from 4 to 2 nodes"


def test_the_annotation_round_trips_and_a_malformed_one_is_ignored():
    s = ScaleIn(source=4, target=2, leaving=("c-3", "c-2"), started=1234.5)
    assert ScaleIn.from_annotation(s.to_annotation()) == s
    assert json.loads(s.to_annotation()) == {"from": 4, "to": 2, "leaving": ["c-3", "c-2"], "started": 1234.5}
    for bad in ("", None, "{", '{"from": 4}', '{"from": 4, "to": 2, "leaving": "c-3", "started": 1}',
                '{"from": "x", "to": 2, "leaving": [], "started": 1}'):
        assert ScaleIn.from_annotation(bad) is None


def test_annotations_patch_is_empty_when_nothing_changes():
    plan = scaling.plan_replicas("c", 2, 4, None, now=5.0)
    first = scaling.annotations_patch(plan, {})
    assert first == {scaling.SCALE_IN_ANNOTATION: plan.scale_in.to_annotation()}
    assert scaling.annotations_patch(plan, first) == {}
    assert scaling.annotations_patch(scaling.plan_replicas("c", 4, 4, None, now=5.0), {}) == {}
