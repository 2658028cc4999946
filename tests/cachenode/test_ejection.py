"""A client ejects a failing node from its routing and retries it later, for longer each time it
fails again (pure: a fake clock; the routing around an ejected node is tested with real nodes in
test_cluster.py)."""

from __future__ import annotations

from kvring.cachenode.client.ringview import FailureMarks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_node_failing_again_when_retried_stays_out_longer_each_time_up_to_the_cap():
    clock = Clock()
    marks = FailureMarks(5.0, max_backoff=40.0, clock=clock)
    waits = []
    for _ in range(6):
        marks.mark("n", "timeout")
        assert not marks.alive("n")
        start = clock.now
        while not marks.alive("n"):
            clock.now += 0.5
        waits.append(clock.now - start)
    assert waits == [5.5, 10.5, 20.5, 40.5, 40.5, 40.5]
    assert marks.ejections == 6


def test_failures_in_flight_do_not_lengthen_an_ejection_and_a_quiet_node_starts_over():
    clock = Clock()
    marks = FailureMarks(5.0, max_backoff=40.0, clock=clock)
    marks.mark("n", "timeout")
    clock.now += 3
    marks.mark("n", "a request that was in flight")  # already out: nothing changes
    clock.now += 2.5
    assert marks.alive("n") and marks.ejections == 1
    clock.now += 100  # healthy for longer than the cap: the next failure is a first one again
    marks.mark("n", "timeout")
    clock.now += 5.5
    assert marks.alive("n")


def test_a_node_that_registers_again_is_forgiven_at_once():
    clock = Clock()
    marks = FailureMarks(5.0, clock=clock)
    marks.mark("n", "refused")
    marks.forgive("n")
    assert marks.alive("n") and marks.alive("other")
