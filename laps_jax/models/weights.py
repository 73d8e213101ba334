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


# Each dimension of an HF tensor, named after the config.json field(s) that set it, so a shape
# mismatch can say which field disagrees with the checkpoint.
DIMS: dict[str, Callable[[ModelConfig], int]] = {
    "vocab_size": lambda c: c.vocab_size,
    "hidden_size": lambda c: c.hidden_size,
    "intermediate_size": lambda c: c.intermediate_size,
    "num_attention_heads*head_dim": lambda c: c.q_size,
    "num_key_value_heads*head_dim": lambda c: c.kv_size,
}
_Q, _KV, _H, _I = ("num_attention_heads*head_dim", "num_key_value_heads*head_dim",
                   "hidden_size", "intermediate_size")

# (our path, HF name pattern, transpose, the HF shape's dimensions as DIMS keys)
_LAYER_TENSORS: list[tuple[tuple[str, ...], str, bool, tuple[str, ...]]] = [
    (("attn", "q_w"), "self_attn.q_proj.weight", True, (_Q, _H)),
    (("attn", "q_b"), "self_attn.q_proj.bias", False, (_Q,)),
    (("attn", "k_w"), "self_attn.k_proj.weight", True, (_KV, _H)),
    (("attn", "k_b"), "self_attn.k_proj.bias", False, (_KV,)),
    (("attn", "v_w"), "self_attn.v_proj.weight", True, (_KV, _H)),
    (("attn", "v_b"), "self_attn.v_proj.bias", False, (_KV,)),
    (("attn", "o_w"), "self_attn.o_proj.weight", True, (_H, _Q)),
    (("mlp", "gate_w"), "mlp.gate_proj.weight", True, (_I, _H)),
    (("mlp", "up_w"), "mlp.up_proj.weight", True, (_I, _H)),
    (("mlp", "down_w"), "mlp.down_proj.weight", True, (_H, _I)),
    (("input_norm",), "input_layernorm.weight", False, (_H,)),
    (("post_attn_norm",), "post_attention_layernorm.weight", False, (_H,)),
]
_VOCAB = ("vocab_size", "hidden_size")  # embed_tokens and lm_head


def shape_of(cfg: ModelConfig, dims: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(DIMS[d](cfg) for d in dims)


def expected_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(HF name, dimensions as DIMS keys) of every tensor the config asks for, non-layer
    tensors first (their shapes name vocab_size and hidden_size alone)."""
    out = [("model.embed_tokens.weight", _VOCAB), ("model.norm.weight", (_H,))]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", _VOCAB))
    out += [(f"model.layers.{i}.{hf_name}", dims) for i in range(cfg.num_layers)
            for _, hf_name, _, dims in _LAYER_TENSORS]
    return out


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
    for path, hf_name, transpose, dims in _LAYER_TENSORS:
        hf_shape = shape_of(cfg, dims)
        first = fetch(f"model.layers.0.{hf_name}", hf_shape, transpose)  # before allocating
        stacked = np.empty((cfg.num_layers, *first.shape), np_dtype)
        stacked[0] = first
        for i in range(1, cfg.num_layers):
            stacked[i] = fetch(f"model.layers.{i}.{hf_name}", hf_shape, transpose)
        node = layers
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = jnp.asarray(stacked)
        if progress:
            progress()
    params = {
        "embed": jnp.asarray(fetch("model.embed_tokens.weight", shape_of(cfg, _VOCAB), False)),
        "layers": layers,
        "final_norm": jnp.asarray(fetch("model.norm.weight", (cfg.hidden_size,), False)),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(fetch("lm_head.weight", shape_of(cfg, _VOCAB), True))
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
