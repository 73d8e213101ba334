"""The event-loop watch: a stall is logged with what the loop's thread and the process did."""

import asyncio
import logging
import time

from laps_jax.server.loop_lag import LoopLag


def _stall(block) -> tuple[LoopLag, list[str]]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("test.loop_lag")
    logger.addHandler(Keep())
    lag = LoopLag(logger, threshold_s=0.15, interval_s=0.02)

    async def go():
        watch = asyncio.create_task(lag.run())
        await asyncio.sleep(0.1)  # the watch is running, nothing late yet
        block()  # on the loop itself
        await asyncio.sleep(0.1)
        watch.cancel()

    asyncio.run(go())
    return lag, records


def test_a_blocked_loop_is_logged_with_idle_cpu():
    """A sleep on the loop: one stall of about its length; the loop's thread used no CPU."""
    lag, said = _stall(lambda: time.sleep(0.4))
    assert lag.stalls == 1 and 0.3 <= lag.worst_s < 1.0, (lag, said)
    assert len(said) == 1 and said[0].startswith("event loop stalled 0.")
    thread_cpu = float(said[0].split("its thread used ")[1].split(" s")[0])
    assert thread_cpu < 0.1, said


def test_a_busy_loop_is_logged_with_its_cpu():
    """Blocking CPU work on the loop: the loop's thread used most of the stall."""
    def spin():
        end = time.thread_time() + 0.4
        while time.thread_time() < end:
            pass
    lag, said = _stall(spin)
    assert lag.stalls == 1, said
    thread_cpu = float(said[0].split("its thread used ")[1].split(" s")[0])
    assert thread_cpu >= 0.3, said


def test_the_gc_clock_times_collections():
    """The collector's share of a stall: a full collection over many objects is timed."""
    import gc

    from laps_jax.server.loop_lag import GCClock
    clock = GCClock()
    junk = [[i] for i in range(300_000)]  # objects the collector must visit
    gc.callbacks.append(clock)
    try:
        t0 = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(clock)
    assert 0 < clock.total_s <= took, (clock.total_s, took)
    del junk


def test_a_frozen_heap_is_not_walked_by_full_collections():
    """What serve.py does once started: the objects alive then leave the collector's reach, so
    a full collection no longer pays for them (and they stay alive: nothing is freed)."""
    import gc

    from laps_jax.server.loop_lag import freeze_startup_heap
    heap = [[i] for i in range(300_000)]  # the start-up heap: never garbage
    t0 = time.process_time()
    gc.collect()
    before = time.process_time() - t0
    try:
        assert freeze_startup_heap() >= len(heap)
        t0 = time.process_time()
        gc.collect()
        after = time.process_time() - t0
    finally:
        gc.unfreeze()
    assert after < before / 3, (before, after)
    assert heap[-1] == [299_999]


def test_short_delays_are_not_stalls():
    lag = LoopLag(logging.getLogger("test.loop_lag"), threshold_s=0.25)
    assert not lag.check(0.2, 0.2, 0.2) and lag.stalls == 0
    assert lag.check(0.3, 0.0, 0.0) and (lag.stalls, lag.worst_s) == (1, 0.3)


def test_stalls_show_in_metrics_once_a_watch_is_attached():
    """/metrics carries the watch's counts (serve.py's and the router's registries): nothing
    before a watch is attached, then the stall count and the worst stall as `check` saw them."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from aiohttp import web

    from laps_jax.server.loop_lag import watch

    def scrape(reg) -> dict[str, float]:
        text = generate_latest(reg).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    reg = CollectorRegistry()
    assert scrape(reg) == {}
    log = logging.getLogger("test.loop_lag.metrics")
    first = watch(web.Application(), log, reg)
    first.threshold_s = 0.2
    assert first.check(0.1, 0.0, 0.0) is False  # under the threshold: not a stall
    assert first.check(0.7, 0.5, 0.6) and first.check(0.3, 0.0, 0.0)
    got = scrape(reg)
    assert got["laps_event_loop_stalls_total"] == 2
    assert got["laps_event_loop_worst_stall_seconds"] == 0.7
    # a second app over the same registry (no duplicate-name error) shows its own watch
    second = watch(web.Application(), log, reg)
    assert second is not first and scrape(reg)["laps_event_loop_stalls_total"] == 0
