"""Pools, window and dispatch logic on fake and virtual clocks (no model, no compiles)."""

from __future__ import annotations


import pytest

from laps_jax.config import PRESETS
from laps_jax.engine.buckets import BucketGrid
from laps_jax.engine.sequence import SamplingParams, Sequence
from laps_jax.scheduler import Dispatcher, SchedulerConfig, WindowConfig
from laps_jax.scheduler.clock import ManualClock, SimClock, run_simulated
from laps_jax.scheduler.latency_model import DeviceSpec, LatencyModel
from laps_jax.engine.packing import pack
from laps_jax.scheduler.pools import SingleQueue, LongPool, PrefillPlan, ShortPool, WaitUntil
from laps_jax.scheduler.request import LONG, SHORT, Request, RequestStats
from laps_jax.scheduler.window import WaitingWindow
from laps_jax.sim.engine import SimEngine, SimExecutor

GRID = BucketGrid.default(max_chunk=256, max_prefill_batch=8, max_decode_batch=8, min_tokens=16,
                          max_batch_tokens=512)
CPU = DeviceSpec("cpu", 50e9, 10e9, 5e-3)
MODEL = LatencyModel(PRESETS["tiny"], 4, CPU)


def req(n: int, arrival: float = 0.0, deadline: float = float("inf")) -> Request:
    return Request(Sequence(list(range(10, 10 + n)), SamplingParams(max_tokens=2)),
                   RequestStats(f"r{n}-{arrival}", arrival, n), deadline=deadline)


def short_pool(mode="static", static_s=0.010, max_s=0.010, predict=lambda w, b: 0.0):
    window = WaitingWindow(WindowConfig(mode=mode, static_s=static_s, max_s=max_s))
    return ShortPool(GRID, 512, 0.0, window, predict)


# -- buckets --------------------------------------------------------------------------------
def test_pack_chooses_the_smallest_fitting_bucket():
    work, bucket, _ = pack([req(20), req(18), req(30)], GRID, 512, chunk=False, strict=False)
    assert len(work) == 3 and (bucket.batch, bucket.tokens) == (4, 32)
    work, bucket, _ = pack([req(5)], GRID, 512, chunk=False, strict=False)
    assert (bucket.batch, bucket.tokens) == (1, 16)
    work, bucket, _ = pack([req(100), req(90)], GRID, 512, chunk=False, strict=False)
    assert (bucket.batch, bucket.tokens) == (2, 128)


def test_pack_refuses_mostly_padding_and_chunks_under_the_budget():
    work, _, _ = pack([req(200), req(3)], GRID, 512, chunk=False, strict=True)
    assert [n for _, n in work] == [200]  # a 3-token row in a 256-wide bucket is waste
    work, bucket, _ = pack([req(1000), req(900)], GRID, 512, chunk=True, strict=True)
    assert [n for _, n in work] == [256, 256] and bucket.batch * bucket.tokens <= 512


def test_fcfs_queue_keeps_arrival_order():
    q = SingleQueue(GRID, 512, 0.0)
    for i, n in enumerate([300, 10, 12]):
        r = req(n, arrival=float(i))
        q.add(r, float(i))
    plan = q.plan(3.0)
    assert [r.stats.arrival for r, _ in plan.work][0] == 0.0


# -- the waiting window under a fake clock ---------------------------------------------------
def test_static_window_waits_then_dispatches():
    clock = ManualClock()
    pool = short_pool()
    pool.add(req(20), clock.now())
    clock.advance(0.004)
    pool.add(req(25), clock.now())
    plan = pool.plan(clock.now())
    assert isinstance(plan, WaitUntil) and plan.t == pytest.approx(0.010)
    clock.advance(0.007)
    plan = pool.plan(clock.now())
    assert isinstance(plan, PrefillPlan) and len(plan.work) == 2
    assert plan.waited == pytest.approx(0.007)  # held since the first "wait" at 0.004


def test_window_dispatches_at_once_when_the_bucket_is_full():
    pool = short_pool(static_s=1.0)
    for _ in range(8):
        pool.add(req(16), 0.0)
    plan = pool.plan(0.0)
    assert isinstance(plan, PrefillPlan) and len(plan.work) == 8


def test_window_yields_to_the_tightest_deadline():
    pool = short_pool(static_s=0.050, predict=lambda w, b: 0.010)
    pool.add(req(20, deadline=0.030), 0.0)
    plan = pool.plan(0.0)
    assert isinstance(plan, WaitUntil) and plan.t == pytest.approx(0.020)  # 0.030 - 0.010
    assert isinstance(pool.plan(0.020), PrefillPlan)


def test_adaptive_window_follows_the_arrival_rate():
    pool = short_pool(mode="adaptive", max_s=0.010)
    pool.add(req(20), 0.0)
    assert isinstance(pool.plan(0.0), PrefillPlan)  # no traffic seen: waiting buys nothing
    busy = short_pool(mode="adaptive", max_s=0.010)
    for i in range(200):  # 1000 short requests/s
        busy.window.observe_arrival(i * 0.001)
    busy.add(req(20), 0.2)
    plan = busy.plan(0.2)
    assert isinstance(plan, WaitUntil) and 0.2 < plan.t <= 0.21 + 1e-9


def test_window_off_dispatches_immediately():
    pool = short_pool(mode="off")
    pool.add(req(20), 0.0)
    assert isinstance(pool.plan(0.0), PrefillPlan)


# -- order and starvation --------------------------------------------------------------------
def test_long_pool_orders_by_remaining_with_aging():
    pool = LongPool(GRID, 256, aging_tokens_per_s=100.0, max_postpone_s=100.0)
    old, young, later = req(900), req(400), req(400)
    pool.add(old, 0.0)
    pool.add(young, 2.0)
    assert pool.ordered(2.0) == [young, old]          # 400 < 900 - 200
    pool.add(later, 6.0)
    assert pool.ordered(6.0) == [young, old, later]   # 0 < 900 - 600 < 400: old overtakes


def test_zero_aging_is_a_setting_shortest_remaining_first():
    """aging_tokens_per_s=0 orders by remaining tokens alone (it used to fall back to the
    derived credit, as if unset); a negative credit is refused."""
    from laps_jax.scheduler.policy import derive
    d = derive(SchedulerConfig(threshold=64, order="aging", aging_tokens_per_s=0.0,
                               max_postpone_s=0.0), GRID, MODEL)
    assert d.aging == 0.0 and d.max_postpone_s == 0.0
    assert derive(SchedulerConfig(threshold=64, order="aging"), GRID, MODEL).aging > 0
    pool = LongPool(GRID, 256, d.aging, 100.0, d.order)
    old, young = req(900), req(400)
    pool.add(old, 0.0)
    pool.add(young, 500.0)
    assert pool.ordered(1000.0) == [young, old]  # however long the 900-token one waited
    with pytest.raises(ValueError, match="aging_tokens_per_s"):
        derive(SchedulerConfig(threshold=64, aging_tokens_per_s=-1.0), GRID, MODEL)


def test_srpt_order_serves_fewest_remaining_until_a_request_waited_max_wait():
    pool = LongPool(GRID, 256, 0.0, 100.0, "srpt", max_wait_s=1.0)
    big, mid, small = req(900), req(500), req(300)
    pool.add(big, 0.0)
    pool.add(mid, 0.5)
    pool.add(small, 0.9)
    assert pool.ordered(0.95) == [small, mid, big]   # nobody overdue: fewest remaining first
    assert pool.ordered(1.2) == [big, small, mid]    # big waited 1.2 s >= 1.0: it goes first
    assert pool.ordered(1.6) == [big, mid, small]    # both overdue: longest waiting first
    from laps_jax.scheduler.policy import derive
    d = derive(SchedulerConfig(threshold=64, order="srpt"), GRID, MODEL)
    assert d.order == "srpt" and 0 < d.max_wait_s < 10  # derived from the model's full step
    with pytest.raises(ValueError, match="order must be one of"):
        derive(SchedulerConfig(order="sjf"), GRID, MODEL)


def test_starvation_bound_is_on_the_long_pool_and_serves_the_longest_waiting():
    pool = LongPool(GRID, 256, 0.0, max_postpone_s=0.5)
    a, b = req(300), req(2000)
    pool.add(a, 0.0)
    pool.add(b, 0.0)
    assert pool.starved(0.4) is None
    a.last_served = 0.45
    pool.dispatched(0.45, forced=False)  # a long step ran: the clock restarts
    assert pool.starved(0.9) is None
    assert pool.starved(0.95) is b       # postponed 0.5 s since the last long step
    plan = pool.plan(0.95, first=b)
    assert plan.work[0][0] is b and plan.forced


def _sim_dispatcher(mode="laps", config=None, model=MODEL, lanes=1):
    clock = SimClock()
    mk = lambda name: SimExecutor(SimEngine(GRID, 2049, 16, 4096, 1000), model, clock, name)
    extra = {"long_engine": mk("long")} if lanes == 2 else {}
    return Dispatcher(mk("short"), mode, config or SchedulerConfig(threshold=64), clock=clock,
                      latency_model=model, **extra), clock


def test_starvation_bound_under_a_stream_of_short_requests():
    async def main():
        cfg = SchedulerConfig(threshold=64, max_postpone_s=0.3,
                              window=WindowConfig(mode="off"))
        d, clock = _sim_dispatcher(config=cfg)
        await d.start()
        long_h = d.submit(list(range(10, 1010)), SamplingParams(max_tokens=1))
        shorts = []
        while clock.now() < 3.0:  # more short work than the device can do
            shorts.append(d.submit([7] * 40 + [len(shorts)], SamplingParams(max_tokens=1)))
            await clock.sleep(0.002)
        st = await long_h.result()
        for h in shorts:
            h.abort()
        await d.stop()
        return st
    st = run_simulated(main())
    assert st.pool == LONG
    # four 256-token chunks, each at most one bound (+ a step) after the previous
    assert st.ttft < 4 * (0.3 + 0.1)


def test_classification_uses_new_tokens_after_the_prefix_match():
    async def main():
        d, clock = _sim_dispatcher()
        await d.start()
        first = d.submit(list(range(10, 510)), SamplingParams(max_tokens=8))
        s1 = await first.result()
        turn2 = first.request.seq.prompt + first.tokens + [3, 4, 5, 6, 7]
        s2 = await d.submit(turn2, SamplingParams(max_tokens=2)).result()
        await d.stop()
        return s1, s2
    s1, s2 = run_simulated(main())
    assert s1.pool == LONG and s1.new_tokens == 500
    assert s2.pool == SHORT and s2.cached_tokens >= 496 and s2.new_tokens <= 32


@pytest.mark.parametrize("handoff", [True, False])
def test_spatial_routes_by_length_and_by_where_the_history_is(handoff):
    async def main():
        d, clock = _sim_dispatcher("laps-spatial", lanes=2,
                                   config=SchedulerConfig(threshold=64, kv_handoff=handoff))
        await d.start()
        a = d.submit(list(range(10, 40)), SamplingParams(max_tokens=2))
        b = d.submit(list(range(100, 700)), SamplingParams(max_tokens=4))
        sa, sb = await a.result(), await b.result()
        follow = b.request.seq.prompt + b.tokens + [1, 2, 3]
        sc = await d.submit(follow, SamplingParams(max_tokens=2)).result()
        m = d.metrics()
        await d.stop()
        return sa, sb, sc, m
    sa, sb, sc, m = run_simulated(main())
    assert (sa.lane, sa.pool) == ("short", SHORT)
    assert (sb.lane, sb.pool) == ("long", LONG)
    # a short follow-up turn goes where its history is cached: with the hand-off, b decoded in
    # the short group, which then holds prompt + answer; without, the long group does
    assert (sc.lane, sc.pool) == ("short" if handoff else "long", SHORT)
    assert sc.cached_tokens >= 592
    assert m.lanes[0].counters.handoffs_in == (1 if handoff else 0)
    assert [l.name for l in m.lanes] == ["short", "long"]


def test_virtual_time_window_batches_short_arrivals():
    async def main():
        cfg = SchedulerConfig(threshold=64, window=WindowConfig(mode="static", static_s=0.010))
        d, clock = _sim_dispatcher(config=cfg)
        await d.start()
        hs = []
        for _ in range(3):
            hs.append(d.submit([5] * 20 + [len(hs)], SamplingParams(max_tokens=1)))
            await clock.sleep(0.002)
        stats = [await h.result() for h in hs]
        m = d.metrics()
        await d.stop()
        return stats, m
    stats, m = run_simulated(main())
    assert {s.prefill_done for s in stats} == {stats[0].prefill_done}  # one batch of three
    assert stats[0].prefill_done >= 0.010
    lane = m.lanes[0]
    assert lane.counters.prefill_batch_sizes == {3: 1} and lane.window_waits == 1


def test_abort_leaves_the_pool_and_frees_pages_at_once():
    async def main():
        d, clock = _sim_dispatcher()
        await d.start()
        h = d.submit(list(range(10, 1210)), SamplingParams(max_tokens=4))
        await clock.sleep(0.001)
        ex = d.lanes[0].executor
        used_before = ex.engine.kv.num_used
        h.abort()
        await clock.sleep(0.2)
        st = await h.result()
        m = d.metrics()
        await d.stop()
        return used_before, st, m, ex.engine.kv.num_used
    before, st, m, after = run_simulated(main())
    assert before > 0 and after == 0
    assert st.finish_reason == "abort" and m.aborted == 1 and m.queue_length(LONG) == 0


def test_submit_rejects_what_can_never_run():
    async def main():
        d, _ = _sim_dispatcher()
        await d.start()
        with pytest.raises(ValueError, match="4096"):
            d.submit([1] * 4000, SamplingParams(max_tokens=200))
        with pytest.raises(ValueError, match="empty"):
            d.submit([], SamplingParams())
        await d.stop()
    run_simulated(main())


def test_abort_during_a_decode_step_loses_no_other_request():
    async def main():
        d, clock = _sim_dispatcher(config=SchedulerConfig(threshold=64,
                                                          window=WindowConfig(mode="off")))
        await d.start()
        hs = [d.submit([9] * 10 + [i], SamplingParams(max_tokens=20)) for i in range(12)]
        while len(hs[0].tokens) < 3:  # 12 decoders, 8 per decode step: round robin
            await clock.sleep(0.001)
        hs[0].abort()
        stats = [await h.result() for h in hs]
        await d.stop()
        return stats
    stats = run_simulated(main())
    assert stats[0].finish_reason == "abort"
    assert all(s.finish_reason == "length" and s.output_tokens == 20 for s in stats[1:])


class _SlowRelease(SimExecutor):
    """Releases take time, as the real executor's hop to its worker thread does."""

    async def release(self, seqs, reason):
        await self.clock.sleep(0.004)
        await super().release(seqs, reason)


def test_a_hand_off_during_a_decode_steps_abort_release_is_not_lost():
    """A KV hand-off lands in the short lane while that lane is releasing an aborted decoder
    after a decode step (the lane used to overwrite its decode list with a copy taken
    before that await: the handed-off request was dropped and never finished)."""
    async def main():
        clock = SimClock()
        engine = lambda: SimEngine(GRID, 2049, 16, 4096, 1000)
        d = Dispatcher(_SlowRelease(engine(), MODEL, clock, "short"), "laps-spatial",
                       SchedulerConfig(threshold=64, window=WindowConfig(mode="off")),
                       long_engine=SimExecutor(engine(), MODEL, clock, "long"), clock=clock,
                       latency_model=MODEL)
        await d.start()
        longs, shorts = [], []
        for i in range(40):
            shorts.append(d.submit([5, i] + [9] * 20, SamplingParams(max_tokens=30)))
            if i % 2 == 0:
                longs.append(d.submit([i] + list(range(100, 400)), SamplingParams(max_tokens=6)))
            await clock.sleep(0.003)
            shorts[max(0, i - 4)].abort()  # decoding by now
        while clock.now() < 30 and not all(h.request.done for h in longs):
            await clock.sleep(0.05)
        done = [h.request.done for h in longs]
        m = d.metrics()
        await d.stop()
        return done, [await h.result() for h in longs] if all(done) else [], m, d
    done, stats, m, d = run_simulated(main())
    assert all(done)
    assert all(s.finish_reason == "length" and s.output_tokens == 6 for s in stats)
    assert m.lanes[0].counters.handoffs_in == len(stats)
    assert [lane.executor.engine.kv.num_used for lane in d.lanes] == [0, 0]


def test_cross_pool_aging_lets_a_long_waiter_overtake_a_ready_short_batch():
    from laps_jax.scheduler.policy import LapsPlanner, derive
    for cross, first in (("short-first", SHORT), ("aging", LONG)):
        d = derive(SchedulerConfig(threshold=64, aging_tokens_per_s=100.0, max_postpone_s=100.0,
                                   window=WindowConfig(mode="off"), cross_pool=cross),
                   GRID, None)
        planner = LapsPlanner(GRID, d)
        long_r, short_r = req(300), req(20)
        long_r.stats.pool, short_r.stats.pool = LONG, SHORT
        planner.add(long_r, 0.0)
        planner.add(short_r, 2.9)
        assert planner.plan(2.9).pool == first  # long: 300 - 290 = 10 < short: 20


def test_response_ratio_order_ages_in_proportion_to_size():
    pool = LongPool(GRID, 256, 0.0, 100.0, order="ratio", service=lambda n: n / 1000.0)
    big, small = req(1000), req(100)
    pool.add(big, 0.0)
    pool.add(small, 0.5)
    assert pool.ordered(0.5)[0] is big       # ratios: big (0.5+1)/1 = 1.5, small 1.0
    assert pool.ordered(0.6)[0] is small     # 1.6 vs 2.0
    late = req(100)
    pool.add(late, 0.95)
    assert pool.ordered(0.95)[:2] == [small, big]  # 5.5, 1.95 > late's 1.0


def test_decode_gap_defaults_to_one_full_prefill_step():
    from laps_jax.scheduler.latency_model import StepShape
    from laps_jax.scheduler.policy import derive
    full = MODEL.predict(StepShape.exact((GRID.max_chunk,)))
    assert derive(SchedulerConfig(), GRID, MODEL).decode_gap_s == pytest.approx(full)
    assert derive(SchedulerConfig(decode_gap_s=0.0), GRID, MODEL).decode_gap_s == 0.0
    assert derive(SchedulerConfig(), GRID, None).decode_gap_s == 0.0


def test_long_chunk_is_the_widest_bucket_within_ratio_of_the_cheapest_step():
    from laps_jax.scheduler.policy import long_chunk
    grid = BucketGrid.default(max_chunk=512, max_prefill_batch=8, max_decode_batch=8,
                              min_tokens=16, max_batch_tokens=512)
    cpu = lambda n: 0.005 + 1e-4 * n      # compute-bound: 16 -> 6.6 ms, 256 -> 30.6, 512 -> 56.2
    assert long_chunk(grid, 512, cpu, 5.0) == 256
    assert long_chunk(grid, 512, cpu, 10.0) == 512
    assert long_chunk(grid, 512, cpu, 1.0) == 16     # never under the smallest bucket
    assert long_chunk(grid, 128, cpu, 10.0) == 128   # never over the budget
    assert long_chunk(grid, 512, cpu, None) == 512   # off: the step budget, as in mixed
    gpu = lambda n: 0.015 + 2e-5 * n      # weights dominate a small step
    assert long_chunk(grid, 512, gpu, 5.0) == 512


def test_decode_gap_is_one_full_budget_step_whatever_the_long_chunk():
    """Smaller long chunks must not bring more decode steps with them (on this CPU a 16-row
    decode step costs a fifth of a full prefill step)."""
    from laps_jax.scheduler.latency_model import StepShape
    from laps_jax.scheduler.policy import derive
    full = MODEL.predict(StepShape.exact((GRID.max_chunk,)))
    d = derive(SchedulerConfig(long_budget_tokens=32), GRID, MODEL)
    assert d.long_budget == 32 and d.decode_gap_s == pytest.approx(full)
    with pytest.raises(ValueError, match="long_chunk_ratio"):
        derive(SchedulerConfig(long_chunk_ratio=0.0), GRID, MODEL)


def test_long_pool_takes_wider_steps_only_while_behind():
    """With more requests waiting than the overload mark the long pool packs under the
    overload budget (fewer, more efficient steps once the device is behind); at or under it,
    small chunks -- whatever the tokens: one huge prompt is not a queue."""
    pool = LongPool(GRID, 128, 0.0, 100.0, "srpt", overload=(2, 512, True))
    a, b, c = req(3000), req(300), req(400)
    for r in (a, b):
        pool.add(r, 0.0)
    plan = pool.plan(0.0)
    assert [n for _, n in plan.work] == [128] and not plan.overload
    pool.add(c, 0.0)  # three waiting > 2
    plan = pool.plan(0.0)
    assert plan.overload and sum(n for _, n in plan.work) > 128
    assert plan.bucket.batch * plan.bucket.tokens <= 512
    pool.dispatched(0.0, plan.forced, plan.overload)
    pool.remove(b)  # back to two
    plan = pool.plan(0.1)
    assert not plan.overload and sum(n for _, n in plan.work) <= 128
    assert pool.overload_steps == 1
    off = LongPool(GRID, 128, 0.0, 100.0, "srpt")  # no overload mark: always the long budget
    for n in (2000, 300, 400, 500):
        off.add(req(n), 0.0)
    assert not off.plan(0.0).overload and sum(n for _, n in off.plan(0.0).work) <= 128


def test_overload_step_pads_no_more_than_the_chunks_it_replaces():
    """Behind, a wider step is taken only if its bucket holds no more tokens than the one-row
    long-budget chunks doing the same work: one packed around a short remainder loses."""
    def pool(check: bool, lengths) -> LongPool:
        p = LongPool(GRID, 128, 0.0, 100.0, "srpt", overload=(1, 512, check))
        for n in lengths:
            p.add(req(n), 0.0)
        return p
    # wide: 140 + a 256 chunk in a (2, 256) bucket = 512 slots; as 128-token chunks
    # (128 + 16) + (128 + 128) = 400 slots
    plan = pool(True, (140, 3000)).plan(0.0)
    assert not plan.overload and [n for _, n in plan.work] == [128]
    assert pool(False, (140, 3000)).plan(0.0).overload  # unchecked: widened all the same
    plan = pool(True, (2000, 3000)).plan(0.0)  # two full 256 chunks: 512 slots either way
    assert plan.overload and [n for _, n in plan.work] == [256, 256]


def test_overload_mark_applies_only_below_the_full_budget():
    from laps_jax.scheduler.policy import derive
    d = derive(SchedulerConfig(long_budget_tokens=128, overload_requests=3), GRID, MODEL)
    assert d.long_budget == 128 and d.overload_requests == 3
    assert d.overload_budget == 256 and d.overload_check  # twice the chunk, under 512
    assert derive(SchedulerConfig(long_budget_tokens=384), GRID, MODEL).overload_budget == 512
    assert derive(SchedulerConfig(long_budget_tokens=128, overload_requests=None), GRID,
                  MODEL).overload_requests is None
    # chunks already at the full budget: nothing to switch to
    assert derive(SchedulerConfig(long_chunk_ratio=None), GRID, MODEL).overload_requests is None
    with pytest.raises(ValueError, match="overload_requests"):
        derive(SchedulerConfig(overload_requests=-1), GRID, MODEL)


@pytest.mark.parametrize("device, filled", [
    (DeviceSpec("h200-like", 790e12, 4.8e12, 2e-3), False),  # compute-bound: tokens cost time
    (DeviceSpec("memory-bound", 1e16, 1e12, 2e-3), True),    # the weights' read dominates
])
def test_a_long_step_that_finishes_a_request_is_filled_only_while_nearly_free(device, filled):
    """A 200-token long request ahead of a 3,000-token one (Qwen2.5-32B shapes): filled to
    the chunk, its step also carries 256 of the big one's tokens. With finish_slack the step
    takes them only where predicted within the slack of the request alone: on an H200-like
    device they double it, on a memory-bound one they are nearly free."""
    from laps_jax.scheduler.latency_model import StepShape
    from laps_jax.scheduler.policy import LapsPlanner, derive
    grid = BucketGrid.default(max_chunk=512, max_prefill_batch=4, max_decode_batch=8,
                              min_tokens=16, max_batch_tokens=1024)
    model = LatencyModel(PRESETS["qwen2.5-32b"], 2, device)  # shapes only, nothing allocated

    def first_step(finish_slack, lengths=(3000, 200)):
        d = derive(SchedulerConfig(threshold=64, long_budget_tokens=512, max_postpone_s=100.0,
                                   finish_slack=finish_slack, window=WindowConfig(mode="off")),
                   grid, model)
        p = LapsPlanner(grid, d)
        for n in lengths:
            r = req(n)
            r.stats.pool = LONG
            p.add(r, 0.0)
        return p.plan(0.0), d

    plan, _ = first_step(None)
    assert [n for _, n in plan.work] == [200, 256]  # filled to the chunk: 2 x 256
    plan, d = first_step(0.1)
    alone = model.predict(StepShape.bucketed([200], [0], 1, 256))
    if filled:
        assert [n for _, n in plan.work] == [200, 256]
        assert d.predict(plan.work, plan.bucket) <= 1.1 * alone
    else:
        assert [n for _, n in plan.work] == [200] and plan.bucket.batch == 1
        assert model.predict(StepShape.bucketed([200, 256], [0, 0], 2, 256)) > 1.1 * alone
    # a first request the step does not finish fills the chunk itself either way
    plan, _ = first_step(0.1, lengths=(3000, 900))
    assert [n for _, n in plan.work] == [512]
    with pytest.raises(ValueError, match="finish_slack"):
        derive(SchedulerConfig(finish_slack=-0.1), grid, model)


def test_laps_spatial_long_group_keeps_full_chunks():
    """The ratio sizes laps' long chunks so short work is not held up; in laps-spatial the long
    group runs no short work, so its chunks stay the full budget."""
    cfg = SchedulerConfig(threshold=64, long_chunk_ratio=1.0)
    laps, _ = _sim_dispatcher("laps", config=cfg)
    spatial, _ = _sim_dispatcher("laps-spatial", config=cfg, lanes=2)
    assert laps.derived.long_budget == GRID.prefill_tokens[0]
    assert spatial.derived.long_budget == GRID.max_batch_tokens


@pytest.mark.parametrize("mode", ["mixed", "laps"])
def test_prefill_steps_run_back_to_back_within_the_decode_gap(mode):
    """A decoding request does not get a decode step after every prefill step while the gap
    allows: the same queued prefills finish sooner than with a decode step after each."""
    def last_prefill(gap: float) -> tuple[float, int]:
        async def main():
            cfg = SchedulerConfig(threshold=64, decode_gap_s=gap, window=WindowConfig(mode="off"))
            d, clock = _sim_dispatcher(mode, config=cfg)
            await d.start()
            dec = d.submit([7] * 10, SamplingParams(max_tokens=40, ignore_eos=True))
            await clock.sleep(0.05)  # decoding by now
            hs = [d.submit([9] * 200 + [i], SamplingParams(max_tokens=1)) for i in range(6)]
            stats = [await h.result() for h in hs]
            await dec.result()
            steps = d.metrics().lanes[0].counters.prefill_steps
            await d.stop()
            return max(s.prefill_done for s in stats), steps
        return run_simulated(main())
    (alternate, steps0), (gapped, steps1) = last_prefill(0.0), last_prefill(10.0)
    assert steps0 == steps1 >= 4  # the same prefill steps (one for `dec`, >= 3 for the six)
    assert gapped < alternate


def test_a_short_batchs_empty_bucket_rows_carry_long_chunks():
    """Three short requests fill 3 of a 4 x 32 bucket's rows: the fourth, padding either way,
    takes a 32-token chunk of the long pool's first request (fewest remaining). The bucket
    does not grow, a full bucket takes nothing, and fill_rows=False keeps the batch short-only."""
    from laps_jax.scheduler.policy import LapsPlanner, derive

    def planner_with(shorts, fill=True):
        d = derive(SchedulerConfig(threshold=64, max_postpone_s=100.0, fill_rows=fill,
                                   window=WindowConfig(mode="off")), GRID, None)
        p = LapsPlanner(GRID, d)
        longs = [req(300), req(100)]
        for r in longs:
            r.stats.pool = LONG
            p.add(r, 0.0)
        for n in shorts:
            r = req(n, 0.1)
            r.stats.pool = SHORT
            p.add(r, 0.1)
        return p, longs

    p, (big, small) = planner_with([20, 18, 30])
    plan = p.plan(0.2)
    assert plan.pool == SHORT and (plan.bucket.batch, plan.bucket.tokens) == (4, 32)
    assert [n for _, n in plan.work] == [18, 20, 30, 32] and plan.work[-1][0] is small
    assert plan.filled_tokens == 32 and GRID.fit_prefill(4, 32) == plan.bucket
    p, _ = planner_with([20, 18, 30], fill=False)
    plan = p.plan(0.2)
    assert len(plan.work) == 3 and plan.filled_tokens == 0
    p, _ = planner_with([20, 18, 30, 25])
    assert len(p.plan(0.2).work) == 4  # the bucket is full: no long row
    p, (big, small) = planner_with([20, 18, 30])
    small.seq.num_computed = 90      # 10 left: the chunk is what remains, not the width
    assert p.plan(0.2).work[-1] == (small, 10)


@pytest.mark.parametrize("device, rows", [
    (DeviceSpec("h200-like", 790e12, 4.8e12, 2e-3), 3),  # weights and overhead dominate
    (DeviceSpec("cpu-like", 1e11, 1e15, 1e-4), 1),       # a row costs its tokens: no growth
])
def test_with_a_model_a_short_batch_grows_rows_for_long_chunks_only_while_nearly_free(device,
                                                                                      rows):
    """One 20-token short request (a 1 x 32 bucket) and two long ones: where the step is
    memory-bound, the batch grows into a 4 x 32 bucket with both long requests' 32-token chunks
    (predicted within fill_slack of the short batch alone); where compute-bound, it runs alone."""
    from laps_jax.scheduler.latency_model import StepShape
    from laps_jax.scheduler.policy import LapsPlanner, derive
    model = LatencyModel(PRESETS["qwen2.5-0.5b"], 2, device)  # shapes only, nothing allocated
    d = derive(SchedulerConfig(threshold=64, max_postpone_s=100.0,
                               window=WindowConfig(mode="off")), GRID, model)
    p = LapsPlanner(GRID, d)
    for n, pool in ((300, LONG), (100, LONG), (20, SHORT)):
        r = req(n)
        r.stats.pool = pool
        p.add(r, 0.0)
    plan = p.plan(0.1)
    assert plan.pool == SHORT and [n for _, n in plan.work] == [20, 32, 32][:rows]
    alone = model.predict(StepShape.bucketed([20], [0], 1, 32))
    if rows > 1:
        assert (plan.bucket.batch, plan.bucket.tokens) == (4, 32) and plan.filled_tokens == 64
        assert d.predict(plan.work, plan.bucket) <= (1 + d.fill_slack) * alone
    else:
        assert (plan.bucket.batch, plan.bucket.tokens) == (1, 32)
        grown = model.predict(StepShape.bucketed([20, 32], [0, 0], 2, 32))
        assert grown > (1 + d.fill_slack) * alone  # why it did not grow
