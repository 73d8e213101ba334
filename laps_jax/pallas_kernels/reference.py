"""Pure-jnp reference attention over a paged KV cache (gathers every page; for tests).

Layout shared by every attention path in laps_jax:
  q:          [B, T, num_heads, head_dim]  new-token queries, right-padded to T
  k_cache:    [L, num_pages, page_size, num_kv_heads, head_dim] (v_cache the same)
  layer:      int32 scalar, which layer of the cache to read
  q_lens:     [B] int32 valid new tokens of each sequence (0 = padded slot in a bucket)
  cached_lens:[B] int32 tokens already in the cache before the new ones
  page_table: [B, P] int32 pages of each sequence, in order (unused entries may hold any page)
Query t of sequence b sits at position cached_lens[b] + t and attends causally to keys
0..cached_lens[b] + t, all of which (the new ones included) are already in the pages.
Rows t >= q_lens[b] are padding: their output is unspecified but finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_attention_reference(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                              scale: float):
    B, T, nq, hd = q.shape
    _, _, ps, kvh, _ = k_cache.shape
    P = page_table.shape[1]
    g = nq // kvh
    k = k_cache[layer][page_table].reshape(B, P * ps, kvh, hd).astype(jnp.float32)
    v = v_cache[layer][page_table].reshape(B, P * ps, kvh, hd).astype(jnp.float32)
    qf = q.astype(jnp.float32).reshape(B, T, kvh, g, hd)
    s = jnp.einsum("btkgd,bskd->bkgts", qf, k) * scale
    q_pos = cached_lens[:, None] + jnp.arange(T)[None, :]
    k_pos = jnp.arange(P * ps)
    kv_lens = cached_lens + q_lens
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_lens[:, None, None])
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v)
    return o.reshape(B, T, nq, hd).astype(q.dtype)
