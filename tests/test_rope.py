"""RoPE context extensions (linear, YaRN) against transformers' own frequency code, and the
config.json settings laps_jax refuses rather than computes differently."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from laps_jax.config import PRESETS, ConfigError, ModelConfig, RopeScaling
from laps_jax.models.rope import rope_frequencies

BASE = {**PRESETS["tiny"].to_hf_dict(), "head_dim": 64, "max_position_embeddings": 32768}

# rope_parameters beyond rope_theta, as a config.json can give them
CASES = {
    "yarn-qwen2.5-card": {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 8192},
    "yarn-betas-no-truncate": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                               "beta_slow": 2, "truncate": False,
                               "original_max_position_embeddings": 4096},
    "yarn-mscale": {"rope_type": "yarn", "factor": 2.0, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "original_max_position_embeddings": 2048},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 3.0, "attention_factor": 0.9,
                              "original_max_position_embeddings": 1000},
    "linear": {"rope_type": "linear", "factor": 2.5},
}


def hf_frequencies(rope_parameters: dict):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = Qwen2Config(**{**BASE, "rope_parameters": {"rope_theta": BASE["rope_theta"],
                                                   **rope_parameters}})
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](hf, "cpu")
    return inv_freq.numpy(), scale


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_match_transformers(case):
    params = CASES[case]
    cfg = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_theta": BASE["rope_theta"],
                                                                **params}})
    assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == params["rope_type"]
    ours, our_scale = rope_frequencies(cfg)
    ref, ref_scale = hf_frequencies(params)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-6)
    assert our_scale == pytest.approx(ref_scale, rel=1e-9)
    plain, _ = rope_frequencies(dataclasses.replace(cfg, rope_scaling=None))
    assert not np.allclose(np.asarray(ours), np.asarray(plain))  # the extension changed something


def test_model_card_rope_scaling_reads_like_rope_parameters():
    """Qwen2.5's model cards put YaRN under `rope_scaling` with `type` (transformers 4 style)."""
    card = ModelConfig.from_hf_dict({**BASE, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}})
    new = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": BASE["rope_theta"], "factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert card.rope_scaling == new.rope_scaling == RopeScaling("yarn", 4.0, 8192)
    # plain RoPE written either way has no scaling
    assert ModelConfig.from_hf_dict({**BASE, "rope_scaling": None}).rope_scaling is None
    assert ModelConfig.from_hf_dict({**BASE, "rope_parameters": {
        "rope_type": "default", "rope_theta": 5.0}}).rope_scaling is None
    # and the config round-trips through to_hf_dict
    assert ModelConfig.from_hf_dict(new.to_hf_dict()).rope_scaling == new.rope_scaling


@pytest.mark.parametrize("extra,match", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "RoPE type 'longrope'"),
    ({"rope_scaling": {"type": "linear"}}, "linear needs a positive 'factor', got null"),
    ({"rope_scaling": {"type": "yarn", "factor": "4"}}, "yarn needs a positive 'factor'"),
    ({"rope_scaling": {"type": "yarn", "factor": -1}}, "positive 'factor'"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be an object or null, got str"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}},
     "rope_scaling.original_max_position_embeddings must be positive"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 1},
     "sliding-window attention"),
])
def test_unsupported_settings_are_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict({**BASE, **extra})


def test_harmless_sliding_window_settings_are_accepted():
    """Qwen2.5 configs carry `sliding_window` with `use_sliding_window: false`; and a window no
    shorter than the context, or no layer past max_window_layers, changes nothing."""
    for extra in ({"use_sliding_window": False, "sliding_window": 128, "max_window_layers": 0},
                  {"use_sliding_window": True, "sliding_window": 32768, "max_window_layers": 0},
                  {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 2}):
        assert ModelConfig.from_hf_dict({**BASE, **extra}).num_layers == 2


def test_rope_extension_sets_the_context_served():
    """The Qwen2.5 cards keep max_position_embeddings 32768 beside YaRN x4 and state 131072
    tokens; linear scaling stretches the configured context itself."""
    card = {**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768}}
    assert ModelConfig.from_hf_dict(card).max_context == 131072
    linear = {**BASE, "max_position_embeddings": 4096,
              "rope_scaling": {"type": "linear", "factor": 2.5}}
    assert ModelConfig.from_hf_dict(linear).max_context == 10240
    assert ModelConfig.from_hf_dict(BASE).max_context == 32768


def test_engine_serves_the_extended_context_and_caps_past_it(caplog):
    from laps_jax.config import EngineConfig
    from laps_jax.engine.engine import Engine
    from laps_jax.models.qwen2 import init_params
    cfg = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=1024,
                              rope_scaling=RopeScaling("linear", 2.0))
    params = init_params(cfg)
    small = dict(kv_cache_tokens=2048, max_chunk=64, max_prefill_batch=1, max_decode_batch=1)
    assert Engine(cfg, params, EngineConfig(max_model_len=1500, **small)).ecfg.max_model_len == 1500
    with caplog.at_level("WARNING"):
        eng = Engine(cfg, params, EngineConfig(max_model_len=5000, **small))
    assert eng.ecfg.max_model_len == 2048 and "using 2048" in caplog.text
