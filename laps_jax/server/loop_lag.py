"""A watch on the asyncio event loop: it logs every stall, and what the process did meanwhile.

A loop that does not run cannot answer a health check, so a stall of a second looks, from a
router, like a hung process (docs/BENCHMARKS.md, "Router"). The watch sleeps a short
interval and measures how late it wakes; over `threshold_s` late it logs a warning with the
CPU time the loop's own thread and the whole process used in that gap. That tells the three
causes apart: the loop's thread busy (blocking code on the loop), the process busy but not the
loop's thread (another thread holds the GIL), neither (the process was not scheduled: the
machine's cores were taken); and it says how much of the gap the garbage collector took (it
stops every thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import gc
import logging
import time
import weakref

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TASK = web.AppKey("loop_lag_task", asyncio.Task)


class GCClock:
    """Wall seconds spent in garbage collections, summed by a `gc.callbacks` entry."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started: float | None = None

    def __call__(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.total_s += time.perf_counter() - self._started
            self._started = None


GC_CLOCK = GCClock()


@dataclasses.dataclass
class LoopLag:
    """Counts and the worst stall seen; `run` is the watching task."""

    logger: logging.Logger
    threshold_s: float = 0.5
    interval_s: float = 0.05
    stalls: int = 0
    worst_s: float = 0.0

    def check(self, late_s: float, thread_cpu_s: float, process_cpu_s: float,
              gc_s: float = 0.0) -> bool:
        """Records one wake-up `late_s` late; logs and returns True when it was a stall."""
        if late_s <= self.threshold_s:
            return False
        self.stalls += 1
        self.worst_s = max(self.worst_s, late_s)
        self.logger.warning(
            "event loop stalled %.2f s (until %s): its thread used %.2f s of CPU meanwhile, "
            "the process %.2f s; garbage collection took %.2f s of it", late_s,
            datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3], thread_cpu_s, process_cpu_s,
            gc_s)
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t, thread, proc = loop.time(), time.thread_time(), time.process_time()
            collected = GC_CLOCK.total_s
            await asyncio.sleep(self.interval_s)
            self.check(loop.time() - t - self.interval_s, time.thread_time() - thread,
                       time.process_time() - proc, GC_CLOCK.total_s - collected)


def freeze_startup_heap() -> int:
    """Moves every object alive now to the collector's permanent generation; returns how many.

    Called once start-up is done: the model, tokenizer and compiled programs (about 270,000
    objects for bench-cpu) are never garbage, yet each full collection walked them all: 0.24 s
    of CPU on this machine, over a second of stalled event loop with three instances on two
    cores, which a router's health check takes for a hung process (seen in the router runs
    of 2026-12-02). Collections then visit only what serving allocates.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class LagMetrics:
    """The watch's counts for a /metrics registry (serve.py's and the router's): a stall shows
    to whoever scrapes, not only in the process's log. Nothing until `watch` attaches one."""

    def __init__(self) -> None:
        self.lag: LoopLag | None = None

    def collect(self):
        if self.lag is None:
            return
        yield CounterMetricFamily("laps_event_loop_stalls", "Event-loop stalls over "
                                  f"{self.lag.threshold_s} s (each one is logged)",
                                  value=self.lag.stalls)
        yield GaugeMetricFamily("laps_event_loop_worst_stall_seconds",
                                "The longest event-loop stall seen", value=self.lag.worst_s)


_EXPORTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registry -> LagMetrics


def watch(app: web.Application, logger: logging.Logger,
          registry: CollectorRegistry | None = None) -> LoopLag:
    """Runs a `LoopLag` for as long as `app` runs; its counts go to `registry`'s /metrics
    when given (serve.py's and the router's). One collector per registry: an app made again
    over the same registry (a server state reused, as tests do) points it at its new watch."""
    lag = LoopLag(logger)
    if registry is not None:
        exported = _EXPORTED.get(registry)
        if exported is None:
            exported = _EXPORTED[registry] = LagMetrics()
            registry.register(exported)
        exported.lag = lag
    if GC_CLOCK not in gc.callbacks:
        gc.callbacks.append(GC_CLOCK)

    async def start(_app) -> None:
        _app[TASK] = asyncio.create_task(lag.run())

    async def stop(_app) -> None:
        _app[TASK].cancel()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return lag

