"""Scheduler settings and the two prefill policies: mixed (FCFS baseline) and laps (temporal).

A planner owns the waiting prefill work of one device group and answers one question at each
step boundary: what prefill to run now (`PrefillPlan`), or until when to wait (`WaitUntil`), or
nothing. Decode interleaving is the lane's business, not the planner's. Planners read the time
only from the `now` they are given, so tests drive them with any clock.

laps order of precedence: a long step when the long pool has had none for `max_postpone_s`
(short work can postpone long work only that long: no starvation); then a short batch that is
ready (bucket full, window over, or a deadline close) -- or, with cross_pool="aging", the long
pool instead when its best request already scores lower; while a short window is open the device
waits for it; otherwise a long chunk. Inside each pool work is ordered by remaining work with
aging (a first analysis found the order inside the pools matters as much as the split): by
default fewest remaining tokens first with a wait bound (pools.py; chosen by an A/B of the
orders in one run on both traces, docs/BENCHMARKS_SCHEDULER.md), or highest response
ratio first, or remaining tokens minus a linear credit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from laps_jax.engine.buckets import Bucket, BucketGrid
from laps_jax.engine.packing import fits
from laps_jax.scheduler.latency_model import LatencyModel, StepShape
from laps_jax.scheduler.pools import (LongPool, PrefillPlan, ShortPool, SingleQueue, WaitUntil,
                                      Work)
from laps_jax.scheduler.request import LONG, SHORT, Request
from laps_jax.scheduler.window import WaitingWindow, WindowConfig

MODES = ("mixed", "laps", "laps-spatial")
ORDERS = ("fcfs", "ratio", "aging", "srpt")


@dataclasses.dataclass
class SchedulerConfig:
    """Every knob of the dispatcher; None means "derive from the latency model". Its
    command-line flags are declared in flags.py."""

    threshold: int | None = None          # short/long cut in new tokens (None: model's crossover)
    window: WindowConfig = dataclasses.field(default_factory=WindowConfig)
    budget_tokens: int | None = None      # padded tokens per prefill step (None: grid's budget)
    long_budget_tokens: int | None = None  # laps long-pool chunk budget (None: long_chunk_ratio)
    long_chunk_ratio: float | None = 5.0  # laps: the widest chunk predicted to take at most this
                                          # many cheapest prefill steps (None: budget_tokens)
    overload_requests: int | None = 4     # laps: while more than this many long requests
                                          # wait, long steps may take twice the long chunk
                                          # (the device is behind: efficiency first; None:
                                          # never)
    overload_check: bool = True           # ... only where that pads no more tokens than
                                          # the long chunks it replaces (False: always)
    max_postpone_s: float | None = None   # starvation bound of the long pool
    aging_tokens_per_s: float | None = None  # credit per second waited, in tokens
    aging_fraction: float = 0.25          # default aging: this share of a long chunk's tokens/s
    max_padding: float = 0.5              # largest padded share a batch may grow to
    decode_gap_s: float | None = None     # prefill may hold decode back this long (None: one
                                          # full-budget prefill step with a model, else 0)
    cross_pool: str = "short-first"       # "short-first": a ready short batch runs first;
                                          # "aging": it yields to a long request scoring lower
    order: str = "srpt"                   # in-pool order: "srpt" (fewest remaining; see
                                          # max_wait_s), "ratio" (response ratio) or "aging"
    long_order: str | None = None         # laps' long pool alone (None: `order`), e.g.
                                          # "ratio": the largest prompts age instead of
                                          # waiting for every smaller one
    max_wait_s: float | None = None       # srpt: a request waiting this long goes first
                                          # (None: 16 long chunks as predicted)
    queue_order: str = "fcfs"             # mixed's one queue: "fcfs" (the paper's baseline),
                                          # or "ratio" (HRRN), "srpt", "aging" as in the pools
    fallback_threshold: int = 256         # used when there is no latency model
    kv_handoff: bool = True               # laps-spatial: long prefills decode in the short
                                          # group (K/V copied over); False: where prefilled
    fill_rows: bool = True                # laps: a short batch's empty bucket rows carry long
                                          # chunks (compute the bucket pays for anyway)
    fill_slack: float = 0.1               # ... and it grows into a bucket of more rows for
                                          # them while predicted at most this much slower
    finish_slack: float | None = 0.1      # laps: a long step that finishes its first request
                                          # takes others' tokens only while predicted at most
                                          # this much slower than it alone (None: filled to
                                          # the chunk; no effect without a latency model)


@dataclasses.dataclass
class Derived:
    """Settings resolved against a grid and a latency model (what the pools actually use)."""

    threshold: Callable[[int], int]
    budget: int
    long_budget: int
    max_postpone_s: float
    aging: float
    predict: Callable[[Work, Bucket], float]
    window: WindowConfig
    cross_pool: str = "short-first"
    order: str = "aging"
    service: Callable[[int], float] | None = None
    decode_gap_s: float = 0.0
    max_wait_s: float = 2.0
    fill_rows: bool = False
    fill_slack: float | None = None  # None: no latency model, never grow
    overload_requests: int | None = None  # long requests waiting past which long steps
                                          # may take `overload_budget` (None: never)
    overload_budget: int = 0
    overload_check: bool = True
    queue_order: str = "fcfs"  # mixed's one queue
    long_order: str | None = None  # laps' long pool (None: `order`)
    finish_slack: float | None = None  # None: long steps filled to the chunk

    def is_short(self, new_tokens: int, cached: int = 0) -> bool:
        """The short/long cut, the one place it is made: lanes, the spatial route and the
        router all ask this."""
        return new_tokens <= self.threshold(cached)


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def check(cfg: SchedulerConfig) -> None:
    """Raises ValueError naming the first setting out of range (before anything runs)."""
    if cfg.cross_pool not in ("aging", "short-first"):
        raise ValueError(f"cross_pool must be aging or short-first, got {cfg.cross_pool!r}")
    if cfg.aging_tokens_per_s is not None and not cfg.aging_tokens_per_s >= 0:
        raise ValueError(f"aging_tokens_per_s must be >= 0, got {cfg.aging_tokens_per_s}")
    if cfg.order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {cfg.order!r}")
    if cfg.long_order is not None and cfg.long_order not in ORDERS:
        raise ValueError(f"long_order must be one of {', '.join(ORDERS)}, "
                         f"got {cfg.long_order!r}")
    if cfg.queue_order not in ORDERS:
        raise ValueError(f"queue_order must be one of {', '.join(ORDERS)}, "
                         f"got {cfg.queue_order!r}")
    if cfg.max_wait_s is not None and not cfg.max_wait_s > 0:
        raise ValueError(f"max_wait_s must be > 0, got {cfg.max_wait_s}")
    if cfg.long_chunk_ratio is not None and not cfg.long_chunk_ratio > 0:
        raise ValueError(f"long_chunk_ratio must be > 0, got {cfg.long_chunk_ratio}")
    if cfg.overload_requests is not None and not cfg.overload_requests >= 0:
        raise ValueError(f"overload_requests must be >= 0, got {cfg.overload_requests}")
    if cfg.finish_slack is not None and not cfg.finish_slack >= 0:
        raise ValueError(f"finish_slack must be >= 0 or None, got {cfg.finish_slack}")
    if not cfg.fill_slack >= 0:
        raise ValueError(f"fill_slack must be >= 0, got {cfg.fill_slack}")


# laps overload steps: at most this many long chunks' tokens (bench-cpu: 2 x 256 = its budget)
OVERLOAD_WIDEN = 2


def derive(cfg: SchedulerConfig, grid: BucketGrid, model: LatencyModel | None) -> Derived:
    check(cfg)
    budget = cfg.budget_tokens or grid.max_batch_tokens
    window = dataclasses.replace(cfg.window)
    overload = lambda long_budget: dict(
        queue_order=cfg.queue_order, long_order=cfg.long_order,
        overload_requests=None if long_budget >= budget else cfg.overload_requests,
        overload_budget=min(budget, OVERLOAD_WIDEN * long_budget),
        overload_check=cfg.overload_check)
    if model is None:
        long_budget = cfg.long_budget_tokens or budget
        fixed = min(cfg.threshold or cfg.fallback_threshold, grid.max_chunk)
        return Derived(lambda c: fixed, budget, long_budget, _given(cfg.max_postpone_s, 1.0),
                       _given(cfg.aging_tokens_per_s, 2000.0), lambda w, b: 0.0, window,
                       cfg.cross_pool, cfg.order, decode_gap_s=cfg.decode_gap_s or 0.0,
                       max_wait_s=_given(cfg.max_wait_s, 2.0), fill_rows=cfg.fill_rows,
                       **overload(long_budget))

    step = lambda n: model.predict(StepShape.exact((min(n, grid.max_chunk),)))
    long_budget = cfg.long_budget_tokens or long_chunk(grid, budget, step, cfg.long_chunk_ratio)
    full = step(long_budget)
    # a request gains `aging_fraction` of a long chunk's worth of tokens per chunk it waits
    # (0 is a setting: no aging, i.e. shortest remaining first; no postponement)
    aging = _given(cfg.aging_tokens_per_s, cfg.aging_fraction * long_budget / full)
    postpone = _given(cfg.max_postpone_s, 8.0 * full)
    if window.max_s is None:  # wait at most half the cheapest step: never worse than 1.5x it
        smallest = grid.prefill_buckets()[0]
        window.max_s = 0.5 * model.predict(StepShape.exact((smallest.tokens,)))

    if cfg.threshold is not None:
        fixed = min(cfg.threshold, grid.max_chunk)
        threshold = lambda c: fixed
    else:
        @functools.lru_cache(maxsize=256)
        def by_block(block: int) -> int:
            return min(model.threshold(block * 256), grid.max_chunk)
        threshold = lambda c: by_block(c // 256)

    def predict(work: Work, bucket: Bucket) -> float:
        return model.predict(StepShape.bucketed([n for _, n in work],
                                                [r.seq.num_computed for r, _ in work],
                                                bucket.batch, bucket.tokens))
    per_token = (full - model.device.step_overhead_s) / min(long_budget, grid.max_chunk)
    service = lambda n: model.device.step_overhead_s + n * per_token
    # Decode waits for at most one full-budget prefill step: the same inter-token bound in every
    # mode, so a policy that runs more, smaller prefill steps (short batches, smaller long
    # chunks) does not also pay for more decode steps.
    gap = step(budget) if cfg.decode_gap_s is None else cfg.decode_gap_s
    return Derived(threshold, budget, long_budget, postpone, aging, predict, window,
                   cfg.cross_pool, cfg.order, service, gap,
                   max_wait_s=_given(cfg.max_wait_s, 16.0 * full), fill_rows=cfg.fill_rows,
                   fill_slack=cfg.fill_slack, finish_slack=cfg.finish_slack,
                   **overload(long_budget))


def long_chunk(grid: BucketGrid, budget: int, step: Callable[[int], float],
               ratio: float | None) -> int:
    """The laps long-pool budget: the widest bucket width (at most `budget`) predicted to take
    at most `ratio` times the cheapest prefill step. A short request that arrives while a long
    chunk runs waits that chunk out, and its TTFT SLO is a multiple of its own isolated
    prefill; so the chunk is sized by the cheapest step, not by throughput alone. Past the
    compute-bound point a chunk's cost per token barely depends on its size, so this costs
    little: Qwen2.5-32B on an H200 (roofline) gets 512 of a 2048 budget, bench-cpu on this
    2-core CPU 256 of 512. Near saturation the small chunks' extra steps cost more than their
    shorter stalls save (bench-cpu: ~5% more device time for the same tokens), so while more
    than `overload_requests` long requests wait the pool may take steps of up to
    `OVERLOAD_WIDEN` chunks, each only if it pads no more tokens than the chunks it replaces.
    A queue of requests, not of tokens: one huge prompt is not an overload (on the sessions
    trace a token mark made short requests miss their SLO at light load). Twice the chunk,
    not the full budget, and the padding check: on the H200 roofline, full-budget steps (4
    chunks) packed padded buckets around several requests and made laps' mean prefill 3.5x
    worse at load 0.8 (docs/SIMULATION.md, "Qwen2.5-32B on H200")."""
    if ratio is None:
        return budget
    widths = [t for t in grid.prefill_tokens if t <= budget] or [budget]
    cap = ratio * step(widths[0])
    return max([t for t in widths if step(t) <= cap] or [widths[0]])


class MixedPlanner:
    """One queue for all prefill work: FCFS by default (the baseline every LAPS claim is
    measured against), or ordered like a pool (`queue_order`) with the same service estimate
    and wait bound as the pools: the same engine, budget and buckets, only the order differs."""

    def __init__(self, grid: BucketGrid, d: Derived):
        self.queue = SingleQueue(grid, d.budget, d.aging, d.queue_order, d.service, d.max_wait_s)
        self.window = None

    def add(self, r: Request, now: float) -> None:
        self.queue.add(r, now)

    def remove(self, r: Request) -> None:
        self.queue.remove(r)

    def plan(self, now: float) -> PrefillPlan | WaitUntil | None:
        return self.queue.plan(now)

    def dispatched(self, plan: PrefillPlan, now: float) -> None:
        pass

    def queue_lengths(self) -> dict[str, int]:
        return {"mixed": len(self.queue)}

    def pending_tokens(self) -> dict[str, int]:
        return {"mixed": self.queue.pending_tokens()}


class LapsPlanner:
    """Short pool first behind its waiting window, long chunks between, starvation bound."""

    def __init__(self, grid: BucketGrid, d: Derived):
        self.window = WaitingWindow(d.window)
        self.short = ShortPool(grid, d.budget, d.aging, self.window, d.predict, d.order,
                               d.service, d.max_wait_s)
        self.long = LongPool(grid, d.long_budget, d.aging, d.max_postpone_s,
                             d.long_order or d.order, d.service,
                             d.max_wait_s, overload=(d.overload_requests, d.overload_budget,
                                                     d.overload_check),
                             finish_fill=None if d.finish_slack is None
                             else (d.predict, d.finish_slack))
        self.cross_pool, self.fill_rows, self.fill_slack = d.cross_pool, d.fill_rows, d.fill_slack

    def add(self, r: Request, now: float) -> None:
        (self.short if r.stats.pool == SHORT else self.long).add(r, now)

    def remove(self, r: Request) -> None:
        self.short.remove(r)
        self.long.remove(r)

    def plan(self, now: float) -> PrefillPlan | WaitUntil | None:
        starved = self.long.starved(now)
        if starved is not None:
            return self.long.plan(now, first=starved)
        s = self.short.plan(now)
        if isinstance(s, PrefillPlan):
            if self.cross_pool == "aging" and len(self.long):
                head = self.long.ordered(now)[0]
                if self.long.score(head, now) < min(self.short.score(r, now) for r, _ in s.work):
                    return self.long.plan(now)
            return self._fill(s, now) if self.fill_rows else s
        if isinstance(s, WaitUntil):
            return WaitUntil(min(s.t, self.long.starve_time())) if len(self.long) else s
        return self.long.plan(now)

    def _fill(self, s: PrefillPlan, now: float) -> PrefillPlan:
        """Long chunks in the short batch's step, each up to the bucket's width, in the long
        pool's order: in the bucket rows the batch leaves empty (a 3-row batch in a 4 x 64
        bucket pays for 4 x 64 tokens anyway), and, with a latency model, in a bucket of more
        rows while the step is predicted at most `fill_slack` slower: a memory-bound step (a
        GPU's short batch) takes more rows almost free; on this CPU a row costs its tokens and
        nothing grows. Not a long step: the postponement clock keeps running."""
        if not len(self.long):
            return s
        heads, width, rows = self.long.ordered(now), s.bucket.tokens, len(s.work)
        bucket = s.bucket
        if self.fill_slack is not None:
            limit = (1.0 + self.fill_slack) * self.short.predict(s.work, s.bucket)
            for k in range(s.bucket.batch + 1, rows + len(heads) + 1):
                b = fits(self.short.grid, k, width, self.short.budget)
                if b is None or b.tokens != width:
                    break
                more = [(r, min(r.remaining, width)) for r in heads[:k - rows]]
                if self.short.predict(s.work + more, b) > limit:
                    break
                bucket = b
        extra = [(r, min(r.remaining, width)) for r in heads[:bucket.batch - rows]]
        extra = [(r, n) for r, n in extra if n > 0]
        if not extra:
            return s
        return dataclasses.replace(s, work=s.work + extra, bucket=bucket,
                                   filled_tokens=sum(n for _, n in extra))

    def dispatched(self, plan: PrefillPlan, now: float) -> None:
        """The lane runs `plan` now: a long step resets the postponement clock."""
        if plan.pool == LONG:
            self.long.dispatched(now, plan.forced, plan.overload)
        elif plan.pool == SHORT:
            self.window.record(plan.waited)
            self.short.dispatched()

    def queue_lengths(self) -> dict[str, int]:
        return {SHORT: len(self.short), LONG: len(self.long)}

    def pending_tokens(self) -> dict[str, int]:
        return {SHORT: self.short.pending_tokens(), LONG: self.long.pending_tokens()}


def make_planner(mode: str, grid: BucketGrid, d: Derived):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return MixedPlanner(grid, d) if mode == "mixed" else LapsPlanner(grid, d)
