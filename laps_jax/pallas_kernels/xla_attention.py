"""Blocked paged attention in plain jnp/XLA: the default path on CPU.

Queries are split into blocks (a sequential `lax.map`), and each query block walks the KV
pages in blocks with an online softmax inside a while loop whose trip count stops at the
causal limit of that query block. So one compiled executable costs what the actual context
costs (not the page table's capacity), long prefills skip the upper triangle, and the score
tiles stay small enough to live in cache. Layout: see reference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def _attend_block(qf, q_pos, k_cache, v_cache, layer, page_table, kv_lens, n_blocks, bp):
    """Online softmax of one query block [B, Tq, kvh, g, hd] over the first n_blocks KV blocks."""
    B, Tq, kvh, g, hd = qf.shape
    ps = k_cache.shape[2]

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, i * bp, bp, axis=1)
        k = k_cache[layer, pages].reshape(B, bp * ps, kvh, hd).astype(jnp.float32)
        v = v_cache[layer, pages].reshape(B, bp * ps, kvh, hd).astype(jnp.float32)
        k_pos = i * bp * ps + jnp.arange(bp * ps)
        in_seq = k_pos[None, :] < kv_lens[:, None]  # [B, S]: slots past kv_len hold garbage
        v = jnp.where(in_seq[:, :, None, None], v, 0.0)
        mask = ((k_pos[None, None, :] <= q_pos[:, :, None]) & in_seq[:, None, :])[:, None, None]
        s = jnp.where(mask, jnp.einsum("btkgd,bskd->bkgts", qf, k), NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])  # masked entries underflow to 0 once m is finite
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p, v)
        return m_new, l, acc

    init = (jnp.full((B, kvh, g, Tq), NEG_INF, jnp.float32),
            jnp.zeros((B, kvh, g, Tq), jnp.float32),
            jnp.zeros((B, kvh, g, Tq, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4))  # [B, Tq, kvh, g, hd]


def paged_attention_xla(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                        scale: float, block_tokens: int = 256, q_block: int = 256):
    B, T, nq, hd = q.shape
    ps, kvh = k_cache.shape[2], k_cache.shape[3]
    g = nq // kvh
    bp = max(1, block_tokens // ps)  # pages per KV block
    kv_block = bp * ps
    pad = (-page_table.shape[1]) % bp
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    kv_lens = cached_lens + q_lens
    qf = (q.astype(jnp.float32) * scale).reshape(B, T, kvh, g, hd)
    q_pos = cached_lens[:, None] + jnp.arange(T)[None, :]
    qb = min(q_block, T)
    if T % qb:
        qb = T  # bucket sizes are powers of two; anything else runs as one block

    def one_q_block(j):
        start = j * qb
        qj = jax.lax.dynamic_slice_in_dim(qf, start, qb, axis=1)
        pj = jax.lax.dynamic_slice_in_dim(q_pos, start, qb, axis=1)
        # keys this block can see: up to its last (valid) query's position
        last = cached_lens + jnp.clip(q_lens, 0, start + qb)
        n_blocks = (jnp.max(jnp.minimum(last, kv_lens)) + kv_block - 1) // kv_block
        return _attend_block(qj, pj, k_cache, v_cache, layer, page_table, kv_lens, n_blocks, bp)

    if qb == T:
        out = one_q_block(0)
    else:
        blocks = jax.lax.map(one_q_block, jnp.arange(T // qb))  # [nb, B, qb, kvh, g, hd]
        out = jnp.moveaxis(blocks, 0, 1).reshape(B, T, kvh, g, hd)
    return out.reshape(B, T, nq, hd).astype(q.dtype)
