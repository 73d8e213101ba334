"""The asyncio dispatcher: the scheduler's public API (what the HTTP server uses).

    dispatcher = Dispatcher(engine, mode="laps", config=SchedulerConfig(), latency_model=model)
    await dispatcher.start()
    handle = dispatcher.submit(prompt_ids, SamplingParams(max_tokens=64), slo=0.5)
    async for ev in handle:          # TokenEvent(token_id, logprob, top, index)
        ...
    stats = await handle.result()    # RequestStats: ttft, prefill_latency, cached_tokens, pool...
    handle.abort()                   # leaves its pool at once, pages freed
    dispatcher.metrics()             # SchedulerMetrics (queues, batches, buckets, padding, KV...)
    await dispatcher.stop(drain=True)

Modes: "mixed" (FCFS baseline: one prefill queue, token budget, chunked prefill, same
executables and prefix cache), "laps" (temporal, one device group: the short pool behind its
waiting window first unless a long request has aged past it, long chunks between, a starvation
bound on the long pool; work in each pool ordered by remaining tokens with aging; see policy.py),
"laps-spatial" (two device groups running
concurrently: `engine` serves the short pool and all decoding, `long_engine` the long pool; a
request the long group prefilled hands its K/V to the short group and decodes there
(`SchedulerConfig.kv_handoff`; executors without `export_kv`, e.g. simulated ones, and a full
short group keep it where it was prefilled). A request goes to the group whose prefix cache
holds more of its prompt when its new tokens are short, else to the long group).

`engine` may be an `Engine` (run on a worker thread by `EngineExecutor`) or any
`StepExecutor`, e.g. the simulator's `SimExecutor` with `clock=SimClock()` under
`run_simulated`. `submit` raises ValueError (with the limit) for a request that can never run.
`slo` is the request's TTFT target in seconds: the short pool dispatches early rather than miss
it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Sequence as Seq

from laps_jax.engine.kv_cache import OutOfPages
from laps_jax.engine.sequence import SamplingParams, Sequence
from laps_jax.scheduler.clock import Clock, RealClock
from laps_jax.scheduler.executor import EngineExecutor, StepExecutor
from laps_jax.scheduler.lane import Lane
from laps_jax.scheduler.latency_model import LatencyModel
from laps_jax.scheduler.metrics import SchedulerMetrics
from laps_jax.scheduler.policy import MODES, SchedulerConfig, derive, make_planner
from laps_jax.scheduler.request import Request, RequestHandle, RequestStats, new_request_id


log = logging.getLogger(__name__)


def _executor(x, name: str) -> StepExecutor:
    """An engine (it has a model runner) runs on an `EngineExecutor`; anything else is taken
    as a `StepExecutor` already (the simulator's): the scheduler never imports the engine."""
    return EngineExecutor(x, name) if hasattr(x, "runner") else x


class Dispatcher:
    def __init__(self, engine, mode: str = "laps", config: SchedulerConfig | None = None, *,
                 long_engine=None, clock: Clock | None = None,
                 latency_model: LatencyModel | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "laps-spatial" and long_engine is None:
            raise ValueError("laps-spatial needs a second device group: pass long_engine")
        self.mode, self.config = mode, config or SchedulerConfig()
        self.clock = clock or RealClock()
        self.model = latency_model
        names = ["short", "long"] if mode == "laps-spatial" else [mode]
        execs = [_executor(engine, names[0])]
        if mode == "laps-spatial":
            execs.append(_executor(long_engine, names[1]))
        cfg = self.config
        if mode == "laps-spatial":  # the long group's chunks hold up no short work: full size
            cfg = dataclasses.replace(cfg, long_chunk_ratio=None)
        self.derived = derive(cfg, execs[0].grid, latency_model)
        self.lanes = [Lane(n, ex, make_planner(mode, ex.grid, self.derived), self.clock,
                           self.derived.is_short, self._on_finish, self.derived.decode_gap_s)
                      for n, ex in zip(names, execs)]
        self.kv_handoff = (mode == "laps-spatial" and self.config.kv_handoff
                           and all(hasattr(ex, "export_kv") for ex in execs))
        if self.kv_handoff:
            self.lanes[1].handoff = self._start_handoff
        self._moves: set[asyncio.Task] = set()
        self.live: dict[str, Request] = {}
        self.counts = {"submitted": 0, "finished": 0, "aborted": 0, "failed": 0}
        self._tasks: list[asyncio.Task] = []
        self._accepting = False

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self.kv_handoff:  # compile the page copies now, never on the request path
            for lane in self.lanes:
                await lane.executor.warmup_transfer()
        self._tasks = [asyncio.ensure_future(lane.run()) for lane in self.lanes]
        self._accepting = True

    async def stop(self, drain: bool = True) -> None:
        """Stops accepting; finishes (drain) or aborts what is running; ends the lanes."""
        self._accepting = False
        if not drain:
            for r in list(self.live.values()):
                self.abort(r)
        # the long lane first: its hand-offs land in the short lane, which must still be running
        for lane, task in reversed(list(zip(self.lanes, self._tasks))):
            lane.stopping = True
            lane.wake.set()
            await task
        if self._moves:  # a hand-off may still be freeing the pages it copied from
            await asyncio.gather(*self._moves, return_exceptions=True)
        for lane in self.lanes:
            await lane.executor.close()

    # -- requests -------------------------------------------------------------------------
    def submit(self, prompt: Seq[int], params: SamplingParams | None = None,
               arrival_time: float | None = None, slo: float | None = None,
               request_id: str | None = None, offer_kv: bool = False) -> RequestHandle:
        if not self._accepting:
            raise RuntimeError("the dispatcher is not running (start() it, or it is stopping)")
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        for lane in self.lanes:
            lane.executor.check(prompt, params.max_tokens)
        r = self.register(prompt, params, arrival_time, slo, request_id)
        r.pd_offer = offer_kv  # a prefill instance's request: hand its K/V over (pd.py)
        self._route(r).submit(r)
        return r.handle

    def register(self, prompt: list[int], params: SamplingParams,
                 arrival_time: float | None = None, slo: float | None = None,
                 request_id: str | None = None) -> Request:
        """A new live request with its stats and handle, not yet in any lane (`submit`
        routes it; the decode side of a prefill/decode split adopts it, scheduler/pd.py)."""
        now = self.clock.now()
        arrival = now if arrival_time is None else arrival_time
        stats = RequestStats(request_id or new_request_id(), arrival, len(prompt), slo_s=slo,
                             submitted=now)
        r = Request(Sequence(prompt, params), stats,
                    deadline=arrival + slo if slo is not None else float("inf"))
        r.handle = RequestHandle(r, self.abort)
        self.live[stats.request_id] = r
        self.counts["submitted"] += 1
        return r

    def abort(self, r: Request | RequestHandle | str) -> None:
        """Aborts a request (its handle, the request, or its id); a no-op once finished."""
        if isinstance(r, str):
            r = self.live.get(r)
        elif isinstance(r, RequestHandle):
            r = r.request
        if r is None or r.done or r.lane is None:
            return
        r.lane.abort(r)

    def _route(self, r: Request) -> Lane:
        if len(self.lanes) == 1:
            return self.lanes[0]
        short, long = self.lanes
        prompt = r.seq.prompt
        cs, cl = short.executor.cached_prefix(prompt), long.executor.cached_prefix(prompt)
        cached = max(cs, cl)
        if self.derived.is_short(len(prompt) - cached, cached):
            return short if cs >= cl else long
        return long

    # -- laps-spatial KV hand-off ---------------------------------------------------------
    def _start_handoff(self, r: Request) -> bool:
        src = self.lanes[1]
        src.moving.add(r)
        task = asyncio.ensure_future(self._handoff(r))
        self._moves.add(task)
        task.add_done_callback(self._moves.discard)
        return True

    async def _handoff(self, r: Request) -> None:
        """Copies a long-prefilled request's K/V to the short group, which decodes it; if the
        short group has no room (or the copy fails) it decodes where it was prefilled."""
        src, dst = self.lanes[1], self.lanes[0]
        new = None
        try:
            if not r.aborted:
                data = await src.executor.export_kv(r.seq)
                if not r.aborted:
                    new = await dst.executor.import_kv(r.seq, data)
        except OutOfPages:
            pass
        except Exception:  # a failed copy must not lose the request
            log.exception("KV hand-off of %s failed; decoding where it was prefilled",
                          r.stats.request_id)
        src.moving.discard(r)
        src.wake.set()
        if new is None:
            if r.aborted:
                await src.release([r.seq], "abort")
            else:
                src.decoding.append(r)
            return
        # swap pages and lane before any await: an abort from here on finds the request in
        # the short lane with its new pages (it used to land in the window of the release
        # below, with the long lane freeing the short engine's pages: 5 pages leaked)
        old, r.seq.pages = r.seq.pages, new
        r.lane = dst
        if r.aborted:  # aborted while copying: nothing was released yet
            await dst.release([r.seq], "abort")
        else:
            dst.counters.handoffs_in += 1
            dst.decoding.append(r)
            dst.wake.set()
        await src.executor.release_pages(old)
        src.pages_freed()

    def _on_finish(self, r: Request) -> None:
        self.live.pop(r.stats.request_id, None)
        reason = r.stats.finish_reason
        key = "aborted" if reason == "abort" else "failed" if reason == "error" else "finished"
        self.counts[key] += 1

    async def flush_prefix_cache(self) -> bool:
        """Drops every lane's cached prefixes (a benchmark's fresh start); False, and nothing
        dropped, while any request is live. Runs on each engine's own thread."""
        if self.live or self._moves or any(lane.has_work() for lane in self.lanes):
            return False
        for lane in self.lanes:
            clear = getattr(lane.executor, "clear_prefix_cache", None)
            if clear is not None:
                await clear()
        return True

    # -- observability --------------------------------------------------------------------
    def metrics(self) -> SchedulerMetrics:
        return SchedulerMetrics(self.mode, self.counts["submitted"], self.counts["finished"],
                                self.counts["aborted"], self.counts["failed"], len(self.live),
                                [lane.metrics() for lane in self.lanes])

    def stalled(self, after_s: float) -> list[str]:
        """Lanes that have had work waiting and got nothing done for over `after_s` seconds
        (a hung step, pages that never come back): what the server's /health reports."""
        now = self.clock.now()
        return [lane.name for lane in self.lanes if lane.stalled_for(now) > after_s]
