"""Load or recompute: a prediction of both, learnt per cache node, robust to accidents.

- **Per node, what its loads cost.**  Every load reports, per node it read from, a ``Transfer``
  (``kvring.cachenode.client.meter``): the time to that node's first reply (its latency) and
  the rate of the rest (bytes over the remaining seconds).  A node's estimate is the *median* of
  its last ``WINDOW`` transfers of the last ``SAMPLE_TTL_S`` seconds, so no single outlier moves
  it and old ones fade out.
- **A stall is a failure, not a sample.**  A transfer the node did not finish (it timed out, was
  unreachable, or a load was abandoned while it still owed bytes) is never a measurement of its
  speed: it marks the node *failing*.  Loads that need a failing node are refused (reason
  ``node_failing``) until one of them succeeds again: a probe, admitted once the node has
  answered something (a lookup) since it failed.  After a first failure the probe may run at
  once; after a failed probe, only ``PROBE_INTERVAL_S`` later, one at a time.  So a node that
  was stopped and resumed is trusted again by its first request after it answers, and a node
  that keeps failing costs one probe per interval.
- **A request's load time** is that of its slowest node: each node that holds some of its chunks
  (the lookup's answer says which) moves its share of the bytes at its own latency and rate.
  Nodes not measured yet count at the median of those that are.
- **Recompute time**: ``tokens / prefill speed``, the speed being the median of the last
  ``WINDOW`` steps that computed at least ``MIN_STEP_TOKENS`` tokens and loaded nothing, timed
  between consecutive ``build_connector_meta`` calls (a step's schedule, forward and update).  An
  idle gap between steps makes a step look slower, so the estimate errs towards loading.

A load is refused as ``slower`` only when predicted clearly slower: by more than half the
recompute time plus ``SLACK_S``.  Near a tie loading wins, because recomputing occupies the
engine that every other request needs, while a load mostly waits on the network.  Until a load
and a prefill step have been measured every load is admitted; a load refused as slower also runs
as a probe when no load has taught anything for ``PROBE_INTERVAL_S`` (estimates only change when
loads run).

Runs on the scheduler's thread only.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from kvring.cachenode.client import Transfer

MIN_STEP_TOKENS = 256
WINDOW = 16  # transfers (per node) and prefill steps an estimate is the median of
SAMPLE_TTL_S = 120.0  # transfers older than this no longer count
PROBE_INTERVAL_S = 2.0  # between probes of a node whose last probe failed, and of a slower-refused load
SLACK_S = 0.05
_MIN_RATE_BYTES = 64 << 10  # a transfer smaller than this measures latency only
_MIN_DEADLINE_S = 0.2
# A layerwise or bulk load holds its whole step (every request of the batch), and abandoning it
# recomputes its blocks in the next one: it is given longer before it is.
_MIN_SYNC_DEADLINE_S = 1.0


class Refusal(StrEnum):
    """Why admission refused a load (the label of ``vllm:kvring_loads_refused_total``)."""

    SLOWER = "slower"  # predicted clearly slower than recomputing
    NODE_FAILING = "node_failing"  # it needs a node whose last transfer failed


@dataclass(frozen=True)
class Decision:
    """What admission decided for one request (also what a test or a log line reads)."""

    admit: bool
    load_s: float | None  # predicted load seconds (None: not measured yet)
    recompute_s: float | None  # predicted recompute seconds
    refusal: Refusal | None = None  # why it would be refused (set on a probe too)
    probe: bool = False  # admitted although refused, to measure again


@dataclass
class NodeLink:
    """What this instance knows of one node's loads (see the module docstring)."""

    samples: deque[tuple[float, float, float | None]] = field(
        default_factory=lambda: deque(maxlen=WINDOW))  # (when, latency s, rate B/s or None)
    failed_at: float | None = None  # its last failure, until a load from it succeeds again
    answered_at: float = float("-inf")  # its last answer of any kind (a lookup's too)
    failed_loads: int = 0  # loads (probes included) it failed in a row
    probe_at: float = float("-inf")  # no probe of it before then

    def fail(self, now: float, load: bool) -> None:
        self.failed_at = now
        if load:
            self.failed_loads += 1
            self.probe_at = now + (PROBE_INTERVAL_S if self.failed_loads > 1 else 0.0)

    def may_probe(self, now: float) -> bool:
        """Failing, but it answered since and its next probe is due."""
        return self.answered_at > self.failed_at and now >= self.probe_at

    def latency(self, now: float) -> float | None:
        fresh = [lat for t, lat, _ in self.samples if now - t <= SAMPLE_TTL_S]
        return statistics.median(fresh) if fresh else None

    def rate(self, now: float) -> float | None:
        fresh = [rate for t, _, rate in self.samples if rate is not None and now - t <= SAMPLE_TTL_S]
        return statistics.median(fresh) if fresh else None


@dataclass(frozen=True)
class LoadBytes:
    """The KV bytes one worker loads for a hit: ``per_token`` for every token (its full-attention
    layers), and for each sliding window only the window's last tokens (``windows``: window in
    tokens, bytes per token of its layers), and ``state`` once per load (a model with recurrent
    state: its layers' state after the hit)."""

    per_token: int
    windows: tuple[tuple[int, int], ...] = ()
    state: int = 0

    def of(self, tokens: int) -> int:
        return tokens * self.per_token + sum(min(tokens, w) * b for w, b in self.windows) + self.state


class LoadCostModel:
    def __init__(self, bytes_per_token: int | LoadBytes, timeout_s: float, load_deadline_s: float = 0.0,
                 clock=time.monotonic) -> None:
        self.load_bytes = bytes_per_token if isinstance(bytes_per_token, LoadBytes) else LoadBytes(bytes_per_token)
        self.timeout_s = timeout_s
        self.load_deadline_s = load_deadline_s
        self.clock = clock
        self.nodes: dict[str, NodeLink] = {}
        self.prefill: deque[float] = deque(maxlen=WINDOW)  # tokens per second of prefill steps
        self._last_step: tuple[float, int, bool] | None = None  # (start, tokens, loaded)
        self._learnt = float("-inf")  # when a load last taught something (measured, failed, or a probe began)

    # ---- measurements ---------------------------------------------------------------------

    def step_started(self, tokens: int, loads: bool, now: float | None = None) -> None:
        """A step was scheduled: ``tokens`` to compute, ``loads`` whether it also loads."""
        now = self.clock() if now is None else now
        if self._last_step is not None:
            start, n, loaded = self._last_step
            if n >= MIN_STEP_TOKENS and not loaded and now > start:
                self.prefill.append(n / (now - start))
        self._last_step = (now, tokens, loads)

    def loaded(self, transfers: Iterable[Transfer], now: float | None = None) -> None:
        """What loads cost, node by node: samples of the nodes that finished, failures of the rest."""
        now = self.clock() if now is None else now
        for t in transfers:
            self._learnt = now
            link = self._link(t.node_id)
            if not t.ok:
                link.fail(now, load=True)
                continue
            link.answered_at, link.failed_at, link.failed_loads = now, None, 0
            moving = t.seconds - t.first_reply_s
            rate = t.nbytes / moving if t.nbytes >= _MIN_RATE_BYTES and moving > 0 else None
            link.samples.append((now, t.first_reply_s, rate))

    def looked_up(self, transfers: Iterable[Transfer], now: float | None = None) -> None:
        """A lookup's answers: signs of life (never samples: a lookup moves no KV); its failures count."""
        now = self.clock() if now is None else now
        for t in transfers:
            link = self._link(t.node_id)
            if t.ok:
                link.answered_at = now
            else:
                link.fail(now, load=False)

    def _link(self, node_id: str) -> NodeLink:
        link = self.nodes.get(node_id)
        if link is None:
            link = self.nodes[node_id] = NodeLink()
        return link

    # ---- predictions ----------------------------------------------------------------------

    @property
    def prefill_rate(self) -> float | None:
        return statistics.median(self.prefill) if self.prefill else None

    def predict(self, tokens: int, shares: Mapping[str, float]) -> tuple[float | None, float | None]:
        """Predicted (load, recompute) seconds of ``tokens`` whose bytes are split over nodes as
        ``shares`` (fractions); ``None`` where not measured yet."""
        now = self.clock()
        measured = {n: (link.latency(now), link.rate(now)) for n, link in self.nodes.items()}
        lats = [lat for lat, _ in measured.values() if lat is not None]
        rates = [rate for _, rate in measured.values() if rate is not None]
        load_s = None
        if lats and shares:
            typical_lat, typical_rate = statistics.median(lats), statistics.median(rates) if rates else None
            nbytes = self.load_bytes.of(tokens)
            load_s = 0.0
            for node_id, share in shares.items():
                lat, rate = measured.get(node_id, (None, None))
                lat = typical_lat if lat is None else lat
                rate = typical_rate if rate is None else rate
                load_s = max(load_s, lat + (nbytes * share / rate if rate else 0.0))
        rate = self.prefill_rate
        return load_s, tokens / rate if rate else None

    def decide(self, tokens: int, shares: Mapping[str, float]) -> Decision:
        """Load ``tokens`` (held by nodes as ``shares``) or recompute them (call once per request)."""
        now = self.clock()
        load_s, recompute_s = self.predict(tokens, shares)
        failing = [self.nodes[n] for n in shares if n in self.nodes and self.nodes[n].failed_at is not None]
        if failing:
            # A probe of the failing nodes, so that a recovered node is trusted again.
            if all(link.may_probe(now) for link in failing):
                for link in failing:
                    link.probe_at = now + PROBE_INTERVAL_S  # one at a time: until it ends, or that long
                return Decision(True, load_s, recompute_s, Refusal.NODE_FAILING, probe=True)
            return Decision(False, load_s, recompute_s, Refusal.NODE_FAILING)
        if load_s is None or recompute_s is None or load_s <= 1.5 * recompute_s + SLACK_S:
            return Decision(True, load_s, recompute_s)
        # A probe: a load refused as slower runs anyway once loads have taught nothing for an
        # interval (estimates only change when loads run).
        if now - self._learnt >= PROBE_INTERVAL_S:
            self._learnt = now
            return Decision(True, load_s, recompute_s, Refusal.SLOWER, probe=True)
        return Decision(False, load_s, recompute_s, Refusal.SLOWER)

    def deadline_s(self, tokens: int, asynchronous: bool = True) -> float:
        """How long a load of ``tokens`` may take before it is abandoned: ``load_deadline_s`` if
        set, else twice its predicted recompute time, at least 0.2 s (1 s for a layerwise or bulk
        load, which holds its step), at most the node timeout."""
        if self.load_deadline_s > 0:
            return self.load_deadline_s
        rate = self.prefill_rate
        if rate is None:
            return self.timeout_s
        floor = _MIN_DEADLINE_S if asynchronous else _MIN_SYNC_DEADLINE_S
        return min(self.timeout_s, max(floor, 2 * tokens / rate))
