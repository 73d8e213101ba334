"""Prefill pools: which waiting requests form the next batch, and in which bucket.

Every batch is a rectangle packed by `engine/packing.py`'s `pack` from an ordered candidate list
(chunking a row to fit when allowed, refusing rows that would make the batch mostly padding); the
offline job packs its steps with it too. The pools only decide order:

- `SingleQueue` (mixed): one queue, chunked; by default in arrival order and strict (nobody
  overtakes: the paper's FCFS baseline), or in any of the pools' orders (HRRN, SRPT...).
- `ShortPool`: remaining tokens with aging, whole requests, behind a waiting window.
- `LongPool`: remaining tokens with aging, chunked under the long budget (a larger one while
  more requests wait than the overload mark); a step that finishes its first request takes
  others' tokens only while nearly free (`finish_slack`); a starved request (not served for
  `max_postpone_s`) goes first.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from laps_jax.engine.buckets import Bucket, BucketGrid
from laps_jax.engine.packing import fits, pack
from laps_jax.scheduler.request import LONG, SHORT, Request
from laps_jax.scheduler.window import WaitingWindow

Work = list[tuple[Request, int]]


@dataclasses.dataclass
class PrefillPlan:
    work: Work
    pool: str
    bucket: Bucket
    waited: float = 0.0  # how long the window held this batch back (device free meanwhile)
    forced: bool = False  # a long step forced by the starvation bound
    filled_tokens: int = 0  # long-chunk tokens riding in a short batch's empty bucket rows
    overload: bool = False  # a long step under the overload budget (the long pool is behind)

    def to_run(self, grid: BucketGrid) -> PrefillPlan:
        """The plan as it runs: rows of one new token each run in the decode bucket of as many
        rows (the same math, without padding every row to the smallest prefill width); any
        other plan runs in its own bucket. The lane applies this once, as it dispatches the
        plan: the executor, engine and runner below only check that the bucket holds the rows."""
        if max(n for _, n in self.work) == 1:
            b = grid.fit_decode(len(self.work))
            if b is not None:
                return dataclasses.replace(self, bucket=b)
        return self


@dataclasses.dataclass
class WaitUntil:
    t: float
    reason: str = "window"


class _Pool:
    """Requests of one pool in priority order (lower score first), by one of four rules:

    - "fcfs": arrival order;
    - "aging": remaining new tokens minus `aging` tokens per second waited;
    - "ratio": highest response ratio first, (waited + service) / service with `service` the
      predicted prefill time of the remaining tokens: short work first, and aging in proportion
      to each request's own size, so no constant sets the balance and a deep queue does not
      turn the order into FCFS. (A TTFT SLO that is a multiple of the isolated prefill time is
      a response-ratio bound: this serves first whoever is closest to its SLO.)
    - "srpt": fewest remaining tokens first (what minimizes mean latency), except that a
      request that has waited `max_wait_s` goes ahead of every one that has not (the longest
      waiting first): pure shortest-first starves the longest prompts under load.
    """

    name = ""

    def __init__(self, grid: BucketGrid, budget: int, aging_tokens_per_s: float,
                 order: str = "aging", service: Callable[[int], float] | None = None,
                 max_wait_s: float = 2.0):
        self.grid, self.budget = grid, budget
        self.aging, self.order, self.max_wait_s = aging_tokens_per_s, order, max_wait_s
        self.service = service or (lambda n: 0.01 + n / 2000.0)
        self.reqs: list[Request] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def pending_tokens(self) -> int:
        """Prompt tokens its requests still have to prefill (what a router balances on)."""
        return sum(r.remaining for r in self.reqs)

    def add(self, r: Request, now: float) -> None:
        r.enqueued = r.last_served = now
        self.reqs.append(r)

    def remove(self, r: Request) -> None:
        if r in self.reqs:
            self.reqs.remove(r)

    def score(self, r: Request, now: float) -> tuple[int, float]:
        wait = now - r.enqueued
        if self.order == "fcfs":
            return 0, r.stats.arrival
        if self.order == "aging":
            return 0, r.remaining - self.aging * wait
        if self.order == "srpt":
            # overdue first, longest waiting first; then fewest remaining
            return (0, -wait) if wait >= self.max_wait_s else (1, float(r.remaining))
        s = self.service(r.remaining)
        return 0, -(wait + s) / s

    def ordered(self, now: float) -> list[Request]:
        return sorted(self.reqs, key=lambda r: (self.score(r, now), r.enqueued))


class SingleQueue(_Pool):
    """mixed: one queue for all prefill work, chunked under the budget, in `order`. "fcfs" (the
    default, the paper's baseline) is strict: a request that does not fit stops the batch, so
    nobody overtakes. The other orders are a well-ordered single queue (HRRN as "ratio", SRPT
    with the wait bound as "srpt"): later rows may fill what the head leaves, as in the pools."""

    name = "mixed"

    def __init__(self, grid: BucketGrid, budget: int, aging_tokens_per_s: float,
                 order: str = "fcfs", service: Callable[[int], float] | None = None,
                 max_wait_s: float = 2.0):
        super().__init__(grid, budget, aging_tokens_per_s, order, service, max_wait_s)

    def plan(self, now: float) -> PrefillPlan | None:
        if not self.reqs:
            return None
        work, bucket, _ = pack(self.ordered(now), self.grid, self.budget, chunk=True,
                               strict=self.order == "fcfs")
        return PrefillPlan(work, self.name, bucket) if work else None


class ShortPool(_Pool):
    name = SHORT

    def __init__(self, grid: BucketGrid, budget: int, aging_tokens_per_s: float,
                 window: WaitingWindow, predict: Callable[[Work, Bucket], float],
                 order: str = "aging", service: Callable[[int], float] | None = None,
                 max_wait_s: float = 2.0):
        super().__init__(grid, budget, aging_tokens_per_s, order, service, max_wait_s)
        self.window, self.predict = window, predict
        self.hold_since: float | None = None  # the window first said "wait" for this batch

    def add(self, r: Request, now: float) -> None:
        super().add(r, now)
        self.window.observe_arrival(now)

    def max_rows(self, width: int) -> int:
        return max((b for b in self.grid.prefill_batches
                    if fits(self.grid, b, width, self.budget) is not None), default=1)

    def plan(self, now: float) -> PrefillPlan | WaitUntil | None:
        if not self.reqs:
            return None
        work, bucket, saturated = pack(self.ordered(now), self.grid, self.budget, chunk=False,
                                       strict=False)
        if not work:
            return None
        width = max(n for _, n in work)
        n_max = self.max_rows(width)
        full = saturated or len(work) >= n_max
        oldest = min(r.enqueued for r, _ in work)
        if not full:
            tightest = min(r.deadline for r, _ in work) - self.predict(work, bucket)
            t = self.window.dispatch_at(now, oldest, len(work), n_max, tightest)
            if t > now:
                if self.hold_since is None:
                    self.hold_since = now
                return WaitUntil(t)
        held = now - self.hold_since if self.hold_since is not None else 0.0
        return PrefillPlan(work, self.name, bucket, waited=held)

    def dispatched(self) -> None:
        self.hold_since = None


class LongPool(_Pool):
    """Long requests; the pool as a whole may be postponed (in favour of short work) at most
    `max_postpone_s` since its last step, and a forced step serves its longest-waiting member.
    `overload` = (requests, budget, check): while more requests than that wait, a step packed
    under that larger budget is taken -- with `check`, only if its bucket pads no more tokens
    than the one-row long-budget chunks that would do the same work (fewer steps once the
    device is behind, not more padding: a wide bucket around several requests' chunks can pad
    more than it saves)."""

    name = LONG

    def __init__(self, grid: BucketGrid, budget: int, aging_tokens_per_s: float,
                 max_postpone_s: float, order: str = "aging",
                 service: Callable[[int], float] | None = None, max_wait_s: float = 2.0,
                 overload: tuple[int | None, int, bool] = (None, 0, True),
                 finish_fill: tuple[Callable[[Work, Bucket], float], float] | None = None):
        super().__init__(grid, budget, aging_tokens_per_s, order, service, max_wait_s)
        self.max_postpone_s = max_postpone_s
        self.finish_fill = finish_fill
        self.last_step: float | None = None  # when the pool last got a step
        self.forced_steps = 0
        self.overload_requests, self.overload_budget, self.overload_check = overload
        self.overload_steps = 0

    def behind(self) -> bool:
        """More requests wait than the overload mark."""
        return self.overload_requests is not None and len(self.reqs) > self.overload_requests

    def add(self, r: Request, now: float) -> None:
        if not self.reqs:
            self.last_step = now  # the postponement clock starts when work arrives
        super().add(r, now)

    def starve_time(self) -> float:
        return (self.last_step or 0.0) + self.max_postpone_s

    def starved(self, now: float) -> Request | None:
        """The longest-unserved member, if the pool has been postponed past the bound."""
        if not self.reqs or now < self.starve_time():
            return None
        return min(self.reqs, key=lambda r: r.last_served)

    def dispatched(self, now: float, forced: bool, overload: bool = False) -> None:
        self.last_step = now
        self.forced_steps += forced
        self.overload_steps += overload

    def plan(self, now: float, first: Request | None = None) -> PrefillPlan | None:
        if not self.reqs:
            return None
        order = self.ordered(now)
        if first is not None:
            order.remove(first)
            order.insert(0, first)
        work, bucket, _ = pack(order, self.grid, self.budget, chunk=True, strict=False)
        if len(work) > 1 and self.finish_fill is not None:
            work, bucket = self._trim(work, bucket)
        plan = PrefillPlan(work, self.name, bucket) if work else None
        if plan is not None and self.behind():
            wide, wide_bucket, _ = pack(order, self.grid, self.overload_budget, chunk=True,
                                        strict=False)
            more = sum(n for _, n in wide) > sum(n for _, n in work)
            if more and (not self.overload_check or self._pads_no_more(wide, wide_bucket)):
                plan = PrefillPlan(wide, self.name, wide_bucket, overload=True)
        if plan is not None:
            plan.forced = first is not None
        return plan

    def _trim(self, work: Work, bucket: Bucket) -> tuple[Work, Bucket]:
        """A step that finishes its first request carries the next requests' tokens only while
        predicted at most the slack slower than that request alone. Past the short cut a
        step's cost per token barely depends on its size, so filling it to the chunk saves
        the others a step's overhead and makes the finishing request wait for their tokens
        (a 200-token turn over a cached history, Qwen2.5-32B on an H200: 18 ms alone, 44 ms
        filled to a 512-token chunk)."""
        predict, slack = self.finish_fill
        first, n = work[0]
        if n < first.remaining:
            return work, bucket
        alone = fits(self.grid, 1, n, self.budget)
        if alone is None:
            return work, bucket
        limit = (1.0 + slack) * predict(work[:1], alone)
        for k in range(len(work), 1, -1):
            b = fits(self.grid, k, max(m for _, m in work[:k]), self.budget)
            if b is not None and predict(work[:k], b) <= limit:
                return work[:k], b
        return work[:1], alone

    def _pads_no_more(self, wide: Work, bucket: Bucket) -> bool:
        """`wide`'s bucket holds no more tokens than the one-row chunks under the long budget
        that would do its work (rows and widths rounded up to their buckets alike)."""
        plain = 0
        for _, n in wide:
            while n > 0:
                piece = min(n, self.budget)
                one = fits(self.grid, 1, piece, self.budget)
                if one is None:
                    return True  # no plain chunk fits: nothing to compare against
                plain, n = plain + one.tokens, n - piece
        return bucket.batch * bucket.tokens <= plain
