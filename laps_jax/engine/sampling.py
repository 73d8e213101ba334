"""Sampling inside the compiled step, so the host only ever waits for token ids.

Every row carries its own temperature, top-k, top-p and one uniform number made on the host
from the request's seed and the position of the token it samples (`position_uniform`); the
token is picked by inverse CDF over the sorted, truncated distribution. (Drawing on the host
keeps the PRNG out of the executables: threefry alone doubled their compile time on CPU.) A row
with temperature 0 is greedy (argmax).

Keyed by position, not drawn in turn from a generator: the k-th token's draw does not depend on
how the sequence got there, so a stream resumed elsewhere from its prompt plus its first k
tokens (the router's failover), a prefill/decode hand-off, or a retried step samples what the
uninterrupted request would have.
Log-probs are of the model's own distribution (before temperature), as the OpenAI API reports.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that samples the token at `position` of a sequence under `seed`:
    output `position` of SplitMix64 seeded with `seed` (a generator that passes BigCrush),
    computed directly; 24 bits, so float32 holds it exactly and never rounds it up to 1."""
    z = (seed + _GOLDEN * (position + 1)) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return ((z ^ (z >> 31)) >> 40) / float(1 << 24)


@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array        # [B] i32, <= 0 = no limit
    top_p: jax.Array        # [B] f32 in (0, 1]
    uniform: jax.Array      # [B] f32 in [0, 1): position_uniform(seed, position)


jax.tree_util.register_dataclass(
    SamplingArrays, data_fields=["temperature", "top_k", "top_p", "uniform"],
    meta_fields=[])


@dataclasses.dataclass(frozen=True)
class SampleOut:
    token_ids: jax.Array    # [B] i32
    logprobs: jax.Array     # [B] f32 log-prob of the chosen token
    top_ids: jax.Array      # [B, K] i32, best first
    top_logprobs: jax.Array  # [B, K] f32


jax.tree_util.register_dataclass(
    SampleOut, data_fields=["token_ids", "logprobs", "top_ids", "top_logprobs"], meta_fields=[])


def _stochastic(logits, s: SamplingArrays):
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)
    keep = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep &= before < s.top_p[:, None]
    kept = jnp.where(keep, probs, 0.0)
    cdf = jnp.cumsum(kept, axis=-1)
    target = s.uniform[:, None] * cdf[:, -1:]
    choice = jnp.minimum(jnp.sum(cdf <= target, axis=-1), jnp.sum(keep, axis=-1) - 1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample(logits, s: SamplingArrays, num_top: int) -> SampleOut:
    """logits: [B, V] float32."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.any(s.temperature > 0), lambda: _stochastic(logits, s),
                         lambda: greedy)
    ids = jnp.where(s.temperature > 0, drawn, greedy)
    chosen = jnp.take_along_axis(logp, ids[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, num_top)
    return SampleOut(ids, chosen, top_ids.astype(jnp.int32), top_lp)
