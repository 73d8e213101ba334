"""The routing policy: which instance gets a request, from numbers any front end can supply.

- `round-robin`: plain data parallelism.
- `least-load`: the instance with the least pending prefill work.
- `length-aware` (LAPS): instances form a short group and a long group. A request is short when
  its new tokens after the best prefix-cache match are at or under the threshold; it goes to the
  least-loaded instance of its group, unless an instance of the other group has less pending
  work by more than `spill_s` (default: one full prefill step): then it goes there, so that a
  group never idles while the other queues (`spill_s=inf` is the strict reference policy).
  Every `rebalance_interval_s` the policy compares the pending work per instance of the two
  groups, and when one exceeds `rebalance_ratio` x the other it moves one instance over (each
  group keeps at least one; at most one move per interval), as the LAPS reference router does
  with its pending counts.

All policies share one prefix-affinity rule (unless `affinity_ratio` is None): a request whose
prompt is at least that share cached on some instance goes there, since anywhere else it would
recompute its history. So the policies differ only in where uncached work goes.

Load is pending prefill work in the caller's units (predicted seconds with a latency model);
the policy never measures anything itself, so the in-process router and a network router feed
it alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence as Seq

from laps_jax.scheduler.request import LONG, SHORT

POLICIES = ("round-robin", "least-load", "length-aware")


@dataclasses.dataclass
class RouterConfig:
    policy: str = "length-aware"
    affinity_ratio: float | None = 0.5   # cached share of the prompt that pins it (None: off)
    short_fraction: float = 0.5          # initial share of instances in the short group
    rebalance_interval_s: float = 5.0
    rebalance_ratio: float = 2.0
    threshold: int | None = None         # None: the instances' own (latency-model) threshold
    spill_s: float | None = None         # cross-group margin (None: one full step; inf: never)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclasses.dataclass
class RouterStats:
    routed: list[int]
    by_affinity: int = 0
    spilled: int = 0
    moves: int = 0
    groups: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)  # t, short, long


@dataclasses.dataclass
class Choice:
    """Where a request goes, and its new and cached tokens there."""

    instance: int
    new_tokens: int
    cached_tokens: int
    short: bool


class RoutingPolicy:
    """One of `POLICIES` over `n` instances. `is_short(new, cached)` is the instances' own
    short/long cut (overridden by `config.threshold`); `full_step_s` is one full prefill step
    in load units (the default cross-group margin)."""

    def __init__(self, n: int, config: RouterConfig, is_short: Callable[[int, int], bool],
                 full_step_s: float):
        if n < 1:
            raise ValueError("a router needs at least one instance")
        self.n, self.config = n, config
        t = config.threshold
        self.is_short = is_short if t is None else (lambda new, cached: new <= t)
        n_short = min(max(1, round(n * config.short_fraction)), n - 1) if n > 1 else 1
        self.group = [SHORT if i < n_short else LONG for i in range(n)]
        self.stats = RouterStats([0] * n)
        self.spill_s = full_step_s if config.spill_s is None else config.spill_s
        self._rr = 0
        self._last_rebalance: float | None = None

    def group_sizes(self) -> tuple[int, int]:
        s = sum(g == SHORT for g in self.group)
        return s, len(self.group) - s

    def choose(self, prompt_len: int, cached: Seq[int], loads: Seq[float], now: float,
               eligible: Seq[bool] | None = None) -> Choice:
        """The instance for a prompt of `prompt_len` tokens, given each instance's cached
        prefix of it and its pending prefill work. `eligible` (default: all) leaves out the
        instances that cannot take work now (a network router's unhealthy or full ones); with
        every instance eligible the choice is the same as without it."""
        if eligible is not None and not any(eligible):
            raise ValueError("no eligible instance")
        i = self._pick(prompt_len, cached, loads, now,
                       (lambda k: True) if eligible is None else (lambda k: bool(eligible[k])))
        self.stats.routed[i] += 1
        new = prompt_len - cached[i]
        return Choice(i, new, cached[i], self.is_short(new, cached[i]))

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
