"""The roofline latency model: costs, fitting, thresholds (pure numpy, no engine)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from laps_jax.config import PRESETS
from laps_jax.engine.buckets import BucketGrid
from laps_jax.scheduler.latency_model import (H200, H200_MEASURED, DeviceSpec, LatencyModel,
                                              StepShape, fit_roofline, relative_errors,
                                              step_cost)

Q32 = PRESETS["qwen2.5-32b"]
BENCH = PRESETS["bench-cpu"]


def test_h200_threshold_for_qwen32b_lands_in_200_300():
    assert 200 <= LatencyModel(Q32, 2, H200).threshold(0) <= 300
    # measured ceilings (788 TFLOP/s, 4.3 TB/s) put it just under 200
    assert 180 <= LatencyModel(Q32, 2, H200_MEASURED).threshold(0) <= 230


def test_threshold_is_the_crossover():
    m = LatencyModel(Q32, 2, H200)
    th = m.threshold(0)
    comp, mem = m.terms(StepShape.exact((th,)))
    assert comp >= mem
    comp, mem = m.terms(StepShape.exact((th - 1,)))
    assert comp < mem
    # below the threshold extra tokens are nearly free, above they cost their FLOPs
    assert m.predict(StepShape.exact((th // 4,))) == pytest.approx(
        m.predict(StepShape.exact((th // 2,))), rel=0.03)
    assert m.predict(StepShape.exact((4 * th,))) > 3 * m.predict(StepShape.exact((th,)))


def test_cpu_like_device_threshold_is_far_lower():
    cpu = DeviceSpec("cpu", 80e9, 10e9, 2e-3)
    assert LatencyModel(BENCH, 4, cpu).threshold(0) < 64 < LatencyModel(Q32, 2, H200).threshold(0)


def test_cached_context_changes_the_threshold():
    m = LatencyModel(Q32, 2, H200)
    # GQA attention over the cache adds ~5 FLOP per cached byte per new token: the threshold
    # falls slowly with the cached length under this roofline
    assert m.threshold(32768) < m.threshold(0)
    # without attention FLOPs (memory-only view of the cache) the crossover moves up instead
    mem_only = LatencyModel(Q32, 2, DeviceSpec("x", H200.peak_flops, H200.mem_bandwidth,
                                               H200.step_overhead_s, attn_flops=1e30))
    assert mem_only.threshold(32768) > mem_only.threshold(0)


def test_padding_and_blocked_attention_cost_more():
    exact = step_cost(BENCH, 4, StepShape.exact((10, 20), (0, 300)))
    padded = step_cost(BENCH, 4, StepShape.bucketed((10, 20), (0, 300), 4, 32))
    assert padded.gemm_flops > exact.gemm_flops
    blocked = step_cost(BENCH, 4, StepShape.bucketed((10, 20), (0, 300), 4, 32), kv_block=256)
    assert blocked.attn_flops > padded.attn_flops


def test_cpu_batched_short_rows_cost_total_history_not_longest():
    """The CPU path for batches of short rows is ragged: one 2,000-token history among seven of
    300 costs the blocks present (8 + 7 x 2 = 22 items, 3 rounds of 8), not 8 x 2,000."""
    ctx = (1999,) + (299,) * 7
    ragged = step_cost(BENCH, 4, StepShape.bucketed((1,) * 8, ctx, 8, 1), kv_block=256)
    uniform = step_cost(BENCH, 4, StepShape.bucketed((1,) * 8, (1999,) * 8, 8, 1), kv_block=256)
    per_key = 4.0 * BENCH.num_layers * BENCH.num_heads * BENCH.head_dim
    assert ragged.attn_flops == per_key * 8 * 3 * 256
    assert uniform.attn_flops == per_key * 8 * 8 * 256
    one = step_cost(BENCH, 4, StepShape.bucketed((1,), (1999,), 1, 1), kv_block=256)
    assert one.attn_flops == per_key * 8 * 256  # batch 1 runs the blocked path
    # short re-prefills batch the same way: 16 new tokens per row over those histories
    reprefill = step_cost(BENCH, 4, StepShape.bucketed((16,) * 8, ctx, 8, 16), kv_block=256)
    assert reprefill.attn_flops == per_key * 8 * 16 * 3 * 256


def _synthetic(dev: DeviceSpec, n: int, seed: int):
    rng = random.Random(seed)
    m = LatencyModel(BENCH, 4, dev, kv_block=256)
    shapes, secs = [], []
    for _ in range(n):
        rows = rng.choice([1, 2, 4, 8])
        t = rng.choice([1, 16, 32, 64, 128, 256])
        c = rng.choice([0, 256, 1024])
        shapes.append(StepShape.bucketed([t] * rows, [c] * rows, rows, t))
        secs.append(m.predict(shapes[-1]) * rng.uniform(0.97, 1.03))
    return shapes, secs


def test_fit_recovers_a_known_device():
    dev = DeviceSpec("truth", 60e9, 8e9, 3e-3, attn_flops=15e9)
    shapes, secs = _synthetic(dev, 60, 0)
    fitted = LatencyModel.fit(BENCH, 4, shapes[:45], secs[:45], (256, 256))
    errs = relative_errors(fitted, shapes[45:], secs[45:])
    assert statistics.median(errs) < 0.05
    assert fitted.device.peak_flops == pytest.approx(60e9, rel=0.15)
    assert fitted.device.mem_bandwidth == pytest.approx(8e9, rel=0.15)
    assert abs(fitted.threshold(0) - LatencyModel(BENCH, 4, dev, 256).threshold(0)) <= 3


def test_cpu_form_attention_adds_and_ragged_has_its_own_rate():
    """attn_overlap=False: attention compute and K/V traffic add; the ragged path (several short
    rows) runs at its own rate, the blocked path (one sequence, long chunks) at attn_flops."""
    dev = DeviceSpec("cpu", 200e9, 1e30, 5e-3, attn_flops=100e9, kv_bandwidth=6e9,
                     ragged_attn_flops=60e9, attn_overlap=False)
    m = LatencyModel(BENCH, 4, dev, kv_block=256)
    ragged = StepShape.bucketed((16,) * 4, (1000,) * 4, 4, 16)
    blocked = StepShape.bucketed((512,), (1000,), 1, 512)
    for shape, rate in ((ragged, 60e9), (blocked, 100e9)):
        c = step_cost(BENCH, 4, shape, 256)
        assert c.ragged == (shape is ragged)
        assert m.predict(shape) == pytest.approx(
            5e-3 + c.gemm_flops / 200e9 + c.attn_flops / rate + c.kv_bytes / 6e9)
    # the GPU form (default) keeps the max, and one attention rate
    gpu = LatencyModel(BENCH, 4, DeviceSpec("g", 200e9, 1e30, 5e-3, 100e9, 6e9), 256)
    c = step_cost(BENCH, 4, ragged, 256)
    assert gpu.predict(ragged) == pytest.approx(
        5e-3 + c.gemm_flops / 200e9 + max(c.attn_flops / 100e9, c.kv_bytes / 6e9))


def test_fit_finds_the_attention_form_and_the_ragged_rate():
    """Timings made by a CPU-form device (added attention terms, a slower ragged path) are
    fitted back: the form, the two attention rates, and held-out predictions."""
    dev = DeviceSpec("truth", 200e9, 1e30, 5e-3, attn_flops=100e9, kv_bandwidth=6e9,
                     ragged_attn_flops=50e9, attn_overlap=False)
    shapes, secs = _synthetic(dev, 64, 2)
    fitted = LatencyModel.fit(BENCH, 4, shapes[:48], secs[:48], (256, 256))
    assert statistics.median(relative_errors(fitted, shapes[48:], secs[48:])) < 0.03
    assert fitted.device.attn_overlap is False
    assert fitted.device.ragged_rate == pytest.approx(50e9, rel=0.2)
    assert fitted.device.attn_rate == pytest.approx(100e9, rel=0.2)
    # the first form (one attention rate) could not tell the two paths apart: a worse fit
    one_rate = LatencyModel(BENCH, 4, DeviceSpec("x", 200e9, 1e30, 5e-3, 75e9, 6e9), 256)
    assert (statistics.median(relative_errors(one_rate, shapes, secs))
            > 3 * statistics.median(relative_errors(fitted, shapes, secs)))


def test_fit_is_non_negative():
    shapes, secs = _synthetic(DeviceSpec("t", 50e9, 1e12, 1e-3), 20, 1)
    from laps_jax.scheduler.latency_model import step_cost as sc
    coef = fit_roofline([sc(BENCH, 4, s, 256) for s in shapes], secs)
    assert all(c >= 0 for c in coef)


def test_isolated_prefill_is_chunked_into_buckets():
    m = LatencyModel(BENCH, 4, DeviceSpec("cpu", 80e9, 10e9, 2e-3), kv_block=256)
    grid = BucketGrid.default(max_chunk=128, min_tokens=16)
    one = m.predict_prefill(100, 0, grid)
    assert one == pytest.approx(m.predict(StepShape.bucketed((100,), (0,), 1, 128)))
    three = m.predict_prefill(300, 0, grid)  # 128 + 128 + 44 (bucket 64)
    assert three > 2 * one


def test_model_round_trips_through_json():
    for dev in (H200, DeviceSpec("cpu", 2e11, 1e30, 5e-3, 1e11, 6e9, 6e10, False)):
        m = LatencyModel(BENCH, 4, dev, 256)
        again = LatencyModel.from_dict(m.to_dict(), BENCH)
        assert again == m


def test_blocks_come_from_the_engine_and_travel_with_the_model():
    """The latency model prices the attention blocks it was fitted with (it imports no kernel):
    the XLA backend's, saved and loaded with the model; the ragged cut moves with q_block."""
    from laps_jax.pallas_kernels import attention_blocks
    from laps_jax.pallas_kernels.xla_attention import KV_BLOCK, Q_BLOCK
    assert attention_blocks("xla") == (KV_BLOCK, Q_BLOCK) and attention_blocks("pallas")[0] == 1
    dev = DeviceSpec("d", 60e9, 8e9, 3e-3)
    shapes, secs = _synthetic(dev, 30, 0)
    fitted = LatencyModel.fit(BENCH, 4, shapes, secs, (256, 128))
    again = LatencyModel.from_dict(json.loads(json.dumps(fitted.to_dict())), BENCH)
    assert (again.kv_block, again.q_block) == (256, 128)
    rows = StepShape.bucketed((200,) * 4, (1000, 0, 0, 0), 4, 256)
    assert step_cost(BENCH, 4, rows, 256, 256).ragged  # rows of 256 go ragged at q_block 256
    assert not step_cost(BENCH, 4, rows, 256, 128).ragged  # ...not at 128
