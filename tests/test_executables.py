"""Every shape is a precompiled bucket: no compile after warm-up, whatever lengths come in."""

from __future__ import annotations

import numpy as np

from laps_jax.config import PRESETS
from laps_jax.engine.engine import Engine
from laps_jax.engine.executables import BucketGrid, jax_compile_events
from laps_jax.engine.sequence import SamplingParams, Sequence
from laps_jax.models.qwen2 import init_params

from conftest import small_engine_config


def test_bucket_choice_is_minimal():
    g = BucketGrid.default(max_chunk=256, max_prefill_batch=8, max_decode_batch=16,
                           max_batch_tokens=512)
    b = g.fit_prefill(3, 20)
    assert (b.batch, b.tokens) == (4, 32)
    assert (g.fit_prefill(1, 256).batch, g.fit_prefill(1, 256).tokens) == (1, 256)
    assert g.fit_prefill(8, 256) is None  # over the token budget
    assert g.fit_decode(5).batch == 8 and g.fit_decode(17) is None
    for bucket in g.prefill_buckets():
        assert bucket.batch == 1 or bucket.batch * bucket.tokens <= 512


def test_no_compile_after_warmup_across_many_lengths():
    cfg = PRESETS["tiny"]
    eng = Engine(cfg, init_params(cfg), small_engine_config(max_decode_batch=8))
    eng.warmup()
    # warm-up also ran every executable once (XLA's first run is slow), on full rows whose
    # K/V went to the trash page 0 only: every real page is still untouched
    k = np.asarray(eng.runner.k_cache[0] if isinstance(eng.runner.k_cache, list)
                   else eng.runner.k_cache)
    pages = np.moveaxis(k, -4, 0).reshape(k.shape[-4], -1)  # [.., pages, ps, kvh, hd]
    assert np.abs(pages[0]).max() > 0 and not np.any(pages[1:])
    n_exec = len(eng.runner.executables)
    events = jax_compile_events()
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 40)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 6)),
                             temperature=float(rng.choice([0.0, 0.8])), seed=i)
              for i in range(len(prompts))]
    out = eng.generate(prompts, params)
    assert all(len(s.output) == s.params.max_tokens for s in out)
    assert eng.runner.executables.compiles_after_warmup == 0
    assert len(eng.runner.executables) == n_exec
    assert jax_compile_events() == events  # no XLA compile anywhere, not even a stray jnp op
    assert eng.kv.num_used == 0
    # prefill_prompts (what benchmarks set decode batches up with): whole prompts past the
    # 64-token chunk, in next_prefill's steps, ending where generate's prefill ends
    longer = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (150, 70, 20)]
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    want = eng.generate(longer, greedy)
    seqs = [Sequence(p, greedy) for p in longer]
    eng.prefill_prompts(seqs)
    assert all(s.remaining_prefill == 0 for s in seqs)
    assert [s.output[0] for s in seqs] == [w.output[0] for w in want]
    for s in seqs:
        eng.release(s)
    assert eng.kv.num_used == 0 and jax_compile_events() == events
