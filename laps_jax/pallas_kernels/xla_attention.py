"""Blocked paged attention in plain jnp/XLA: the default path on CPU.

The g query heads that share a kv head are flattened with the tokens into rows
([B, kv_heads, tokens*g, head_dim]), so every score and value product is one plain batched
matmul over (sequence, kv head) — 30-40% faster on the CPU than contracting a separate group
axis. Queries are split into blocks (a sequential `lax.map`); each query block walks the KV pages
in blocks with an online softmax inside a while loop whose trip count stops at the causal limit
of that block, so an executable costs what the actual context costs (not the page table's
capacity), long prefills skip the upper triangle, and score tiles stay cache-sized.
Layout: see reference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def paged_attention_xla(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                        scale: float, block_tokens: int = 256, q_block: int = 256):
    B, T, nq, hd = q.shape
    ps, kvh = k_cache.shape[2], k_cache.shape[3]
    g = nq // kvh
    bp = max(1, block_tokens // ps)  # pages per KV block
    kb = bp * ps
    pad = (-page_table.shape[1]) % bp
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    kv_lens = cached_lens + q_lens
    rows = (q.astype(jnp.float32) * scale).reshape(B, T, kvh, g, hd)
    rows = rows.transpose(0, 2, 1, 3, 4).reshape(B, kvh, T * g, hd)
    qb = min(q_block, T)
    if T % qb:
        qb = T  # bucket sizes are powers of two; anything else runs as one block
    R = qb * g

    def one_q_block(j):
        qj = jax.lax.dynamic_slice_in_dim(rows, j * R, R, axis=2)
        q_pos = cached_lens[:, None] + j * qb + jnp.arange(R)[None, :] // g  # [B, R]
        # keys this block can see: up to its last valid query's position
        last = cached_lens + jnp.clip(q_lens, 0, j * qb + qb)
        n_blocks = (jnp.max(jnp.minimum(last, kv_lens)) + kb - 1) // kb

        def body(i, carry):
            m, l, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(page_table, i * bp, bp, axis=1)
            k = k_cache[layer, pages].reshape(B, kb, kvh, hd).transpose(0, 2, 1, 3)
            v = v_cache[layer, pages].reshape(B, kb, kvh, hd).transpose(0, 2, 1, 3)
            k_pos = i * kb + jnp.arange(kb)
            in_seq = k_pos[None, :] < kv_lens[:, None]  # slots past kv_len hold garbage
            v = jnp.where(in_seq[:, None, :, None], v.astype(jnp.float32), 0.0)
            mask = ((k_pos[None, None, :] <= q_pos[:, :, None]) & in_seq[:, None, :])[:, None]
            s = jnp.where(mask, jnp.einsum("bkrd,bksd->bkrs", qj, k.astype(jnp.float32)),
                          NEG_INF)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])  # masked entries underflow to 0 once m is finite
            alpha = jnp.exp(m - m_new)
            return (m_new, l * alpha + p.sum(-1),
                    acc * alpha[..., None] + jnp.einsum("bkrs,bksd->bkrd", p, v))

        init = (jnp.full((B, kvh, R), NEG_INF, jnp.float32), jnp.zeros((B, kvh, R), jnp.float32),
                jnp.zeros((B, kvh, R, hd), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
        return acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, kvh, R, hd]

    out = jax.lax.map(one_q_block, jnp.arange(T // qb))  # [n_q_blocks, B, kvh, R, hd]
    out = out.reshape(T // qb, B, kvh, qb, g, hd).transpose(1, 0, 3, 2, 4, 5)
    return out.reshape(B, T, nq, hd).astype(q.dtype)
