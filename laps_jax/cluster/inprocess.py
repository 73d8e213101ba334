"""The routing policy in front of dispatchers in this process (the simulator's instances).

    router = Router([d0, d1, d2, d3], RouterConfig(policy="laps"))
    await router.start()
    handle = router.submit(prompt_ids, params, slo=0.5)   # same API as Dispatcher.submit
    await router.stop()

It measures what the policy needs: each instance's cached prefix of the prompt (read from its
prefix caches, nothing pinned) and its pending prefill work (predicted seconds of prefill
routed to it and not done yet, partly done requests counted by what is left).

With `hold_steps` it binds long requests late (cluster/hold.py): a long request larger than
the hold waits here while every instance has that many full prefill steps of work ahead of it,
and `submit` returns a handle that follows it to its instance once bound.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence as Seq

from laps_jax.cluster.hold import AGING_TOKENS_PER_S, HoldQueue, held_counts, holds
from laps_jax.cluster.policy import POLICIES, RouterConfig, RoutingPolicy
from laps_jax.engine.kv_cache import block_hash
from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler.clock import Clock
from laps_jax.scheduler.dispatcher import Dispatcher
from laps_jax.scheduler.latency_model import StepShape
from laps_jax.scheduler.request import Request, RequestHandle

__all__ = ["POLICIES", "Router", "RouterConfig", "cached_prefixes"]


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
                 cost: Callable[[int, int, bool], float] | None = None,
                 hold_steps: float = 0.0):
        if not dispatchers:
            raise ValueError("a router needs at least one instance")
        self.d = list(dispatchers)
        self.config = config or RouterConfig()
        self.clock = clock or self.d[0].clock
        grid = self.d[0].lanes[0].executor.grid
        full_step = self._full_step()
        self._token_s = full_step / min(grid.max_chunk, grid.max_batch_tokens)  # full pace
        self.cost = cost or self._default_cost
        self.policy = RoutingPolicy(len(self.d), self.config, self.d[0].derived.is_short,
                                    full_step, self._chunk(), self.cost)
        self.pending: list[list[tuple[Request, float, int, bool]]] = [[] for _ in self.d]
        self.placed: dict[str, int] = {}  # request id -> instance (sim/miss_split.py)
        if not (hold_steps >= 0 and math.isfinite(hold_steps)):
            raise ValueError(f"hold_steps must be a finite number >= 0, got {hold_steps}")
        self.hold_s = hold_steps * full_step
        self.hold = (HoldQueue(self._may_send, AGING_TOKENS_PER_S, 1 << 30,
                               self.clock.now) if hold_steps else None)

    @property
    def stats(self):
        return self.policy.stats

    @property
    def group(self) -> list[str]:
        return self.policy.group

    @property
    def spill_s(self) -> float:
        return self.policy.spill_s

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
        best = max(cached)
        new = len(prompt) - best
        if self.hold is None or not holds(new, best, self.policy.is_short(new, best),
                                          self.cost(new, best, False) <= self.hold_s):
            return self._bind(prompt, params, arrival_time, slo, request_id, cached)
        late = LateHandle()
        asyncio.ensure_future(self._bind_late(late, prompt, params, arrival_time, slo,
                                              request_id, new))
        return late

    async def _bind_late(self, late: LateHandle, prompt: list[int], params, arrival_time,
                         slo, request_id, new: int) -> None:
        """Holds a long request until some instance has less than the hold ahead of it, then
        binds it among those instances; one that found room at once goes where the policy
        picks among all (cluster/hold.py)."""
        held = await self.hold.turn(new)
        try:
            h = self._bind(prompt, params, arrival_time, slo, request_id,
                           cached_prefixes(prompt, self.d), self._room(new) if held else None)
        except Exception as e:  # (the caller sees it from the handle, as from submit)
            late.bound.set_exception(e)
            return
        finally:
            self.hold.sent()
        late.bound.set_result(h)
        await h.result()  # its prefill is done (disaggregated) or it ended: room may be back
        self.hold.kick()

    def _ahead(self, i: int, new: int) -> float:
        """Work instance i runs before a long request of `new` tokens: its short work and
        the smaller long work (every instance runs the least remaining first)."""
        c = self.cost(new, 0, False)
        short = self.load(i, True)
        return short + sum(x for x in self.long_items(i) if x <= c)

    def _room(self, new: int) -> list[bool]:
        return [self._ahead(i, new) < self.hold_s for i in range(len(self.d))]

    def _may_send(self, new: int) -> bool:
        return any(self._room(new))

    def _bind(self, prompt: list[int], params, arrival_time, slo, request_id,
              cached: list[int], eligible: list[bool] | None = None) -> RequestHandle:
        n = range(len(self.d))
        loads = [self.load(i) for i in n]
        c = self.policy.choose(len(prompt), cached, loads, self.clock.now(), eligible,
                               short_loads=[self.load(i, True) for i in n],
                               inflight=[len(self.pending[i]) for i in n],
                               long_items=[self.long_items(i) for i in n],
                               unit_s=None if self.d[0].model is None else [1.0] * len(self.d))
        h = self.d[c.instance].submit(prompt, params, arrival_time, slo, request_id)
        if request_id is not None:
            self.placed[request_id] = c.instance
        self.pending[c.instance].append(
            (h.request, self.cost(c.new_tokens, c.cached_tokens, c.short), c.new_tokens,
             c.short))
        return h

    # -- what the policy is fed -----------------------------------------------------------
    def _default_cost(self, new: int, cached: int, short: bool) -> float:
        """Predicted prefill seconds. A short request shares a batch: it costs its share of a
        lone step while rows are nearly free (memory-bound), but never less than its padded
        row's compute at the full chunk's pace, since rows add up: on an H200 one 128-token
        row alone takes 16 ms and eight of them 83 ms, ~10 ms each, not 16 / 8. (Priced at
        the share, laps spread short RAG questions as if free and trailed the gateway's count
        of requests; docs/SIMULATION.md, "Routers on the trace family".)"""
        model = self.d[0].model
        if model is None:
            return float(new)
        t = model.predict_prefill(max(new, 1), cached)
        if not short:
            return t
        grid = self.d[0].lanes[0].executor.grid
        row = grid.fit_prefill(1, max(new, 1))
        width = row.tokens if row is not None else new
        return max(t / grid.prefill_batches[-1], width * self._token_s)

    def _full_step(self) -> float:
        """Seconds of one full prefill step (cost units without a latency model)."""
        grid = self.d[0].lanes[0].executor.grid
        model = self.d[0].model
        if model is None:
            return float(grid.max_batch_tokens)
        return model.predict(StepShape.exact((min(grid.max_chunk, grid.max_batch_tokens),)))

    def _chunk(self) -> float | None:
        """Seconds of one long chunk (what a short request may wait out behind long work)."""
        model = self.d[0].model
        if model is None:
            return None
        return model.predict(StepShape.exact((self.d[0].derived.long_budget,)))

    def _left(self, r: Request, cost: float, new: int) -> float:
        left = r.seq.remaining_prefill if r.seq.pages is not None else new
        return cost * min(1.0, left / max(new, 1))

    def long_items(self, i: int) -> list[float]:
        """Remaining work of each pending long request of instance i (after `load(i)`)."""
        return [self._left(r, cost, new) for r, cost, new, short in self.pending[i] if not short]

    def load(self, i: int, short_only: bool = False) -> float:
        """Pending prefill work of instance i in cost units (seconds with a latency model);
        with `short_only`, of its short requests only."""
        live, total = [], 0.0
        for r, cost, new, short in self.pending[i]:
            if r.stats.prefill_done is not None or r.done:
                continue
            live.append((r, cost, new, short))
            if short or not short_only:
                total += self._left(r, cost, new)
        self.pending[i] = live
        return total

    def group_sizes(self) -> tuple[int, int]:
        return self.policy.group_sizes()

    def metrics(self) -> dict:
        s = self.stats
        return {"policy": self.config.policy, "routed": list(s.routed),
                "by_affinity": s.by_affinity, "spilled": s.spilled, "moves": s.moves,
                "behind": s.behind,
                "spill_s": self.spill_s, "groups": [list(g) for g in s.groups],
                "held": held_counts(self.hold)[0], "held_s": held_counts(self.hold)[1],
                "instances": [d.metrics().to_dict() for d in self.d]}


class LateHandle:
    """What `Router.submit` returns for a held request: `result()` waits for the binding and
    then for the dispatcher's handle; the rest is read from that handle once bound."""

    def __init__(self) -> None:
        self.bound: asyncio.Future[RequestHandle] = asyncio.get_running_loop().create_future()

    async def result(self):
        return await (await self.bound).result()

    @property
    def request(self) -> Request:
        return self.bound.result().request

    @property
    def tokens(self) -> list[int]:
        return self.bound.result().tokens

    @property
    def stats(self):
        return self.bound.result().stats
