"""The `bucket` policy: instances own contiguous ranges of prompt length, and the ranges move so
that each one gets the same share of the recent work (the idea of the SGLang Model Gateway's
`bucket` policy, learned from its description and source; our own code).

Instance k takes the prompts whose length is in (bounds[k-1], bounds[k]] (the first from 0, the
last without an end). The router remembers the requests it routed in the last `window_s`
(length and predicted work); every `interval_s` it moves the bounds to the work-weighted
quantiles of those lengths, so each range would have received 1/n of the window's work. As
the gateway does, it only moves them when the work per range changed by more than
`readjust_ratio` since the last move (or never moved), and it sends a request to the least
loaded instance instead of its range's owner when the pending loads are imbalanced: the most
loaded is more than `balance_abs` (load units; None: one full prefill step) above the least
and more than `balance_rel` x it. An owner that cannot take work now leaves the request to the least
loaded eligible instance. Before any work the ranges split [0, `initial_max`) evenly, as the
gateway's do.

Why a baseline: a length range per instance keeps long prompts off the instances that serve
the short ones, without groups or predictions of finish times; it is what a user of the
gateway would deploy for length-skewed traffic.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Callable, Sequence as Seq


@dataclasses.dataclass(frozen=True)
class BucketSettings:
    interval_s: float = 5.0        # the gateway's bucket_adjust_interval_secs
    window_s: float = 5.0          # the routed work the bounds are levelled on
    readjust_ratio: float = 2.0    # move the bounds when work per range changed this much
    balance_abs: float | None = None  # load units; None: one full prefill step
    balance_rel: float = 2.0
    initial_max: int = 4096        # the gateway's initial l_max

    def __post_init__(self) -> None:
        for name in ("interval_s", "window_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.readjust_ratio < 1 or self.balance_rel < 1 or self.initial_max < 1:
            raise ValueError("readjust_ratio and balance_rel must be >= 1, initial_max >= 1")
        if self.balance_abs is not None and self.balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {self.balance_abs!r}")


def level_bounds(samples: Seq[tuple[int, float]], n: int) -> list[int]:
    """The n - 1 upper bounds that give each of n ranges an equal share of the samples' work
    ((length, work) pairs): the work-weighted quantiles of the lengths."""
    pts = sorted((max(int(l), 0), max(float(w), 0.0)) for l, w in samples)
    total = sum(w for _, w in pts)
    if n < 2 or not pts or total <= 0:
        return []
    bounds, acc, k = [], 0.0, 1
    for length, w in pts:
        acc += w
        while k < n and acc >= total * k / n:
            bounds.append(length)
            k += 1
    while len(bounds) < n - 1:
        bounds.append(pts[-1][0])
    return bounds


@dataclasses.dataclass
class Buckets:
    n: int
    settings: BucketSettings = dataclasses.field(default_factory=BucketSettings)
    bounds: list[int] = dataclasses.field(default_factory=list)
    recent: collections.deque = dataclasses.field(default_factory=collections.deque)
    per_range: float = 0.0         # work per range when the bounds last moved
    last_adjust: float | None = None
    adjusts: int = 0

    def __post_init__(self) -> None:
        if not self.bounds:
            gap = max(self.settings.initial_max // max(self.n, 1), 1)
            self.bounds = [(k + 1) * gap - 1 for k in range(self.n - 1)]

    def owner(self, prompt_len: int) -> int:
        return bisect.bisect_left(self.bounds, prompt_len)

    def _forget(self, now: float) -> None:
        while self.recent and now - self.recent[0][0] > self.settings.window_s:
            self.recent.popleft()

    def maybe_adjust(self, now: float) -> bool:
        """Moves the bounds to level the window's work, once per interval, when it changed."""
        st = self.settings
        if self.last_adjust is not None and now - self.last_adjust < st.interval_s:
            return False
        self.last_adjust = now
        self._forget(now)
        per = sum(w for _, _, w in self.recent) / self.n
        if per <= 0:
            return False
        old = self.per_range
        if old > 0 and old / st.readjust_ratio <= per <= old * st.readjust_ratio:
            return False
        self.bounds = level_bounds([(l, w) for _, l, w in self.recent], self.n)
        self.per_range = per
        self.adjusts += 1
        return True

    def pick(self, prompt_len: int, work: float, loads: Seq[float], now: float,
             ok: Callable[[int], bool], balance_abs: float) -> tuple[int, bool]:
        """(instance, sent by balance rather than by its range) among the eligible ones."""
        self.maybe_adjust(now)
        members = [k for k in range(self.n) if ok(k)]
        least = min(members, key=lambda k: (loads[k], k))
        lo, hi = loads[least], max(loads[k] for k in members)
        abs_ = self.settings.balance_abs if self.settings.balance_abs is not None \
            else balance_abs
        i, by_balance = self.owner(prompt_len), False
        if hi - lo > abs_ and hi > self.settings.balance_rel * lo or not ok(i):
            i, by_balance = least, True
        self.recent.append((now, prompt_len, max(work, 0.0)))
        return i, by_balance
