"""Presets, config parsing and the memory plan (shapes only, nothing allocated)."""

from __future__ import annotations


import jax
import pytest

from laps_jax.config import PRESETS, ConfigError, ModelConfig, resolve_model
from laps_jax.models.plan import memory_plan
from laps_jax.models.qwen2 import abstract_state


def test_32b_preset_parameter_count_from_abstract_shapes():
    state = abstract_state(PRESETS["qwen2.5-32b"])
    leaves = jax.tree.leaves(state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    total = sum(x.size for x in leaves)
    assert round(total / 1e9, 2) == 32.76
    assert total == PRESETS["qwen2.5-32b"].num_params()


def test_32b_plan_on_h200():
    plan = memory_plan(PRESETS["qwen2.5-32b"], "bfloat16", 141.0)
    assert abs(plan.weight_bytes / 1e9 - 65.5) < 0.1
    assert plan.kv_bytes_per_token == 256 * 1024
    assert plan.kv_tokens == (plan.device_bytes - plan.reserved_bytes - plan.weight_bytes) // (256 * 1024)


def test_rope_theta_from_rope_parameters_and_top_level():
    base = PRESETS["tiny"].to_hf_dict()
    base.pop("rope_theta")
    assert ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_theta": 123.0}}).rope_theta == 123.0
    assert ModelConfig.from_hf_dict({**base, "rope_theta": 77.0}).rope_theta == 77.0


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        ModelConfig.from_hf_dict({**PRESETS["tiny"].to_hf_dict(), "model_type": "llama"})
    cfg = PRESETS["tiny"].to_hf_dict()
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf_dict(cfg)
    with pytest.raises(ConfigError, match="config.json: missing file"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve_model(str(tmp_path))
    with pytest.raises(ConfigError, match="neither a model directory, 'builtin' nor a preset"):
        resolve_model("no-such-model")


def test_cpu_layer_loop_unrolls_small_models_only():
    """Unrolling on the CPU holds a second copy of the weights while it unstacks them, so a model
    over a quarter of the machine's memory keeps the stacked scan (checked on abstract shapes)."""
    import jax.numpy as jnp
    from flax import nnx

    from laps_jax.models.qwen2 import default_layer_loop
    if jax.default_backend() != "cpu":
        pytest.skip("CPU default")
    shapes = lambda name: nnx.to_pure_dict(abstract_state(PRESETS[name], jnp.bfloat16))
    assert default_layer_loop(shapes("tiny")) == "unroll"
    assert default_layer_loop(shapes("qwen2.5-32b")) == "scan"  # 65.5 GB of bf16 weights
