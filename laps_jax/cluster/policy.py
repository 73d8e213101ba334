"""The routing policy: which instance gets a request, from numbers any front end can supply.

- `round-robin`: plain data parallelism.
- `least-load`: the instance with the least pending prefill work.
- `laps`: the instance where the request is predicted to finish its prefill first,
  with short and long groups sized by their share of the compute, an idle instance taking the
  other group's work, and moves with hysteresis, dwell and draining (`laps_rule.py`,
  `groups.py`).
- `laps-adaptive`: laps with the load-adaptive rule (`laps_rule.py`: recomputed history
  weighs double once every instance queues; once every instance is three chunks behind, the
  gateway's cache-aware rule by requests in flight; a one-chunk long request waits for the
  chunk in progress).
- `laps-inflow` (router.py's default): laps-adaptive without the gateway's rule deep in
  the queue; instead a long request's predicted finish counts the smaller long work that will
  arrive and overtake it (`inflow.py`), and once every instance has short work pending a
  short request waits for that short work, not a long chunk (`laps_rule.py`). Needs the load
  in seconds or each instance's seconds per unit (`unit_s`) for the inflow; without them (a
  network router before any streamed request has measured a pace) it cannot price the inflow
  and takes laps-adaptive's switch instead.
- `bucket`: contiguous prompt-length ranges per instance, moved every few seconds so each
  range gets the same share of the recent work, as the SGLang Model Gateway's `bucket` policy
  does (`bucket.py`).
- `prefix`: a cache-aware baseline that decides as the SGLang Model Gateway's `cache_aware`
  does (`cache_aware.py`).
- `length-aware` (the LAPS reference router, kept for the committed study): instances form a short group and a long group. A request is short when
  its new tokens after the best prefix-cache match are at or under the threshold; it goes to the
  least-loaded instance of its group, unless an instance of the other group has less pending
  work by more than `spill_s` (default: one full prefill step): then it goes there, so that a
  group never idles while the other queues (`spill_s=inf` is the strict reference policy).
  Every `rebalance_interval_s` the policy compares the pending work per instance of the two
  groups, and when one exceeds `rebalance_ratio` x the other it moves one instance over (each
  group keeps at least one; at most one move per interval), as the LAPS reference router does
  with its pending counts.

round-robin, least-load and length-aware share one prefix-affinity rule (unless `affinity_ratio` is None): a request whose
prompt is at least that share cached on some instance goes there, since anywhere else it would
recompute its history. So those three differ only in where uncached work goes; `laps` weighs the history
against the load instead, and `prefix` has the gateway's own rule.

Load is pending prefill work in the caller's units (predicted seconds with a latency model);
the policy never measures anything itself, so the in-process router and a network router feed
it alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence as Seq

from laps_jax.cluster.bucket import Buckets, BucketSettings
from laps_jax.cluster.cache_aware import CacheAwareSettings, pick_cache_aware
from laps_jax.cluster.groups import Groups, GroupSettings
from laps_jax.cluster.inflow import RecentLongWork
from laps_jax.cluster.laps_rule import (LapsDecision, LapsInputs, every_instance_behind,
                                        pick_laps)
from laps_jax.scheduler.request import LONG, SHORT

POLICIES = ("round-robin", "least-load", "length-aware", "laps", "prefix", "bucket",
            "laps-adaptive", "laps-inflow")
LAPS = ("laps", "laps-adaptive", "laps-inflow")


@dataclasses.dataclass
class RouterConfig:
    policy: str = "length-aware"
    affinity_ratio: float | None = 0.5   # cached share of the prompt that pins it (None: off)
    short_fraction: float = 0.5          # initial share of instances in the short group
    rebalance_interval_s: float = 5.0
    rebalance_ratio: float = 2.0
    threshold: int | None = None         # None: the instances' own (latency-model) threshold
    spill_s: float | None = None         # cross-group margin (None: one full step; inf: never)
    groups: GroupSettings = dataclasses.field(default_factory=GroupSettings)  # laps
    cross_s: float = 0.0                 # laps: margin for short work on a long instance
    harm: float = 1.0                    # laps: weight of the delay a request adds to larger
                                         # ones and of the history it recomputes off its holder
    cache_aware: CacheAwareSettings = dataclasses.field(default_factory=CacheAwareSettings)
    bucket: BucketSettings = dataclasses.field(default_factory=BucketSettings)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclasses.dataclass
class RouterStats:
    routed: list[int]
    by_affinity: int = 0
    spilled: int = 0
    moves: int = 0
    behind: int = 0   # laps-adaptive: decided by requests in flight, every instance behind
    groups: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)  # t, short, long


@dataclasses.dataclass
class Choice:
    """Where a request goes, and its new and cached tokens there."""

    instance: int
    new_tokens: int
    cached_tokens: int
    short: bool
    long_record: tuple | None = None  # laps-inflow: its count in the recent long work


class RoutingPolicy:
    """One of `POLICIES` over `n` instances. `is_short(new, cached)` is the instances' own
    short/long cut (overridden by `config.threshold`); `full_step_s` is one full prefill step
    in load units (the default cross-group margin); `chunk_s` the long chunk a short request
    may wait out on an instance with long work (laps; default a quarter step); `cost(new,
    cached, short)` a request's predicted prefill in load units (laps; default: new tokens)."""

    def __init__(self, n: int, config: RouterConfig, is_short: Callable[[int, int], bool],
                 full_step_s: float, chunk_s: float | None = None,
                 cost: Callable[[int, int, bool], float] | None = None):
        if n < 1:
            raise ValueError("a router needs at least one instance")
        self.n, self.config = n, config
        t = config.threshold
        self.is_short = is_short if t is None else (lambda new, cached: new <= t)
        self.groups = Groups.split(n, config.short_fraction, config.groups)
        self.group = self.groups.group  # one list: laps' moves show here too
        self.stats = RouterStats([0] * n)
        self.spill_s = full_step_s if config.spill_s is None else config.spill_s
        self.chunk_s = full_step_s / 4 if chunk_s is None else chunk_s
        self.cost = cost or (lambda new, cached, short: float(new))
        self.buckets = Buckets(n, config.bucket)
        self.recent_long = RecentLongWork()  # laps-inflow: the long work routed lately
        self._rr = 0
        self._last_rebalance: float | None = None

    def group_sizes(self) -> tuple[int, int]:
        s = sum(g == SHORT for g in self.group)
        return s, len(self.group) - s

    def choose(self, prompt_len: int, cached: Seq[int], loads: Seq[float], now: float,
               eligible: Seq[bool] | None = None, short_loads: Seq[float] | None = None,
               inflight: Seq[int] | None = None,
               long_items: Seq[Seq[float]] | None = None,
               decode_step: Seq[float] | None = None,
               chunk: Seq[float] | None = None,
               speed: Seq[float] | None = None,
               unit_s: Seq[float] | None = None) -> Choice:
        """The instance for a prompt of `prompt_len` tokens, given each instance's cached
        prefix of it and its pending prefill work. `eligible` (default: all) leaves out the
        instances that cannot take work now (a network router's unhealthy or full ones); with
        every instance eligible the choice is the same as without it. `short_loads`: the part
        of each load that is short work (laps; default none); `inflight`: requests in flight
        on each instance (prefix; default: none); `long_items`: each instance's pending long
        requests' remaining work (laps; default: only their sum is known); `decode_step`: one
        decode step's work on each instance, 0 where nothing decodes (laps; default: unknown);
        `chunk`: each instance's own long chunk (laps; default: `chunk_s` for all); `speed`:
        how slow each instance runs now against the others (laps; default: alike);
        `unit_s`: seconds per load unit on each instance (laps-inflow; default: unknown, and
        laps-inflow takes laps-adaptive's switch instead of pricing the inflow)."""
        if eligible is not None and not any(eligible):
            raise ValueError("no eligible instance")
        ok = (lambda k: True) if eligible is None else (lambda k: bool(eligible[k]))
        p = self.config.policy
        prices_inflow = p == "laps-inflow" and unit_s is not None
        switch = p == "laps-adaptive" or (p == "laps-inflow" and not prices_inflow)
        short = record = None
        if switch and self.n > 1 and inflight is not None and \
                every_instance_behind(loads, chunk or [self.chunk_s] * self.n,
                                      [ok(k) for k in range(self.n)]):
            i, short = self._pick_far_behind(prompt_len, cached, inflight, ok, now)
        elif p in LAPS and self.n > 1:
            d = self._pick_laps(prompt_len, cached, loads, now, ok, short_loads, long_items,
                                decode_step, chunk, speed, unit_s if prices_inflow else None)
            i, short = d.instance, d.short
            if p == "laps-inflow" and not d.short:
                record = self.recent_long.record(now, d.instance, d.cost)
        elif p == "prefix":
            i = self._pick_cache_aware(prompt_len, cached, inflight or [0] * self.n, ok)
        elif p == "bucket":
            i, by_balance = self.buckets.pick(prompt_len, self.cost(prompt_len, 0, False), loads,
                                              now, ok, self.spill_s)
            self.stats.spilled += by_balance
        else:
            i = self._pick(prompt_len, cached, loads, now, ok)
        self.stats.routed[i] += 1
        new = prompt_len - cached[i]
        if short is None:
            short = self.is_short(new, cached[i])
        return Choice(i, new, cached[i], short, record)

    def withdraw(self, choice: Choice) -> None:
        """The request of `choice` left its instance for another (the instance failed before
        its answer ended): laps-inflow stops counting it as long work sent there, which no
        request on that instance will wait behind."""
        if choice.long_record is not None:
            self.recent_long.withdraw(choice.long_record)

    def _pick_far_behind(self, prompt_len: int, cached: Seq[int], inflight: Seq[int],
                         ok: Callable[[int], bool], now: float) -> tuple[int, bool]:
        """laps-adaptive with every instance far behind: the gateway's rule places the request,
        and the groups still count its work, as `pick_laps` counts its own choices.
        (instance, short)"""
        i = self._pick_cache_aware(prompt_len, cached, inflight, ok)
        self.stats.behind += 1
        new = max(prompt_len - cached[i], 1)
        short = self.is_short(new, cached[i])
        self.groups.observe(SHORT if short else LONG, self.cost(new, cached[i], short), now)
        return i, short

    def _pick_cache_aware(self, prompt_len: int, cached: Seq[int], inflight: Seq[int],
                          ok: Callable[[int], bool]) -> int:
        i, by_cache = pick_cache_aware(prompt_len, cached, inflight, self.stats.routed, ok,
                                       self.config.cache_aware)
        self.stats.by_affinity += by_cache
        return i

    def _pick(self, prompt_len: int, cached: Seq[int], loads: Seq[float], now: float,
              ok: Callable[[int], bool]) -> int:
        best = max((i for i in range(self.n) if ok(i)), key=lambda i: cached[i])
        c = cached[best]
        ratio = self.config.affinity_ratio
        if ratio is not None and c > 0 and c >= ratio * prompt_len:
            self.stats.by_affinity += 1
            return best
        p = self.config.policy
        if p == "round-robin":
            i = self._rr
            while not ok(i):
                i = (i + 1) % self.n
            self._rr = (i + 1) % self.n
            return i
        if p == "least-load" or self.n == 1:
            return self._least_loaded([i for i in range(self.n) if ok(i)], loads)
        self._maybe_rebalance(loads, now, ok)
        want = SHORT if self.is_short(prompt_len - c, c) else LONG
        members = [k for k, g in enumerate(self.group) if g == want and ok(k)]
        others = [k for k, g in enumerate(self.group) if g != want and ok(k)]
        if not members:  # (only when some are not eligible) the other group takes it
            return self._least_loaded(others, loads)
        i = self._least_loaded(members, loads)
        if others and self.spill_s < float("inf"):
            j = min(others, key=lambda k: loads[k])
            if loads[j] + self.spill_s < loads[i]:
                self.stats.spilled += 1
                return j
        return i

    def _pick_laps(self, prompt_len: int, cached: Seq[int], loads: Seq[float], now: float,
                   ok: Callable[[int], bool], short_loads: Seq[float] | None,
                   long_items: Seq[Seq[float]] | None = None,
                   decode_step: Seq[float] | None = None,
                   chunk: Seq[float] | None = None,
                   speed: Seq[float] | None = None,
                   unit_s: Seq[float] | None = None) -> LapsDecision:
        """laps and its variants; `unit_s` given: laps-inflow, pricing the inflow."""
        before = len(self.groups.moves)
        p = self.config.policy
        inflow = None
        if unit_s is not None:
            inflow = lambda k, work: self.recent_long.rho(k, work, now, unit_s[k])
        inp = LapsInputs(prompt_len, cached, loads,
                         [0.0] * self.n if short_loads is None else short_loads,
                         [ok(k) for k in range(self.n)], long_items, decode_step, chunk, speed,
                         inflow)
        d = pick_laps(inp, self.groups, now, self.is_short, self.cost, self.chunk_s,
                      self.spill_s, self.config.cross_s, lambda k: (k - self._rr) % self.n,
                      self.config.harm, adaptive=p != "laps",
                      busy_shorts=p == "laps-inflow")
        self._rr = (d.instance + 1) % self.n
        for _ in self.groups.moves[before:]:
            self.stats.moves += 1
            self.stats.groups.append((now, *self.group_sizes()))
        self.stats.spilled += d.cross
        return d

    def draining(self) -> list[bool]:
        """laps: the instances finishing their old kind of work after a move."""
        return list(self.groups.draining)

    def _least_loaded(self, members: Seq[int], loads: Seq[float]) -> int:
        order = sorted(members, key=lambda i: (loads[i], (i - self._rr) % self.n))
        self._rr = (order[0] + 1) % self.n
        return order[0]

    def _maybe_rebalance(self, loads: Seq[float], now: float, ok: Callable[[int], bool]
                         ) -> None:
        cfg = self.config
        if self._last_rebalance is not None and \
                now - self._last_rebalance < cfg.rebalance_interval_s:
            return
        self._last_rebalance = now
        members = {g: [i for i, x in enumerate(self.group) if x == g and ok(i)]
                   for g in (SHORT, LONG)}  # (eligible ones: each group keeps one)
        per = {g: sum(loads[i] for i in m) / len(m) for g, m in members.items() if m}
        if len(per) < 2:
            return
        for hot, cold in ((SHORT, LONG), (LONG, SHORT)):
            if per[hot] > cfg.rebalance_ratio * per[cold] and len(members[cold]) > 1:
                mover = min(members[cold], key=lambda i: loads[i])  # least to drain
                self.group[mover] = hot
                self.stats.moves += 1
                self.stats.groups.append((now, *self.group_sizes()))
                return
