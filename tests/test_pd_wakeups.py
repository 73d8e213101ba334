"""The prefill/decode split's page accounting, in one process, no model: every release of a
pinned offer wakes what waits for pages, pinned legs are bounded.

A simulated engine (`sim/engine.py`, page accounting only) on the real clock, and a fake
transfer server: what is tested is the scheduler's bookkeeping, not the copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest

from laps_jax.engine.buckets import BucketGrid
from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler import Dispatcher, SchedulerConfig
from laps_jax.scheduler.clock import RealClock
from laps_jax.scheduler.latency_model import DeviceSpec, LatencyModel
from laps_jax.config import PRESETS
from laps_jax.sim.engine import SimEngine, SimExecutor

GRID = BucketGrid.default(max_chunk=256, max_prefill_batch=8, max_decode_batch=8, min_tokens=16,
                          max_batch_tokens=512)
MODEL = LatencyModel(PRESETS["tiny"], 4, DeviceSpec("cpu", 50e9, 10e9, 1e-4))
PAGES = 33  # 32 usable pages of 16 tokens
_ids = itertools.count(1)


class _Executor(SimExecutor):
    async def call(self, fn, *args):  # the engine-thread hop of EngineExecutor
        return fn(*args)


@dataclasses.dataclass
class _Offer:
    uuid: int

    def to_json(self) -> dict:
        return {"uuid": self.uuid}


class _Remote:
    """A transfer server that offers instantly and never pulls anything."""

    def offer(self, engine, seq, timeout_s):
        return _Offer(next(_ids))

    def forget(self, address):
        pass


def _dispatcher() -> Dispatcher:
    clock = RealClock()
    ex = _Executor(SimEngine(GRID, PAGES, 16, 4096, 1000), MODEL, clock, "short")
    return Dispatcher(ex, "laps", SchedulerConfig(threshold=64), clock=clock,
                      latency_model=MODEL)


def _prompt(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


async def _hold_offers(d, offers, n: int) -> list:
    """n prefill legs of 150 tokens (10 pages each), offered and held."""
    handles = [d.submit(_prompt(150, 100 + 1000 * i), SamplingParams(max_tokens=2),
                        offer_kv=True) for i in range(n)]
    for h in handles:
        await asyncio.wait_for(h.result(), 5)
    return handles


@pytest.mark.parametrize("how", ["release", "expiry"])
def test_a_freed_offer_wakes_the_request_waiting_for_its_pages(how):
    """30 of 32 pages pinned by offers; a request needing 7 waits. Releasing the offers
    (POST /pd/release's function, or their --pd-timeout) must run it at once: it used to wait
    for another arrival (72 s with 0 pages used)."""
    from laps_jax.scheduler.pd import Offers

    async def main():
        d = _dispatcher()
        await d.start()
        offers = Offers(d, _Remote(), 0.5 if how == "expiry" else 60.0)
        offers.limit = PAGES  # this test fills the pool
        await _hold_offers(d, offers, 3)
        assert len(offers.held) == 3 and d.lanes[0].executor.engine.kv.num_used >= 30
        waiting = d.submit(_prompt(100, 9000), SamplingParams(max_tokens=4))
        await asyncio.sleep(0.2)
        assert not waiting.finished  # no room: it waits for pages
        if how == "release":
            for uuid in list(offers.held):
                assert await offers.release(uuid)
        stats = await asyncio.wait_for(waiting.result(), 3.0)  # expiry at 0.5 s
        assert stats.finish_reason == "length"
        await d.stop()

    asyncio.run(main())


def test_pinned_legs_are_bounded_and_ordinary_requests_keep_the_rest():
    """Prefill legs nobody pulls pin at most --pd-max-pinned of the pool: the leg beyond it
    is refused (NoRoom), and an ordinary request runs meanwhile."""
    from laps_jax.scheduler.pd import NoRoom, Offers

    async def main():
        d = _dispatcher()
        await d.start()
        offers = Offers(d, _Remote(), 0.6, max_pinned=0.5)  # 16 of 32 pages
        pages = await offers.wait_room(150)  # 10 pages
        leg = d.submit(_prompt(150, 100), SamplingParams(max_tokens=2), offer_kv=True)
        offers.track(leg.request, pages)
        await asyncio.wait_for(leg.result(), 5)
        assert offers.pinned_pages() == 10 and len(offers.held) == 1
        ordinary = d.submit(_prompt(150, 50000), SamplingParams(max_tokens=4))
        assert (await asyncio.wait_for(ordinary.result(), 3)).finish_reason == "length"
        offers.timeout_s = 0.1  # (the held offer's expiry was set at 0.6 s)
        with pytest.raises(NoRoom):  # pinned 10 + 10 > 16, and nothing frees in 0.1 s
            await offers.wait_room(150)
        offers.timeout_s = 5.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await offers.wait_room(150) == 10  # as soon as the held offer expires
        assert loop.time() - t0 < 1.0 and offers.pinned_pages() == 0
        assert offers.pinned_pages() <= offers.limit
        await d.stop()

    asyncio.run(main())
