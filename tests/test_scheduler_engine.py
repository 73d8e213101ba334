"""The dispatcher over real engines (tiny preset, small bucket grid, CPU)."""

from __future__ import annotations

import asyncio
import random

import pytest

from laps_jax.config import PRESETS, EngineConfig
from laps_jax.engine.engine import Engine
from laps_jax.engine.executables import jax_compile_events
from laps_jax.engine.sequence import SamplingParams
from laps_jax.models.qwen2 import init_params
from laps_jax.scheduler import Dispatcher, SchedulerConfig, WindowConfig
from laps_jax.scheduler.request import LONG, SHORT

CFG = PRESETS["tiny"]
ECFG = dict(page_size=8, kv_cache_tokens=4096, max_model_len=512, max_chunk=64, min_chunk=16,
            max_prefill_batch=4, max_decode_batch=4, max_batch_tokens=128)


@pytest.fixture(scope="module")
def engines():
    """Two warmed-up engines with the same weights (the second is the spatial long group).
    The lm_head is scaled up so greedy argmax is decided by clear margins, not rounding."""
    params = init_params(CFG, seed=3)
    params["lm_head"] = params["lm_head"] * 40.0
    made = []
    for _ in range(2):
        e = Engine(CFG, params, EngineConfig(**ECFG))
        e.warmup()
        made.append(e)
    return made


def _dispatcher(engines, mode, **cfg):
    cfg.setdefault("threshold", 32)
    long = {"long_engine": engines[1]} if mode == "laps-spatial" else {}
    for e in engines:
        e.kv.clear_prefix_cache()
    return Dispatcher(engines[0], mode, SchedulerConfig(**cfg), **long)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if out and rng.random() < 0.3:  # a follow-up that repeats an earlier prompt
            base = rng.choice(out)
            out.append(base + [rng.randrange(10, 500) for _ in range(rng.randint(1, 40))])
        else:
            out.append([rng.randrange(10, 500) for _ in range(rng.randint(1, 150))])
    return out


@pytest.mark.parametrize("mode", ["mixed", "laps", "laps-spatial"])
async def test_every_mode_matches_one_at_a_time(engines, mode):
    prompts = _prompts(1, 10)
    params = SamplingParams(max_tokens=5)
    engines[0].kv.clear_prefix_cache()
    expected = [engines[0].generate([p], params)[0].output for p in prompts]
    d = _dispatcher(engines, mode)
    await d.start()
    handles = []
    for p in prompts:
        handles.append(d.submit(p, params))
        await asyncio.sleep(0.002)
    got = []
    for h in handles:
        got.append([ev.token_id async for ev in h])
    stats = [await h.result() for h in handles]
    m = d.metrics()
    await d.stop()
    assert got == expected
    assert {s.pool for s in stats} == {SHORT, LONG}
    assert all(s.ttft is not None and s.ttft > 0 for s in stats)
    if mode == "laps-spatial":  # every prefill of the long group decoded in the short group
        # (the long group also takes short follow-ups whose history it caches)
        long_done = sum(s.lane == "long" for s in stats)
        assert long_done >= sum(s.pool == LONG for s in stats) > 0
        assert m.lanes[0].counters.handoffs_in == long_done
        assert m.lanes[1].counters.decode_steps == 0
        assert engines[0].kv.num_used == 0 and engines[1].kv.num_used == 0


async def test_long_chunks_in_a_short_batchs_empty_rows_give_the_same_tokens(engines):
    """laps fills the bucket rows a short batch leaves empty with chunks of long prompts: two
    long prompts and three short ones arrive together, the short batch runs in a 4-row bucket
    with a long chunk in its fourth row, and every request still decodes what it decodes alone."""
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in (140, 90, 12, 20, 27)]
    params = SamplingParams(max_tokens=4)
    engines[0].kv.clear_prefix_cache()
    expected = [engines[0].generate([p], params)[0].output for p in prompts]
    d = _dispatcher(engines, "laps", window=WindowConfig(mode="off"))
    await d.start()
    handles = [d.submit(p, params) for p in prompts]  # no await between: admitted together
    got = [[ev.token_id async for ev in h] for h in handles]
    m = d.metrics()
    await d.stop()
    assert got == expected
    assert m.lanes[0].counters.filled_long_tokens > 0


async def _random_run(d, rng, prompts, params, abort_p, abort_s, gap_s):
    """Submits every prompt at random gaps, aborting some at a random moment; waits for all,
    stops the dispatcher; returns the requests' stats and the final metrics."""
    handles = []
    for p in prompts:
        h = d.submit(p, params())
        handles.append(h)
        if rng.random() < abort_p:
            asyncio.get_running_loop().call_later(rng.uniform(0, abort_s), h.abort)
        await asyncio.sleep(rng.uniform(0, gap_s))
    stats = [await h.result() for h in handles]
    m = d.metrics()
    await d.stop()
    return stats, m


async def test_spatial_handoff_under_aborts_frees_pages_and_never_compiles(engines):
    rng = random.Random(11)
    d = _dispatcher(engines, "laps-spatial")
    await d.start()  # compiles the page copies
    before = jax_compile_events()
    stats, m = await _random_run(
        d, rng, _prompts(5, 60), lambda: SamplingParams(max_tokens=rng.randint(1, 6)),
        abort_p=0.15, abort_s=0.03, gap_s=0.003)
    assert jax_compile_events() == before and m.compiles_after_warmup == 0
    assert m.finished + m.aborted == 60 and m.failed == 0 and m.running == 0
    assert m.lanes[0].counters.handoffs_in > 0
    assert engines[0].kv.num_used == 0 and engines[1].kv.num_used == 0
    assert all(s.finish_reason in ("length", "abort") for s in stats)


async def test_no_compile_after_warmup_in_a_random_run_of_200(engines):
    rng = random.Random(7)
    before = jax_compile_events()
    steps_before = sum(engines[0].runner.stats.steps.values())
    d = _dispatcher(engines, "laps", window=WindowConfig(mode="adaptive", max_s=0.003))
    await d.start()
    stats, m = await _random_run(
        d, rng, [p[:400] for p in _prompts(2, 200)],
        lambda: SamplingParams(max_tokens=rng.randint(1, 5),
                               temperature=rng.choice([0.0, 0.8]), seed=1),
        abort_p=0.05, abort_s=0.05, gap_s=0.004)
    assert m.compiles_after_warmup == 0
    assert jax_compile_events() == before
    assert m.finished + m.aborted == 200 and m.failed == 0 and m.running == 0
    assert all(s.finish_reason in ("length", "abort") for s in stats)
    lane = m.lanes[0]
    assert sum(lane.executor.bucket_steps.values()) - steps_before == (
        lane.counters.prefill_steps + lane.counters.decode_steps)
    assert lane.executor.kv_pages_used == 0
    assert set(lane.counters.prefill_steps_by_pool) <= {SHORT, LONG}


async def _wait_for(cond, timeout=20.0):
    t0 = asyncio.get_running_loop().time()
    while not cond():
        if asyncio.get_running_loop().time() - t0 > timeout:
            raise TimeoutError
        await asyncio.sleep(0.001)


async def test_abort_frees_pages_during_prefill_and_decode(engines):
    d = _dispatcher(engines, "laps")
    kv = engines[0].kv
    await d.start()
    long_h = d.submit(list(range(10, 410)), SamplingParams(max_tokens=4))
    await _wait_for(lambda: long_h.request.seq.num_computed > 0)
    assert long_h.request.seq.remaining_prefill > 0
    long_h.abort()
    assert d.metrics().queue_length(LONG) == 0  # out of its pool at once
    await _wait_for(lambda: kv.num_used == 0)
    dec = d.submit(list(range(20, 60)), SamplingParams(max_tokens=300, ignore_eos=True))
    n = 0
    async for _ in dec:
        n += 1
        if n == 3:
            dec.abort()
    await _wait_for(lambda: kv.num_used == 0)
    m = d.metrics()
    await d.stop()
    assert (await long_h.result()).finish_reason == "abort"
    assert (await dec.result()).finish_reason == "abort" and m.aborted == 2


async def test_a_short_follow_up_of_a_long_conversation_is_short(engines):
    d = _dispatcher(engines, "laps")
    await d.start()
    first = d.submit(list(range(10, 210)), SamplingParams(max_tokens=6))
    s1 = await first.result()
    follow = first.request.seq.prompt + first.tokens + [7, 8, 9, 10, 11]
    s2 = await d.submit(follow, SamplingParams(max_tokens=2)).result()
    m = d.metrics()
    await d.stop()
    assert s1.pool == LONG and s1.new_tokens == 200
    assert s2.pool == SHORT and s2.cached_tokens >= 200 and s2.new_tokens <= 16
    assert m.lanes[0].executor.prefix_hit_tokens >= 200


def test_profile_speed_factor_times_its_shapes_now(engines, monkeypatch, tmp_path):
    """compare_modes rescales a profile to the machine's speed now: its shapes (buckets of
    this engine only) run again on the engine and the median now/then ratio is returned. Step
    times are made deterministic here (rows x tokens ms): a profile of half those says 2x."""
    from laps_jax.scheduler import profiling
    from laps_jax.scheduler.latency_model import StepShape
    from laps_jax.scheduler.profiling import Sample, speed_factor

    def fake_time(engine, seqs):
        engine.runner.run(seqs)  # still runs: an odd shape would compile here
        return 1e-3 * sum(len(s.new_tokens) for s in seqs)
    monkeypatch.setattr(profiling, "time_once", fake_time)
    e = engines[0]
    shapes = [StepShape.bucketed((n,) * b, (c,) * b, b, t)
              for b, t, n, c in [(1, 16, 16, 0), (1, 32, 30, 64), (1, 64, 64, 128), (2, 64, 50, 0),
                                 (4, 16, 12, 32), (4, 1, 1, 100), (2, 32, 32, 200),
                                 (1, 64, 40, 300)]]
    then = [Sample(s, 1e-3 * sum(s.new) / 2) for s in shapes]
    then[0] = Sample(then[0].shape, then[0].seconds * 4)  # one outlier: the median ignores it
    events = jax_compile_events()
    not_a_bucket = Sample(StepShape.bucketed((5,) * 3, (0,) * 3, 3, 5), 1e-3)
    f, n = speed_factor(e, then + [not_a_bucket], n=8, reps=2)
    assert n == 8 and jax_compile_events() == events  # the odd shape skipped, not compiled
    assert f == pytest.approx(2.0)
    assert speed_factor(e, [not_a_bucket]) == (1.0, 0)
    # load_profile (compare_modes --profile, serve.py --latency-profile) applies it
    import json

    from laps_jax.scheduler.latency_model import DeviceSpec, LatencyModel
    from laps_jax.scheduler.profiling import load_profile
    base = LatencyModel(CFG, 4, DeviceSpec("then", 1e11, 1e10, 2e-3, 5e10, 5e9, 3e10, False))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": "tiny", "latency_model": base.to_dict(),
                                "samples": [x.to_dict() for x in then]}))
    model, f = load_profile(str(path), e)
    shape = StepShape.exact((40,), (100,))
    assert f == pytest.approx(2.0) and model.predict(shape) == pytest.approx(2 * base.predict(shape))
    assert load_profile(str(path), e, rescale=False) == (base, None)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "tiny"}')
    with pytest.raises(ValueError, match="bad.json: not a latency profile"):
        load_profile(str(bad), e)
    e.kv.clear_prefix_cache()
