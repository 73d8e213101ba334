"""Blocked paged attention in plain jnp/XLA: the default path on CPU.

It walks the KV pages in blocks with an online softmax inside a while loop whose trip count is
the longest kv length in the batch, so one compiled executable costs what the actual context
costs, not the page table's capacity. Layout: see reference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def paged_attention_xla(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                        scale: float, block_tokens: int = 256):
    B, T, nq, hd = q.shape
    _, _, ps, kvh, _ = k_cache.shape
    g = nq // kvh
    bp = max(1, block_tokens // ps)  # pages per block
    P = page_table.shape[1]
    pad = (-P) % bp
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    kv_lens = cached_lens + q_lens
    n_blocks = (jnp.max(kv_lens) + bp * ps - 1) // (bp * ps)
    qf = (q.astype(jnp.float32) * scale).reshape(B, T, kvh, g, hd)
    q_pos = cached_lens[:, None] + jnp.arange(T)[None, :]

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, i * bp, bp, axis=1)
        k = k_cache[layer, pages].reshape(B, bp * ps, kvh, hd).astype(jnp.float32)
        v = v_cache[layer, pages].reshape(B, bp * ps, kvh, hd).astype(jnp.float32)
        k_pos = i * bp * ps + jnp.arange(bp * ps)
        in_seq = k_pos[None, :] < kv_lens[:, None]  # [B, S]: slots past kv_len hold garbage
        v = jnp.where(in_seq[:, :, None, None], v, 0.0)
        mask = ((k_pos[None, None, :] <= q_pos[:, :, None]) & in_seq[:, None, :])[:, None, None]
        s = jnp.einsum("btkgd,bskd->bkgts", qf, k)
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p, v)
        return m_new, l, acc

    init = (jnp.full((B, kvh, g, T), NEG_INF, jnp.float32),
            jnp.zeros((B, kvh, g, T), jnp.float32),
            jnp.zeros((B, kvh, g, T, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, nq, hd).astype(q.dtype)
