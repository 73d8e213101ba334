"""The CPU matmul-library choice (engine/dot_tuning.py): a oneDNN build computes what transformers
computes, warm-up keeps whichever build ran faster, and a build that cannot compile leaves the
default in place."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hf_fixtures import load_hf_model
from laps_jax.config import PRESETS
from laps_jax.engine.dot_tuning import DotChoice, choose_dots, compile_onednn, tunable
from laps_jax.engine.engine import Engine
from laps_jax.engine.executables import Bucket
from laps_jax.models.qwen2 import init_params
from test_model_vs_hf import TOL, hf_logprobs, run_prompt_logprobs

from conftest import small_engine_config


def onednn_build(cache, bucket):
    exe = compile_onednn(cache, bucket)
    if exe is None:
        pytest.skip("this jaxlib sends no dot to oneDNN (not an x86 build?)")
    return exe


@pytest.fixture(scope="module")
def tiny_engine():
    cfg = PRESETS["tiny"]
    return Engine(cfg, init_params(cfg), small_engine_config(dot_tuning_tokens=0))


def test_onednn_build_matches_transformers(engine_for):
    engine, path = engine_for("gqa4_hd32")
    cache = engine.runner.executables
    buckets = [Bucket(1, t, True) for t in engine.grid.prefill_tokens]
    rng = np.random.default_rng(11)
    ids = rng.integers(0, engine.cfg.vocab_size, 150).tolist()  # chunks of 64, 64 and 22
    default, _ = run_prompt_logprobs(engine, ids)
    kept = {b: cache.get(b) for b in buckets}
    try:
        for b in buckets:
            cache.replace(b, onednn_build(cache, b))
        ours, last = run_prompt_logprobs(engine, ids)
    finally:  # the engine is shared by the session
        for b, exe in kept.items():
            cache.replace(b, exe)
    ref = hf_logprobs(load_hf_model(path), ids)
    np.testing.assert_allclose(ours, ref[np.arange(len(ids) - 1), ids[1:]], atol=TOL)
    np.testing.assert_allclose(ours, default, atol=1e-4)
    order = np.argsort(-ref[-1])[:5]
    assert last.top_ids[:5].tolist() == order.tolist()


@pytest.mark.parametrize("faster", ["onednn", "xla"])
def test_the_faster_build_is_kept(tiny_engine, faster):
    cache, bucket = tiny_engine.runner.executables, Bucket(1, 64)
    base = cache.get(bucket)
    onednn_build(cache, bucket)  # skips where there is no oneDNN
    slow, fast = 0.03, 0.005

    def call(exe):  # stands in for a step: the library named `faster` takes less time
        time.sleep(fast if (exe is not base) == (faster == "onednn") else slow)

    try:
        choice = choose_dots(cache, bucket, call, turns=2)
        assert choice.library == faster
        assert choice.ratio == pytest.approx(fast / slow if faster == "onednn" else slow / fast,
                                             rel=0.5)
        kept = cache.get(bucket)
        assert (kept is base) == (faster == "xla")
        assert ("__onednn_fusion" in kept.as_text()) == (faster == "onednn")
    finally:
        cache.replace(bucket, base)


def test_a_build_that_fails_keeps_the_default(tiny_engine):
    cache, bucket = tiny_engine.runner.executables, Bucket(1, 32)
    base = cache.get(bucket)
    calls = []
    bad = {"xla_cpu_use_onednn": True,
           "xla_cpu_experimental_onednn_fusion_type": "NOT_A_FUSION_TYPE"}
    assert choose_dots(cache, bucket, calls.append, options=bad) is None
    assert cache.get(bucket) is base and calls == []


def test_which_buckets_are_tuned():
    assert tunable(Bucket(1, 2048), 1024, "cpu") and tunable(Bucket(2, 1024), 1024, "cpu")
    assert not tunable(Bucket(4, 512), 1024, "cpu")      # short rows: oneDNN's overhead loses
    assert not tunable(Bucket(32, 1), 1, "cpu")          # decode steps never
    assert not tunable(Bucket(1, 2048), 1024, "gpu")     # no oneDNN there
    assert not tunable(Bucket(1, 2048), 0, "cpu")        # off


def test_onednn_is_kept_only_when_ratio_and_times_agree():
    b = Bucket(1, 2048)
    assert DotChoice(b, 0.150, 0.120, 0.80).library == "onednn"
    assert DotChoice(b, 0.150, 0.148, 0.99).library == "xla"   # within the margin
    # three noisy turns: the median ratio says faster, the median times say slower
    assert DotChoice(b, 0.144, 0.146, 0.95).library == "xla"


def test_warmup_times_the_long_buckets_and_keeps_its_choice():
    cfg = PRESETS["tiny"]
    eng = Engine(cfg, init_params(cfg), small_engine_config(max_decode_batch=8,
                                                            dot_tuning_tokens=64))
    eng.warmup()
    runner = eng.runner
    if not runner.dot_choices:
        onednn_build(runner.executables, Bucket(1, 64))  # skips where there is no oneDNN
    long = sorted(b for b in runner.grid.prefill_buckets() if b.tokens >= 64)
    assert [c.bucket for c in runner.dot_choices] == long
    for c in runner.dot_choices:
        assert c.xla_seconds > 0 and c.onednn_seconds > 0
        text = runner.executables.get(c.bucket).as_text()
        assert ("__onednn_fusion" in text) == (c.library == "onednn")
    short = runner.executables.get(Bucket(1, 32)).as_text()
    assert "__onednn_fusion" not in short
    assert runner.executables.compiles_after_warmup == 0


def test_timing_budget_stops_new_turns():
    from laps_jax.timing import paired_times
    calls = []
    paired_times(lambda: calls.append("a"), lambda: calls.append("b"), 7, budget_s=0.0)
    assert calls == ["a", "b", "a", "b"]  # the untimed first calls, then one turn only
    calls.clear()
    paired_times(lambda: calls.append("a"), lambda: calls.append("b"), 3, budget_s=60.0)
    assert len(calls) == 2 + 2 * 3
