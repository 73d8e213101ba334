"""A lane: one device group's loop. Admits, asks its planner for prefill, interleaves decode.

Each iteration admits waiting requests (pages + prefix match, which classifies them by new
tokens), then runs one step: a decode step right after a prefill step whenever sequences are
decoding (continuous batching in decode buckets, round robin past the largest bucket), else the
planner's prefill, else it waits on the clock for the planner's time or the next event. Steps
run on the executor; the loop itself never blocks. A request in flight when it is aborted is
released as soon as its step returns; any other is released at once.

Failures stay with their request: one that cannot be admitted (a bad seed) or that breaks a
step (containment.py singles it out) ends with finish_reason "error" and `error` set, its pages
freed, and is never retried; its batch-mates go on. `last_progress` is when the lane last got
something done, for the server's watchdog.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable

from laps_jax.engine.kv_cache import OutOfPages
from laps_jax.scheduler.clock import Clock
from laps_jax.scheduler.containment import run_contained
from laps_jax.scheduler.executor import StepExecutor
from laps_jax.scheduler.metrics import LaneCounters, LaneMetrics
from laps_jax.scheduler.pools import PrefillPlan
from laps_jax.scheduler.request import LONG, SHORT, Request, token_event

log = logging.getLogger(__name__)


class Lane:
    def __init__(self, name: str, executor: StepExecutor, planner, clock: Clock,
                 is_short: Callable[[int, int], bool], on_finish: Callable[[Request], None],
                 decode_gap_s: float = 0.0):
        self.name, self.executor, self.planner, self.clock = name, executor, planner, clock
        self.is_short, self.on_finish = is_short, on_finish
        self.incoming: collections.deque[Request] = collections.deque()
        self.decoding: list[Request] = []
        self.inflight: set[Request] = set()
        self.moving: set[Request] = set()  # prefilled here, K/V on its way to another lane
        # laps-spatial: called with a request whose prefill finished here; True = it was taken
        # elsewhere to decode (the dispatcher's KV hand-off)
        self.handoff: Callable[[Request], bool] | None = None
        self.counters = LaneCounters()
        self.wake = asyncio.Event()
        self.stopping = False
        self._last = ""
        self.decode_gap_s = decode_gap_s
        self._background: set[asyncio.Future] = set()  # releases in flight (keep them alive)
        self._last_decode = 0.0
        self.max_decode = executor.grid.decode_batches[-1]
        # a step ran, a request was admitted or failed (None: not yet; a lane may be built
        # before its event loop runs, and a simulated clock reads the loop's time)
        self.last_progress: float | None = None
        self._failures = 0  # loop failures in a row (each waits longer before the next try)
        self._page_waiters: list[asyncio.Future] = []  # wait_for_pages() callers

    # -- from the dispatcher --------------------------------------------------------------
    def submit(self, r: Request) -> None:
        r.lane = self
        r.stats.lane = self.name
        if not self.has_work():  # an idle lane has not been stuck all the while it idled
            self.last_progress = self.clock.now()
        self.incoming.append(r)
        self.wake.set()

    def abort(self, r: Request) -> None:
        """Out of every queue now; pages freed now, or when its in-flight step returns."""
        r.aborted = True
        if r in self.incoming:
            self.incoming.remove(r)
        self.planner.remove(r)
        if r in self.decoding:
            self.decoding.remove(r)
        if r not in self.inflight and r not in self.moving and r.seq.pages is not None:
            task = asyncio.ensure_future(self.release([r.seq], "abort"))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        self._finish(r, "abort")
        self.wake.set()

    # -- pages freed: whoever waits for them runs now -------------------------------------
    async def release(self, seqs: list, reason: str) -> None:
        """Frees `seqs`' pages and wakes what waits for pages. Every release outside a step
        goes through here: a request queued for admission waits on `wake`, and nothing else
        would wake it (an idle lane with a queue that does not fit sleeps until an event)."""
        try:
            await self.executor.release(seqs, reason)
        finally:
            self.pages_freed()

    def pages_freed(self) -> None:
        self.wake.set()
        self._notify_waiters()

    def _notify_waiters(self) -> None:
        waiters, self._page_waiters = self._page_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def wait_for_pages(self, timeout: float) -> None:
        """Returns when pages may have been freed (a release, or a step that may have
        finished requests), or after `timeout` seconds; the caller checks again."""
        f = asyncio.get_running_loop().create_future()
        self._page_waiters.append(f)
        try:
            await asyncio.wait_for(f, max(timeout, 0.0))
        except TimeoutError:
            pass
        finally:
            if f in self._page_waiters:
                self._page_waiters.remove(f)

    def has_work(self) -> bool:
        return bool(self.incoming or self.decoding or self.inflight or self.moving
                    or any(self.planner.queue_lengths().values()))

    def stalled_for(self, now: float) -> float:
        """Seconds since the lane last got anything done while work waits (0 when idle)."""
        if self.last_progress is None or not self.has_work():
            return 0.0
        return max(0.0, now - self.last_progress)

    def metrics(self) -> LaneMetrics:
        q = dict(self.planner.queue_lengths(), admission=len(self.incoming),
                 decode=len(self.decoding))
        pending = dict(self.planner.pending_tokens(),
                       admission=sum(len(r.seq.prompt) for r in self.incoming))
        w = self.planner.window
        return LaneMetrics(self.name, q, pending, self.counters, w.waits if w else 0,
                           w.wait_seconds if w else 0.0, self.executor.stats())

    # -- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            self.wake.clear()
            try:
                start = self.clock.now()
                await self._admit()
                act = self._next(self.clock.now())
                if act == "decode" or isinstance(act, PrefillPlan):
                    step_s = await (self._decode() if act == "decode" else self._prefill(act))
                    # what the loop spent around the step: admission, planning, thread hops
                    self.counters.host_seconds += max(0.0, self.clock.now() - start - step_s)
                    self.last_progress = self.clock.now()
                    self._notify_waiters()  # the step may have finished requests
                else:
                    if self.stopping and not self.has_work():
                        return
                    if not self.has_work():
                        self.last_progress = self.clock.now()
                    timeout = None if act is None else act.t - self.clock.now()
                    self.counters.idle_waits += 1
                    await self.clock.wait(self.wake, timeout)
                self._failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a broken loop must not take the lane down with it
                self._failures += 1
                if self._failures <= 3 or self._failures % 100 == 0:
                    log.exception("lane %s: loop failed (%d in a row)", self.name, self._failures)
                self.counters.failed_steps += 1
                await self._fail(list(self.inflight), "error", f"{type(e).__name__}: {e}")
                self.inflight.clear()
                # the same failure again at once would only fill the log: back off (up to 1 s)
                await self.clock.sleep(min(0.01 * 2 ** self._failures, 1.0))

    def _next(self, now: float):
        plan = self.planner.plan(now)
        if self.decoding and (not isinstance(plan, PrefillPlan) or (
                self._last == "prefill" and now - self._last_decode >= self.decode_gap_s)):
            return "decode"
        return plan

    async def _admit(self) -> None:
        if not self.incoming:
            return
        batch = list(self.incoming)
        n = await self.executor.admit([r.seq for r in batch])
        now = self.clock.now()
        if n:
            self.last_progress = now
        for r in batch[:n]:
            if r in self.incoming:
                self.incoming.remove(r)
            if r.seq.error is not None:  # its own data failed admission; it holds no pages
                r.error = r.seq.error
                self._finish(r, "error")
                continue
            if r.aborted:
                await self.release([r.seq], "abort")
                continue
            st = r.stats
            st.admitted, st.cached_tokens = now, r.seq.cached_tokens
            st.new_tokens = r.seq.remaining_prefill
            st.pool = SHORT if self.is_short(st.new_tokens, st.cached_tokens) else LONG
            self.planner.add(r, now)

    async def _prefill(self, plan: PrefillPlan) -> float:
        self._last = "prefill"
        plan = plan.to_run(self.executor.grid)
        self.planner.dispatched(plan, self.clock.now())
        self.inflight = {r for r, _ in plan.work}
        infos = await run_contained(
            plan.work,
            lambda work: self.executor.prefill([(r.seq, n) for r, n in work], plan.bucket),
            lambda item, e: self._step_failed(item[0], e))
        for info in infos:
            self.counters.record(info, plan.pool)
        self.counters.filled_long_tokens += plan.filled_tokens
        self.counters.overload_long_steps += plan.overload
        now = self.clock.now()
        self.inflight = set()
        for r, _ in plan.work:
            r.last_served = now
            if r.aborted:
                await self.release([r.seq], "abort")
                continue
            if r.done:  # failed in the step, already answered and released
                continue
            if r.seq.remaining_prefill == 0:
                r.stats.prefill_done = now
                self.planner.remove(r)
                self._deliver(r, now)
                if not r.seq.is_finished and not (self.handoff and self.handoff(r)):
                    self.decoding.append(r)
        return sum(info.seconds for info in infos)

    async def _decode(self) -> float:
        self._last = "decode"
        self._last_decode = self.clock.now()
        batch = self.decoding[:self.max_decode]
        bucket = self.executor.grid.fit_decode(len(batch))
        self.inflight = set(batch)
        try:
            infos = await run_contained(
                batch, lambda rs: self.executor.decode([r.seq for r in rs], bucket),
                self._step_failed,
                passthrough=(OutOfPages,))
        except OutOfPages as e:  # admission should prevent it; fail the newest rather than hang
            self.inflight = set()
            await self._fail([batch[-1]], "error", f"out of KV pages: {e}")
            return 0.0
        for info in infos:
            self.counters.record(info)
        now = self.clock.now()
        self.inflight = set()
        ran, kept, aborted = set(batch), [], []
        for r in batch:
            if r.aborted:
                aborted.append(r)
                continue
            if r.done:  # failed in the step, already answered and released
                continue
            self._deliver(r, now)
            if not r.seq.is_finished:
                kept.append(r)
        # round robin: the batch goes to the back. No await before this line: a hand-off
        # appends to `decoding` meanwhile, and an older copy of the list would drop it
        self.decoding = [r for r in self.decoding if r not in ran and not r.aborted] + kept
        if aborted:
            await self.release([r.seq for r in aborted], "abort")
        return sum(info.seconds for info in infos)

    # -- results --------------------------------------------------------------------------
    def _deliver(self, r: Request, now: float) -> None:
        seq = r.seq
        for lp in seq.logprobs[r.delivered:]:
            if r.stats.first_token is None:
                r.stats.first_token = now
            r.handle._push(token_event(lp, r.delivered))
            r.delivered += 1
        if seq.is_finished:
            self._finish(r, seq.finish_reason or "stop")

    def _finish(self, r: Request, reason: str) -> None:
        if r.done:
            return
        r.stats.finished = self.clock.now()
        r.stats.finish_reason = "abort" if r.aborted else (r.seq.finish_reason or reason)
        r.stats.output_tokens = r.delivered
        r.handle._close()
        self.on_finish(r)

    async def _step_failed(self, r: Request, e: Exception) -> None:
        """A step failed with `r` alone in it: `r` fails, and is never run again."""
        log.error("lane %s: request %s failed in its step and was ended: %s: %s", self.name,
                  r.stats.request_id, type(e).__name__, e, exc_info=e)
        self.counters.failed_steps += 1
        await self._fail([r], "error", f"{type(e).__name__}: {e}")

    async def _fail(self, reqs: list[Request], reason: str, message: str | None = None
                    ) -> None:
        for r in reqs:
            self.planner.remove(r)
            if r in self.decoding:
                self.decoding.remove(r)
            if r in self.incoming:
                self.incoming.remove(r)
            r.error = r.error or message
            r.seq.finish_reason = reason
            if r.seq.pages is not None:
                await self.release([r.seq], reason)
            self._finish(r, reason)
