"""The simulator on cases small enough to check by hand, and whole runs (determinism, the
physical limit).

Everything runs on virtual time (no model, no compiles): each test takes milliseconds.
"""

from __future__ import annotations

import asyncio

import pytest

from laps_jax.config import PRESETS
from laps_jax.scheduler.clock import run_simulated
from laps_jax.scheduler.window import WindowConfig
from laps_jax.sim import hardware
from laps_jax.sim import workload as wl
from laps_jax.sim.driver import RunSpec, simulate
from laps_jax.sim.executor import SharedDevice
from laps_jax.sim.instance import GridSpec, InstanceSpec
from laps_jax.sim.summary import summarize
from sim_fixtures import replay, spec, step


# -- hand-checkable cases --------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["mixed", "laps", "laps-spatial"])
def test_one_request_ttft_is_one_predicted_step(mode):
    (st,) = replay(spec(mode), [(0.0, 20)])
    assert st.ttft == pytest.approx(step([20], 32))


def test_one_short_request_waits_out_a_static_window():
    (st,) = replay(spec("laps", window=WindowConfig(mode="static", static_s=0.05)), [(0.0, 20)])
    assert st.ttft == pytest.approx(0.05 + step([20], 32))


def test_a_window_that_expires_batches_what_came_in_time():
    inst = spec("laps", window=WindowConfig(mode="static", static_s=0.05))
    a, b = replay(inst, [(0.0, 20), (0.02, 30)])
    both = step([20, 30], 32)  # one step of two rows, dispatched when the window ends
    assert a.ttft == pytest.approx(0.05 + both)
    assert b.ttft == pytest.approx(0.03 + both)


def test_two_requests_in_a_known_order():
    """A long step runs; a long B and a short C arrive during it. mixed serves B first (FCFS),
    laps serves C first (short pool first). Steps are not preempted."""
    arrivals = [(0.0, 200), (0.001, 150), (0.002, 10)]
    da, db, dc = step([200], 256), step([150], 256), step([10], 16)
    _, b, c = replay(spec("mixed"), arrivals)
    assert b.ttft == pytest.approx(da + db - 0.001)
    assert c.ttft == pytest.approx(da + db + dc - 0.002)
    _, b, c = replay(spec("laps"), arrivals)
    assert c.ttft == pytest.approx(da + dc - 0.002)
    assert b.ttft == pytest.approx(da + dc + db - 0.001)


def test_a_short_request_waits_out_one_long_chunk_not_the_whole_prompt():
    """laps cuts long prompts into chunks predicted to take at most 5 cheapest steps: a short
    request arriving during a long prefill waits for the chunk that is running, no more."""
    cheapest = step([16], 16)
    w = max(t for t in (16, 32, 64, 128, 256) if step([t], t) <= 5 * cheapest)
    assert w < 200  # the toy device is compute-bound: 200 tokens are more than 5 small steps
    arrivals = [(0.0, 200), (0.001, 10)]
    _, c = replay(spec("laps", long_chunk_ratio=5.0), arrivals)
    assert c.ttft == pytest.approx(step([w], w) + step([10], 16) - 0.001)
    _, whole = replay(spec("laps"), arrivals)
    assert whole.ttft == pytest.approx(step([200], 256) + step([10], 16) - 0.001)


def test_shared_device_is_processor_sharing():
    async def main():
        dev, loop = SharedDevice(0.0), asyncio.get_running_loop()
        done = {}

        async def job(name, start, solo):
            await asyncio.sleep(start)
            await dev.run(solo)
            done[name] = loop.time()
        await asyncio.gather(job("a", 0.0, 1.0), job("b", 0.5, 1.0))
        return done
    done = run_simulated(main())
    assert done["a"] == pytest.approx(1.5)   # alone 0.5 s, then half speed for 1 s
    assert done["b"] == pytest.approx(2.0)


def test_waiters_woken_early_still_move_virtual_time():
    """asyncio fires a timer up to its clock resolution early. Two tasks that each wait until
    the same instant 10 ps away, one step apart, and wait again while it has not come, kept
    each other ready, so virtual time never reached it (eight simulated lanes once spun so until killed)."""
    async def main():
        loop = asyncio.get_running_loop()
        target = loop.time() + 1e-11
        waits = [0, 0]

        async def until_target(k):
            for _ in range(k):  # staggered: one is always ready when the other's timer is due
                await asyncio.sleep(0)
            while loop.time() < target and waits[k] < 10_000:
                waits[k] += 1
                await asyncio.sleep(target - loop.time())
        await asyncio.gather(until_target(0), until_target(1))
        return loop.time(), waits
    now, waits = run_simulated(main())
    assert now >= 1e-11 and max(waits) <= 2, waits


# -- whole runs -------------------------------------------------------------------------------
def _lmsys_run(seed: int, mode: str = "laps"):
    src = hardware.roofline("qwen2.5-32b")
    w = wl.load("lmsys", max_requests=60, seed=seed, rate=4.0)
    inst = InstanceSpec(mode, GridSpec(), kv_cache_tokens=200_000)
    rs = RunSpec(inst, rate=4.0)
    result = simulate(rs, src, w)
    return result, summarize(result, rs, src)


def test_same_seed_same_result_other_seed_other_result():
    r1, s1 = _lmsys_run(3)
    r2, s2 = _lmsys_run(3)
    r3, _ = _lmsys_run(4)
    key = lambda r: sorted((s.request_id, s.arrival, s.ttft, s.cached_tokens) for s in r.stats)
    assert key(r1) == key(r2) and s1 == s2
    assert key(r1) != key(r3)
    lo, hi = r1.window  # sessions are measured in their steady-state window
    assert s1["completed"] == sum(lo <= s.arrival <= hi for s in r1.stats) > 0
    assert s1["requests_per_s"] * s1["prefill_span_s"] == sum(
        lo <= s.prefill_done <= hi for s in r1.stats)
    assert s1["cached_tokens"] > 0  # later turns re-use their history


def test_physical_limit_of_qwen_32b_on_h200():
    cfg = PRESETS["qwen2.5-32b"]
    assert hardware.flops_per_token(cfg) == pytest.approx(65.5e9, rel=0.01)
    assert hardware.physical_limit_tokens_per_s(cfg, hardware.H200) == pytest.approx(12_060,
                                                                                     rel=0.01)
    assert 150_000 < hardware.kv_capacity_tokens(cfg, hardware.H200) < 300_000
