"""Sampling inside the executable: greedy, temperature, top-k, top-p, seeds, log-probs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laps_jax.engine.sampling import SamplingArrays, sample
from laps_jax.engine.sequence import SamplingParams

V = 50


@functools.lru_cache(maxsize=None)
def sampler():
    return jax.jit(lambda logits, s: sample(logits, s, 5))


def draw(logits, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """n independent draws from one logits row, batched as n rows."""
    u = np.random.default_rng(seed).random(n).astype(np.float32)
    s = SamplingArrays(np.full(n, temperature, np.float32), np.full(n, top_k, np.int32),
                       np.full(n, top_p, np.float32), u)
    out = sampler()(jnp.broadcast_to(logits, (n, V)), s)
    return np.asarray(out.token_ids), out


LOGITS = jnp.asarray(np.random.default_rng(0).standard_normal(V) * 2, jnp.float32)


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    ids, out = draw(LOGITS, 4, temperature=0.0)
    assert (ids == int(jnp.argmax(LOGITS))).all()
    ref = np.asarray(jax.nn.log_softmax(LOGITS))
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[ids], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[0], np.argsort(-ref)[:5])
    np.testing.assert_allclose(np.asarray(out.top_logprobs)[0], np.sort(ref)[::-1][:5], rtol=1e-6)


def test_temperature_sampling_follows_the_distribution():
    n = 4000
    ids, _ = draw(LOGITS, n, temperature=0.7)
    p = np.asarray(jax.nn.softmax(LOGITS / 0.7))
    freq = np.bincount(ids, minlength=V) / n
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / n) + 1e-3


def test_top_k_and_top_p_truncate():
    order = np.argsort(-np.asarray(LOGITS))
    ids, _ = draw(LOGITS, 500, temperature=1.5, top_k=3)
    assert set(ids.tolist()) <= set(order[:3].tolist()) and len(set(ids.tolist())) == 3
    p = np.asarray(jax.nn.softmax(LOGITS))[order]
    k = int(np.searchsorted(np.cumsum(p), 0.6) + 1)  # smallest set with mass >= 0.6
    ids, _ = draw(LOGITS, 500, temperature=1.0, top_p=0.6)
    assert set(ids.tolist()) == set(order[:k].tolist())
    ids, _ = draw(LOGITS, 50, temperature=1.0, top_k=1)
    assert (ids == order[0]).all()


def test_same_seed_same_tokens_through_the_engine(engine_for):
    engine, _ = engine_for("gqa2_untied")
    prompt = list(range(5, 25))
    sp = lambda seed: SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=seed,
                                     ignore_eos=True)
    a = engine.generate([prompt, prompt], [sp(1), sp(1)])
    b = engine.generate([prompt], [sp(1)])
    c = engine.generate([prompt], [sp(2)])
    assert a[0].output == a[1].output == b[0].output
    assert c[0].output != a[0].output


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
