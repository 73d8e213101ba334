"""The model against Hugging Face transformers on CPU (float32), on random tiny checkpoints.

Tolerance: log-probs within 1e-3. Both sides compute in float32 but in different orders
(fused XLA matmuls, blocked online softmax vs. eager torch), so differences of ~1e-5 in the
logits are expected; 1e-3 leaves room while still catching any real mistake (a wrong rope
layout or a missing bias moves log-probs by more than 0.1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_fixtures import load_hf_model
from laps_jax.engine.sequence import SamplingParams, Sequence

TOL = 1e-3


def hf_logprobs(model, ids) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def run_prompt_logprobs(engine, ids, split: int | None = None):
    """Prefills `ids` (optionally as prefix then suffix over cached pages) with prompt log-probs;
    returns (log p(ids[t] | <t) for t >= 1, top log-probs of the next token)."""
    seq = Sequence(list(ids), SamplingParams(max_tokens=1))
    engine.admit(seq)
    assert seq.num_computed == 0
    lps = []
    try:
        cut = split or len(ids)
        for lo, hi in ((0, cut), (cut, len(ids))):
            while seq.num_computed < hi:
                n = min(hi - seq.num_computed, engine.grid.max_chunk)
                out = engine.prefill([(seq, n)], prompt_logprobs=True, sample=False)[0]
                lps.extend(out.target_logprobs.tolist())
        return np.array(lps[:-1]), out
    finally:
        engine.release(seq)
        engine.kv.clear_prefix_cache()


@pytest.mark.parametrize("name", ["gqa2_untied", "mha_tied", "gqa4_hd32", "sharded_bf16",
                                  "gqa7_one_kv", "yarn_gqa2"])
def test_prompt_logprobs_match_transformers(engine_for, name):
    engine, path = engine_for(name)
    model = load_hf_model(path)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, engine.cfg.vocab_size, 150).tolist()  # > max_chunk: chunked prefill
    ref = hf_logprobs(model, ids)
    ours, last = run_prompt_logprobs(engine, ids)
    np.testing.assert_allclose(ours, ref[np.arange(len(ids) - 1), ids[1:]], atol=TOL)
    order = np.argsort(-ref[-1])[:5]
    assert last.top_ids[:5].tolist() == order.tolist()
    np.testing.assert_allclose(last.top_logprobs[:5], ref[-1][order], atol=TOL)


@pytest.mark.parametrize("split", [8, 13, 40])  # page-aligned, mid-page, several pages
def test_reprefill_over_cached_pages_equals_full_prefill(engine_for, split):
    engine, path = engine_for("gqa2_untied")
    ids = np.random.default_rng(split).integers(0, engine.cfg.vocab_size, 70).tolist()
    full, full_last = run_prompt_logprobs(engine, ids)
    part, part_last = run_prompt_logprobs(engine, ids, split=split)
    np.testing.assert_allclose(part, full, atol=1e-5)
    np.testing.assert_allclose(part_last.top_logprobs, full_last.top_logprobs, atol=1e-5)


def test_prefix_cache_reprefill_computes_only_new_tokens(engine_for):
    """A follow-up turn finds its history in the prefix cache and gives the cold-run tokens."""
    engine, path = engine_for("gqa2_untied")
    rng = np.random.default_rng(3)
    history = rng.integers(0, engine.cfg.vocab_size, 45).tolist()
    follow = history + rng.integers(0, engine.cfg.vocab_size, 6).tolist()
    engine.kv.clear_prefix_cache()
    cold = engine.generate([follow], SamplingParams(max_tokens=8))[0].output
    engine.kv.clear_prefix_cache()
    engine.generate([history], SamplingParams(max_tokens=1))
    warm = engine.generate([follow], SamplingParams(max_tokens=8))[0]
    page = engine.ecfg.page_size
    assert warm.cached_tokens == (len(history) // page) * page
    assert warm.output == cold
    engine.kv.clear_prefix_cache()


@pytest.mark.parametrize("name", ["gqa2_untied", "mha_tied", "gqa7_one_kv"])
def test_greedy_decode_matches_generate(engine_for, name):
    engine, path = engine_for(name)
    model = load_hf_model(path)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, engine.cfg.vocab_size, n).tolist() for n in (3, 17, 40, 90)]
    batch = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for p, seq in zip(prompts, batch):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert seq.output == ref
    # each prompt alone gives what it gives in the batch
    for p, seq in zip(prompts[:2], batch):
        alone = engine.generate([p], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        assert alone.output == seq.output
    assert engine.kv.num_used == 0
    engine.kv.clear_prefix_cache()


def test_scan_layer_loop_matches_transformers(engine_for):
    """The stacked lax.scan layer loop (the GPU default; the CPU default unrolls) against
    transformers: chunked prompt log-probs and greedy decode of a batch."""
    engine, path = engine_for("gqa4_hd32", "scan")
    assert engine.runner.layer_loop == "scan" and engine_for("gqa4_hd32")[0].runner.layer_loop == "unroll"
    model = load_hf_model(path)
    rng = np.random.default_rng(13)
    ids = rng.integers(0, engine.cfg.vocab_size, 100).tolist()
    ours, _ = run_prompt_logprobs(engine, ids, split=37)
    ref = hf_logprobs(model, ids)
    np.testing.assert_allclose(ours, ref[np.arange(len(ids) - 1), ids[1:]], atol=TOL)
    prompts = [rng.integers(0, engine.cfg.vocab_size, n).tolist() for n in (5, 29)]
    for p, seq in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=12,
                                                                       ignore_eos=True))):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert seq.output == ref
    assert engine.kv.num_used == 0
    engine.kv.clear_prefix_cache()
