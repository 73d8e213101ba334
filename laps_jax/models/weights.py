"""Hugging Face Qwen2 tensors -> the stacked parameter dict of `models.qwen2`.

HF stores Linear weights as [out, in]; laps_jax keeps [in, out] so activations multiply on the
left, and stacks every layer's tensor along a leading [num_layers] axis for `lax.scan`.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from laps_jax.config import ModelConfig


class WeightError(ValueError):
    """A checkpoint tensor that is missing or has the wrong shape; names the tensor."""


# (our path, HF name pattern, transpose, expected HF shape as a function of the config)
_LAYER_TENSORS: list[tuple[tuple[str, ...], str, bool, Callable[[ModelConfig], tuple]]] = [
    (("attn", "q_w"), "self_attn.q_proj.weight", True, lambda c: (c.q_size, c.hidden_size)),
    (("attn", "q_b"), "self_attn.q_proj.bias", False, lambda c: (c.q_size,)),
    (("attn", "k_w"), "self_attn.k_proj.weight", True, lambda c: (c.kv_size, c.hidden_size)),
    (("attn", "k_b"), "self_attn.k_proj.bias", False, lambda c: (c.kv_size,)),
    (("attn", "v_w"), "self_attn.v_proj.weight", True, lambda c: (c.kv_size, c.hidden_size)),
    (("attn", "v_b"), "self_attn.v_proj.bias", False, lambda c: (c.kv_size,)),
    (("attn", "o_w"), "self_attn.o_proj.weight", True, lambda c: (c.hidden_size, c.q_size)),
    (("mlp", "gate_w"), "mlp.gate_proj.weight", True,
     lambda c: (c.intermediate_size, c.hidden_size)),
    (("mlp", "up_w"), "mlp.up_proj.weight", True, lambda c: (c.intermediate_size, c.hidden_size)),
    (("mlp", "down_w"), "mlp.down_proj.weight", True,
     lambda c: (c.hidden_size, c.intermediate_size)),
    (("input_norm",), "input_layernorm.weight", False, lambda c: (c.hidden_size,)),
    (("post_attn_norm",), "post_attention_layernorm.weight", False, lambda c: (c.hidden_size,)),
]


def params_from_hf(get: Callable[[str], np.ndarray], has: Callable[[str], bool],
                   cfg: ModelConfig, dtype=jnp.float32, progress=None) -> dict:
    """Builds the parameter dict from a tensor getter; `progress(i, n)` after each layer."""
    np_dtype = np.dtype(dtype)

    def fetch(name: str, shape: tuple, transpose: bool) -> np.ndarray:
        if not has(name):
            raise WeightError(f"missing tensor {name!r} in the checkpoint")
        arr = get(name)
        if tuple(arr.shape) != tuple(shape):
            raise WeightError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected "
                              f"{tuple(shape)} from config.json")
        arr = arr.astype(np_dtype)
        return arr.T if transpose else arr

    layers: dict = {"attn": {}, "mlp": {}}
    for path, hf_name, transpose, shape_fn in _LAYER_TENSORS:
        hf_shape = shape_fn(cfg)
        shape = hf_shape[::-1] if transpose else hf_shape
        stacked = np.empty((cfg.num_layers, *shape), np_dtype)
        for i in range(cfg.num_layers):
            stacked[i] = fetch(f"model.layers.{i}.{hf_name}", hf_shape, transpose)
        node = layers
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = jnp.asarray(stacked)
        if progress:
            progress()
    params = {
        "embed": jnp.asarray(fetch("model.embed_tokens.weight",
                                   (cfg.vocab_size, cfg.hidden_size), False)),
        "layers": layers,
        "final_norm": jnp.asarray(fetch("model.norm.weight", (cfg.hidden_size,), False)),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(fetch("lm_head.weight",
                                              (cfg.vocab_size, cfg.hidden_size), True))
    return params


def params_to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of `params_from_hf` (used to ship a checkpoint in Hugging Face format)."""
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]),
           "model.norm.weight": np.asarray(params["final_norm"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    for path, hf_name, transpose, _ in _LAYER_TENSORS:
        node = params["layers"]
        for key in path:
            node = node[key]
        stacked = np.asarray(node)
        for i in range(cfg.num_layers):
            t = stacked[i].T if transpose else stacked[i]
            out[f"model.layers.{i}.{hf_name}"] = np.ascontiguousarray(t)
    return out
