"""KV hand-off between engines (laps-spatial): a sequence prefilled in one engine decodes in
another exactly as it would have where it was prefilled, for both layer loops."""

from __future__ import annotations

import numpy as np
import pytest

from laps_jax.config import PRESETS, EngineConfig
from laps_jax.engine.engine import Engine
from laps_jax.engine.kv_transfer import export_sequence, import_sequence
from laps_jax.engine.sequence import SamplingParams, Sequence
from laps_jax.models.qwen2 import init_params

CFG = PRESETS["tiny"]


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_decode_after_handoff_equals_decode_in_place(layer_loop):
    params = init_params(CFG, seed=5)
    params["lm_head"] = params["lm_head"] * 40.0  # clear argmax margins
    ecfg = dict(page_size=8, kv_cache_tokens=1024, max_model_len=256, max_chunk=64,
                max_prefill_batch=1, max_decode_batch=1, layer_loop=layer_loop)
    src, dst = (Engine(CFG, params, EngineConfig(**ecfg)) for _ in range(2))
    for e in (src, dst):
        e.executables.warm_copies()
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, CFG.vocab_size, 45).tolist()
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = src.generate([prompt], sp)[0].output
    src.kv.clear_prefix_cache()

    # dst already holds the first two blocks of this prompt: they are reused, not overwritten
    dst.generate([prompt[:16] + [3]], SamplingParams(max_tokens=1, ignore_eos=True))
    seq = Sequence(prompt, sp)
    src.admit(seq)
    while seq.remaining_prefill:
        src.prefill([(seq, min(seq.remaining_prefill, 64))])
    data = export_sequence(src, seq)
    new = import_sequence(dst, seq, data)
    assert new.cached_len == 16
    src.kv.release(seq.pages)
    seq.pages = new
    while not seq.is_finished:
        dst.decode([seq])
    assert seq.output == expected
    assert src.kv.num_used == 0 and dst.kv.num_used == 0
    # the copies compiled at warm-up, with the same counter as the step buckets
    assert len(src.transfer.executables) == 2 * len(src.transfer.sizes)
    assert src.transfer.executables.compiles_after_warmup == 0
    assert dst.transfer.executables.compiles_after_warmup == 0


def test_import_without_room_changes_nothing():
    params = init_params(CFG, seed=6)
    big = Engine(CFG, params, EngineConfig(page_size=8, kv_cache_tokens=1024, max_model_len=256,
                                           max_chunk=64, max_prefill_batch=1, max_decode_batch=1))
    small = Engine(CFG, params, EngineConfig(page_size=8, kv_cache_tokens=256, max_model_len=256,
                                             max_chunk=64, max_prefill_batch=1,
                                             max_decode_batch=1))
    for e in (big, small):
        e.executables.warm_copies()
    small.kv.allocate(list(range(1000, 1224)))  # 28 of its 32 pages held: no room for 8
    seq = Sequence(list(range(10, 70)), SamplingParams(max_tokens=4))
    big.admit(seq)
    big.prefill([(seq, 60)])
    data = export_sequence(big, seq)
    free = small.kv.num_free
    from laps_jax.engine.kv_cache import OutOfPages
    with pytest.raises(OutOfPages):
        import_sequence(small, seq, data)
    assert small.kv.num_free == free and len(seq.pages.pages) == big.kv.pages_for(60)
