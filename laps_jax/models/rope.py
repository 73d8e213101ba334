"""Rotary position embeddings as Hugging Face transformers computes them for Qwen2.

Besides the plain frequencies (theta ** (-2i / d)), a config.json may ask for a context
extension: `"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings":
32768}` is how the Qwen2.5 model cards enable 128K contexts (transformers 5 writes the same
under `rope_parameters` with `rope_type`). Both change the frequencies of every position, so a
model that ignored them would give different logits from the first token on. Supported:
`linear` (frequencies / factor) and `yarn` (frequencies blended between the original and the
interpolated ones by a ramp over the dimensions, cos/sin scaled by an attention factor); any
other kind is refused when the config is read (config.RopeScaling).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from laps_jax.config import ModelConfig, RopeScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(sc: RopeScaling, dim: int, base: float):
    attention = sc.attention_factor
    if attention is None:
        attention = (_yarn_mscale(sc.factor, sc.mscale) / _yarn_mscale(sc.factor, sc.mscale_all_dim)
                     if sc.mscale and sc.mscale_all_dim else _yarn_mscale(sc.factor))

    def correction_dim(rotations: float) -> float:  # the dimension that turns this many times
        return (dim * math.log(sc.original_max_positions / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    keep = 1 - ramp  # share of the original (extrapolated) frequency, high-frequency dims
    inv_freq = 1.0 / (sc.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, attention


def rope_frequencies(cfg: ModelConfig):
    """(inverse frequencies [head_dim / 2] float32, factor that scales cos and sin)."""
    d, base, sc = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    if sc is not None and sc.kind == "yarn":
        return _yarn(sc, d, base)
    inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if sc is not None:  # linear: positions divided by the factor, i.e. the frequencies
        inv_freq = inv_freq / sc.factor
    return inv_freq, 1.0


def rope(x, positions, cfg: ModelConfig):
    """Rotary embedding, rotate-half layout (as Hugging Face Qwen2). x: [B, T, H, D]."""
    inv_freq, scale = rope_frequencies(cfg)
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], -1)
    return (x.astype(jnp.float32) * cos + rot * sin).astype(x.dtype)
