"""The short pool's waiting window: how long a short batch may wait for companions.

Waiting pays only when companions are likely to come (batching memory-bound prefills is nearly
free) and costs every request already waiting. So the adaptive window is

    W = min(max_s, slack_fraction x tightest SLO slack, time to fill the bucket at the current
            short-arrival rate)

and zero when fewer than `min_expected` arrivals are expected within `max_s` (waiting would
mostly buy nothing). A static window (dispatch at N requests or W seconds, the LAPS reference
policy) and no window at all are settings. The window only ever matters when the device would
otherwise start this batch now: while a step runs, requests gather anyway.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class WindowConfig:
    mode: str = "adaptive"         # "adaptive", "static" or "off"
    static_s: float = 0.005        # static window length
    max_s: float | None = None     # adaptive cap (None: the dispatcher sets it from the model)
    slack_fraction: float = 0.5    # share of the tightest SLO slack the window may spend
    rate_tau_s: float = 2.0        # time constant of the arrival-rate average
    min_expected: float = 0.5      # arrivals expected within max_s needed to wait at all

    def __post_init__(self) -> None:
        if self.mode not in ("adaptive", "static", "off"):
            raise ValueError(f"window mode must be adaptive, static or off, got {self.mode!r}")


class ArrivalRate:
    """Exponentially weighted arrival rate (per second) with time constant tau."""

    def __init__(self, tau: float):
        self.tau = tau
        self._level = 0.0
        self._t = 0.0

    def observe(self, now: float) -> None:
        self._level = self.rate(now) + 1.0 / self.tau
        self._t = now

    def rate(self, now: float) -> float:
        return self._level * math.exp(-max(now - self._t, 0.0) / self.tau)


class WaitingWindow:
    def __init__(self, config: WindowConfig):
        self.config = config
        self.rate = ArrivalRate(config.rate_tau_s)
        self.waits = 0          # batches that waited for companions
        self.wait_seconds = 0.0

    def observe_arrival(self, now: float) -> None:
        self.rate.observe(now)

    def length(self, now: float, n: int, n_max: int, slack: float) -> float:
        """Window for a batch of `n` requests that could grow to `n_max`, whose tightest
        request has `slack` seconds before it must start."""
        c = self.config
        if c.mode == "off" or n >= n_max:
            return 0.0
        if c.mode == "static":
            return c.static_s
        cap = c.max_s or 0.0
        lam = self.rate.rate(now)
        if cap <= 0 or lam * cap < c.min_expected:
            return 0.0
        return max(0.0, min(cap, c.slack_fraction * slack, (n_max - n) / lam))

    def dispatch_at(self, now: float, oldest: float, n: int, n_max: int,
                    tightest_start: float) -> float:
        """When the batch must go: window end after its oldest member, or earlier when waiting
        longer would make its tightest request miss its deadline (`tightest_start`: the latest
        start that still meets it)."""
        slack = tightest_start - now
        w = self.length(now, n, n_max, slack)
        return min(oldest + w, tightest_start) if w > 0 else now

    def record(self, waited: float) -> None:
        if waited > 0:
            self.waits += 1
            self.wait_seconds += waited
