"""One decision per step: the bucket a plan names is the bucket the step runs in; the layers
below check that it holds the rows and never choose again."""

from __future__ import annotations

import pytest

from laps_jax.engine.buckets import Bucket, BucketGrid
from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler.clock import SimClock, run_simulated
from laps_jax.sim.instance import build_dispatcher

from sim_fixtures import CFG, MODEL, spec

GRID = BucketGrid.default(max_chunk=256, max_prefill_batch=8, max_decode_batch=16,
                          max_batch_tokens=512)


def test_check_holds_refuses_what_the_bucket_cannot_hold():
    GRID.check_holds(Bucket(4, 32), [20, 32, 1])  # fits: no error
    GRID.check_holds(Bucket(8, 1), [1] * 5)
    with pytest.raises(ValueError, match="4x32 does not hold 5 rows"):
        GRID.check_holds(Bucket(4, 32), [1] * 5)
    with pytest.raises(ValueError, match="4x32 does not hold 2 rows of at most 33"):
        GRID.check_holds(Bucket(4, 32), [33, 2])
    with pytest.raises(ValueError, match="not in the grid"):
        GRID.check_holds(Bucket(3, 32), [10])  # no 3-row bucket is ever compiled
    with pytest.raises(ValueError, match="not in the grid"):
        GRID.check_holds(Bucket(8, 256), [10])  # over the batch-token budget
    with pytest.raises(ValueError, match="not in the grid"):
        GRID.check_holds(Bucket(4, 32), [10], prompt_logprobs=True)


@pytest.mark.parametrize("mode", ["mixed", "laps"])
def test_every_step_runs_in_its_planned_bucket(mode):
    """Prompts of 1 token included: a step of 1-token rows runs the decode bucket its plan
    names as it is dispatched; nothing below the lane chooses again."""
    planned, ran = [], []

    async def main():
        clock = SimClock()
        d = build_dispatcher(spec(mode), CFG, MODEL, clock)
        lane = d.lanes[0]
        dispatched, prefill = lane.planner.dispatched, lane.executor.prefill

        def record_plan(plan, now):
            planned.append(plan.bucket)
            return dispatched(plan, now)

        async def record_step(work, bucket):
            ran.append((bucket, [n for _, n in work]))
            return await prefill(work, bucket)

        lane.planner.dispatched, lane.executor.prefill = record_plan, record_step
        await d.start()
        handles = []
        for i, n in enumerate([1, 300, 5, 1, 40, 17, 1, 120, 2, 700, 1, 9]):
            await clock.sleep(0.003 * (i % 3))
            handles.append(d.submit([11 + (i * 37 + j) % 300 for j in range(n)],
                                    SamplingParams(max_tokens=3), request_id=f"r{i}"))
        stats = [await h.result() for h in handles]
        await d.stop()
        return stats

    stats = run_simulated(main())
    assert all(s.finish_reason == "length" for s in stats)
    assert [b for b, _ in ran] == planned and len(planned) >= 6
    assert any(max(rows) == 1 for _, rows in ran)  # a step of 1-token rows happened
    for bucket, rows in ran:
        assert bucket.is_decode == (max(rows) == 1)
        assert len(rows) <= bucket.batch and max(rows) <= bucket.tokens


@pytest.mark.parametrize("chunk,batch,budget", [(2048, 8, None), (512, 16, 1024), (64, 8, 64)])
def test_the_simulator_builds_the_engines_grid(chunk, batch, budget):
    """One grid code: a simulated instance compiles (prices) the buckets a real engine with the
    same settings compiles, the batch sizes that fit no bucket under the budget dropped alike."""
    from laps_jax.config import EngineConfig
    from laps_jax.sim.instance import GridSpec
    ecfg = EngineConfig(max_chunk=chunk, max_prefill_batch=batch, max_decode_batch=32,
                        min_chunk=16, max_batch_tokens=budget)
    engine_grid = BucketGrid.of_settings(ecfg)
    sim_grid = GridSpec(chunk, 16, batch, 32, budget).build()
    assert sim_grid.prefill_buckets() == engine_grid.prefill_buckets()
    assert sim_grid.decode_buckets() == engine_grid.decode_buckets()
    assert all(b.batch * 16 <= (budget or chunk) for b in engine_grid.prefill_buckets())
    gpu = GridSpec(2048, 16, 8, 64, None, (16, 256, 384, 2048)).build()
    assert gpu.prefill_tokens == [16, 256, 384, 2048] and gpu.max_batch_tokens == 2048
