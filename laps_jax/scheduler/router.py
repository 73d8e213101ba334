"""A router in front of several instances (dispatchers): round-robin, least-load, length-aware.

    router = Router([d0, d1, d2, d3], RouterConfig(policy="length-aware"))
    await router.start()
    handle = router.submit(prompt_ids, params, slo=0.5)   # same API as Dispatcher.submit
    await router.stop()

- `round-robin`: plain data parallelism.
- `least-load`: the instance with the least pending prefill work (predicted seconds of prefill
  routed to it and not done yet, partly done requests counted by what is left).
- `length-aware` (LAPS): instances form a short group and a long group. A request is short when
  its new tokens after the best prefix-cache match are at or under the threshold; it goes to the
  least-loaded instance of its group, unless an instance of the other group has less pending
  work by more than `spill_s` (default: one full prefill step): then it goes there, so that a
  group never idles while the other queues (`spill_s=inf` is the strict reference policy).
  Every `rebalance_interval_s` the router compares the
  pending work per instance of the two groups, and when one exceeds `rebalance_ratio` x the
  other it moves one instance over (each group keeps at least one; at most one move per
  interval), as the LAPS reference router does with its pending counts.

All policies share one prefix-affinity rule (unless `affinity_ratio` is None): a request whose
prompt is at least that share cached on some instance goes there, since anywhere else it would
recompute its history. So the policies differ only in where uncached work goes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Seq

from laps_jax.engine.kv_cache import block_hash
from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler.clock import Clock
from laps_jax.scheduler.dispatcher import Dispatcher
from laps_jax.scheduler.latency_model import StepShape
from laps_jax.scheduler.request import LONG, SHORT, Request, RequestHandle

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


def _kv(dispatcher: Dispatcher):
    """The prefix caches an instance's lanes hold (None when an executor does not expose one)."""
    kvs = [getattr(getattr(lane.executor, "engine", None), "kv", None) for lane in dispatcher.lanes]
    return None if any(k is None for k in kvs) else kvs


def cached_prefixes(prompt: Seq[int], dispatchers: Seq[Dispatcher]) -> list[int]:
    """Prompt tokens each instance's prefix cache holds now (best lane). Hashes the prompt once,
    and only as far as some instance still matches (read-only: nothing is pinned)."""
    kvs = [_kv(d) for d in dispatchers]
    if any(k is None for k in kvs) or len({k.page_size for ks in kvs for k in ks}) != 1:
        return [max(l.executor.cached_prefix(prompt) for l in d.lanes) for d in dispatchers]
    ps = kvs[0][0].page_size
    best = [0] * len(dispatchers)
    alive = {(i, j) for i, ks in enumerate(kvs) for j, k in enumerate(ks) if k.enable_prefix_cache}
    parent = b""
    for b in range((len(prompt) - 1) // ps):
        if not alive:
            break
        parent = block_hash(parent, prompt[b * ps:(b + 1) * ps])
        for i, j in list(alive):
            if parent in kvs[i][j].by_hash:
                best[i] = max(best[i], (b + 1) * ps)
            else:
                alive.discard((i, j))
    return best


class Router:
    def __init__(self, dispatchers: Seq[Dispatcher], config: RouterConfig | None = None,
                 clock: Clock | None = None,
                 cost: Callable[[int, int, bool], float] | None = None):
        if not dispatchers:
            raise ValueError("a router needs at least one instance")
        self.d = list(dispatchers)
        self.config = config or RouterConfig()
        self.clock = clock or self.d[0].clock
        self.cost = cost or self._default_cost
        n = len(self.d)
        n_short = min(max(1, round(n * self.config.short_fraction)), n - 1) if n > 1 else 1
        self.group = [SHORT if i < n_short else LONG for i in range(n)]
        self.pending: list[list[tuple[Request, float, int]]] = [[] for _ in self.d]
        self.stats = RouterStats([0] * n)
        self._rr = 0
        self._last_rebalance: float | None = None
        self.spill_s = self.config.spill_s
        if self.spill_s is None:
            self.spill_s = self._full_step()

    # -- lifecycle, same as a dispatcher --------------------------------------------------
    async def start(self) -> None:
        for d in self.d:
            await d.start()
        self.stats.groups.append((self.clock.now(), *self.group_sizes()))

    async def stop(self, drain: bool = True) -> None:
        await asyncio.gather(*(d.stop(drain) for d in self.d))

    def submit(self, prompt: Seq[int], params: SamplingParams | None = None,
               arrival_time: float | None = None, slo: float | None = None,
               request_id: str | None = None) -> RequestHandle:
        prompt = [int(t) for t in prompt]
        cached = cached_prefixes(prompt, self.d)
        i, new, c = self._choose(prompt, cached)
        h = self.d[i].submit(prompt, params, arrival_time, slo, request_id)
        self.pending[i].append((h.request, self.cost(new, c, self._is_short(new, c)), new))
        self.stats.routed[i] += 1
        return h

    # -- decisions ------------------------------------------------------------------------
    def _is_short(self, new: int, cached: int) -> bool:
        t = self.config.threshold
        return new <= (t if t is not None else self.d[0].threshold(cached))

    def _default_cost(self, new: int, cached: int, short: bool) -> float:
        """Predicted prefill seconds; a short request shares a batch, so it costs its share."""
        model = self.d[0].model
        if model is None:
            return float(new)
        t = model.predict_prefill(max(new, 1), cached)
        return t / self.d[0].lanes[0].executor.grid.prefill_batches[-1] if short else t

    def _full_step(self) -> float:
        """Seconds of one full prefill step (cost units without a latency model)."""
        grid = self.d[0].lanes[0].executor.grid
        model = self.d[0].model
        if model is None:
            return float(grid.max_batch_tokens)
        return model.predict(StepShape.exact((min(grid.max_chunk, grid.max_batch_tokens),)))

    def load(self, i: int) -> float:
        """Pending prefill work of instance i in cost units (seconds with a latency model)."""
        live, total = [], 0.0
        for r, cost, new in self.pending[i]:
            if r.stats.prefill_done is not None or r.done:
                continue
            live.append((r, cost, new))
            left = r.seq.remaining_prefill if r.seq.pages is not None else new
            total += cost * min(1.0, left / max(new, 1))
        self.pending[i] = live
        return total

    def group_sizes(self) -> tuple[int, int]:
        s = sum(g == SHORT for g in self.group)
        return s, len(self.group) - s

    def _least_loaded(self, members: list[int]) -> int:
        n = len(self.d)
        order = sorted(members, key=lambda i: (self.load(i), (i - self._rr) % n))
        self._rr = (order[0] + 1) % n
        return order[0]

    def _choose(self, prompt: list[int], cached: list[int]) -> tuple[int, int, int]:
        best = max(range(len(self.d)), key=lambda i: cached[i])
        c = cached[best]
        new = len(prompt) - c
        ratio = self.config.affinity_ratio
        if ratio is not None and c > 0 and c >= ratio * len(prompt):
            self.stats.by_affinity += 1
            return best, new, c
        p = self.config.policy
        if p == "round-robin":
            i = self._rr
            self._rr = (self._rr + 1) % len(self.d)
        elif p == "least-load" or len(self.d) == 1:
            i = self._least_loaded(list(range(len(self.d))))
        else:
            self._maybe_rebalance()
            want = SHORT if self._is_short(new, c) else LONG
            i = self._least_loaded([k for k, g in enumerate(self.group) if g == want])
            others = [k for k, g in enumerate(self.group) if g != want]
            if others and self.spill_s < float("inf"):
                j = min(others, key=self.load)
                if self.load(j) + self.spill_s < self.load(i):
                    i = j
                    self.stats.spilled += 1
        return i, len(prompt) - cached[i], cached[i]

    def _maybe_rebalance(self) -> None:
        now = self.clock.now()
        cfg = self.config
        if self._last_rebalance is not None and now - self._last_rebalance < \
                cfg.rebalance_interval_s:
            return
        self._last_rebalance = now
        members = {g: [i for i, x in enumerate(self.group) if x == g] for g in (SHORT, LONG)}
        per = {g: sum(self.load(i) for i in m) / len(m) for g, m in members.items() if m}
        if len(per) < 2:
            return
        for hot, cold in ((SHORT, LONG), (LONG, SHORT)):
            if per[hot] > cfg.rebalance_ratio * per[cold] and len(members[cold]) > 1:
                mover = min(members[cold], key=self.load)  # the one with least to drain
                self.group[mover] = hot
                self.stats.moves += 1
                self.stats.groups.append((now, *self.group_sizes()))
                return

    def metrics(self) -> dict:
        return {"policy": self.config.policy, "routed": list(self.stats.routed),
                "by_affinity": self.stats.by_affinity, "spilled": self.stats.spilled,
                "moves": self.stats.moves, "spill_s": self.spill_s,
                "groups": [list(g) for g in self.stats.groups],
                "instances": [d.metrics().to_dict() for d in self.d]}
