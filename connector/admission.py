"""Load or recompute: a prediction of both, from what this instance measured.

- Load time: ``bytes / bandwidth + latency``; the bandwidth and per-load latency are running
  estimates from the worker's loads (their bytes and seconds reach the scheduler side with
  every step's connector output).
- Recompute time: ``tokens / prefill speed``; the prefill speed is a running estimate of the
  tokens per second of steps that computed at least ``MIN_STEP_TOKENS`` tokens and loaded
  nothing, timed between consecutive ``build_connector_meta`` calls (a step's schedule,
  forward and update).  An idle gap between steps makes a step look slower, so the estimate
  errs towards loading.

A load is refused only when it is predicted clearly slower: by more than half the recompute
time plus ``SLACK_S``.  Near a tie loading wins, because recomputing occupies the engine that
every other request needs, while a load mostly waits on the network.

Until both are measured every load is admitted, and so is every ``PROBE_EVERY``-th load that
would be refused: estimates only change when loads run, so a cluster that was slow and has
recovered would otherwise never be trusted again.  Runs on the scheduler's thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

MIN_STEP_TOKENS = 256
PROBE_EVERY = 8
SLACK_S = 0.05
_ALPHA = 0.3  # weight of a new sample in the running estimates
_MIN_DEADLINE_S = 0.2


@dataclass
class Decision:
    """What admission decided for one request (also what a test or a log line reads)."""

    admit: bool
    load_s: float | None  # predicted load seconds (None: not measured yet)
    recompute_s: float | None  # predicted recompute seconds


class LoadCostModel:
    def __init__(self, bytes_per_token: int, timeout_s: float, load_deadline_s: float = 0.0) -> None:
        self.bytes_per_token = bytes_per_token
        self.timeout_s = timeout_s
        self.load_deadline_s = load_deadline_s
        self.bandwidth: float | None = None  # bytes per second of loads
        self.latency: float | None = None  # seconds a load costs besides its bytes
        self.prefill_rate: float | None = None  # tokens per second of prefill steps
        self._last_step: tuple[float, int, bool] | None = None  # (start, tokens, loaded)
        self._refused = 0  # loads refused since the last admitted one

    # ---- measurements ---------------------------------------------------------------------

    def step_started(self, tokens: int, loads: bool, now: float | None = None) -> None:
        """A step was scheduled: ``tokens`` to compute, ``loads`` whether it also loads."""
        now = time.monotonic() if now is None else now
        if self._last_step is not None:
            start, n, loaded = self._last_step
            if n >= MIN_STEP_TOKENS and not loaded and now > start:
                self.prefill_rate = _blend(self.prefill_rate, n / (now - start))
        self._last_step = (now, tokens, loads)

    def loads_measured(self, nbytes: int, seconds: float, loads: int) -> None:
        """The worker finished ``loads`` loads moving ``nbytes`` in ``seconds`` (summed)."""
        if loads <= 0 or seconds <= 0:
            return
        if nbytes > 0:
            self.bandwidth = _blend(self.bandwidth, nbytes / seconds)
        # What a load costs beyond moving its bytes at the measured bandwidth (never negative);
        # a load abandoned before any byte arrived is all latency.
        moved_s = nbytes / loads / self.bandwidth if self.bandwidth else 0.0
        self.latency = max(0.0, _blend(self.latency, seconds / loads - moved_s))

    # ---- predictions ----------------------------------------------------------------------

    def predict(self, tokens: int) -> tuple[float | None, float | None]:
        """Predicted (load, recompute) seconds of ``tokens``; ``None`` where not measured yet."""
        load_s = None  # with latency only, a lower bound
        if self.bandwidth or self.latency:
            load_s = (self.latency or 0.0) + (tokens * self.bytes_per_token / self.bandwidth if self.bandwidth else 0.0)
        recompute_s = tokens / self.prefill_rate if self.prefill_rate else None
        return load_s, recompute_s

    def decide(self, tokens: int) -> Decision:
        """Load ``tokens`` or recompute them; counts towards the next probe (call once per request)."""
        load_s, recompute_s = self.predict(tokens)
        admit = load_s is None or recompute_s is None or load_s <= 1.5 * recompute_s + SLACK_S
        if not admit:
            self._refused += 1
            admit = self._refused >= PROBE_EVERY  # a probe: measure the cluster again
        if admit:
            self._refused = 0
        return Decision(admit, load_s, recompute_s)

    def deadline_s(self, tokens: int) -> float:
        """How long an asynchronous load of ``tokens`` may take before it is abandoned."""
        if self.load_deadline_s > 0:
            return self.load_deadline_s
        _, recompute_s = self.predict(tokens)
        if recompute_s is None:
            return self.timeout_s
        return min(self.timeout_s, max(_MIN_DEADLINE_S, 2 * recompute_s))


def _blend(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _ALPHA) * old + _ALPHA * sample
