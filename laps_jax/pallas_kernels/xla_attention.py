"""Blocked paged attention in plain jnp/XLA: the default path on CPU.

The g query heads that share a kv head are flattened with the tokens into rows
([B, kv_heads, tokens*g, head_dim]), so every score and value product is one plain batched
matmul over (sequence, kv head) — 30-40% faster on the CPU than contracting a separate group
axis. Queries are split into blocks (a sequential `lax.map`); each query block walks the KV pages
in blocks with an online softmax inside a while loop whose trip count stops at the causal limit
of that block, so an executable costs what the actual context costs (not the page table's
capacity), long prefills skip the upper triangle, and score tiles stay cache-sized.

A batch of several sequences whose new tokens fit one query block (every decode step, and the
short pool's re-prefills over long histories) goes through `ragged_attention` instead: walking
every row to the batch's longest history made a 2,000-token conversation in a batch of
300-token ones cost 8 x 2,000 keys per step. There the work is split into (sequence, KV block)
items, only as many as the histories hold, processed B at a time, and each round's partial
softmax results are merged into their sequences' running ones (flash-decoding's split-K
combine, done as the items come).
Layout: see reference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30
Q_BLOCK = 256  # query rows per block of the blocked path; batches of shorter rows go ragged
KV_BLOCK = 256  # keys per block of both paths (`block_tokens`)


def _blocked_table(page_table, bp: int):
    pad = (-page_table.shape[1]) % bp
    return jnp.pad(page_table, ((0, 0), (0, pad))) if pad else page_table


def ragged_attention(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                     scale: float, block_tokens: int = KV_BLOCK):
    """All of q's rows as one query block; work proportional to the keys each sequence has."""
    B, T, nq, hd = q.shape
    ps, kvh = k_cache.shape[2], k_cache.shape[3]
    g = nq // kvh
    bp = max(1, block_tokens // ps)
    kb = bp * ps
    table = _blocked_table(page_table, bp)
    nb_max = table.shape[1] // bp
    table = table.reshape(B, nb_max, bp)
    kv_lens = jnp.where(q_lens > 0, cached_lens + q_lens, 0)  # a padded slot reads nothing
    blocks = (kv_lens + kb - 1) // kb                          # [B] items per sequence
    ends = jnp.cumsum(blocks)
    total = ends[-1]
    cap = B * nb_max                                           # items at most (a multiple of B)
    item = jnp.arange(cap)
    item_seq = jnp.sum(item[:, None] >= ends[None, :], axis=1)  # items are sorted by sequence
    item_seq = jnp.minimum(item_seq, B - 1)                    # items past the total: masked
    item_blk = item - (ends - blocks)[item_seq]
    R = T * g
    rows = (q.astype(jnp.float32) * scale).reshape(B, T, kvh, g, hd)
    rows = rows.transpose(0, 2, 1, 3, 4).reshape(B, kvh, R, hd)
    q_pos = cached_lens[:, None] + jnp.arange(R)[None, :] // g  # [B, R]

    def body(i, state):
        idx = i * B + jnp.arange(B)
        seq, blk, real = item_seq[idx], item_blk[idx], idx < total  # items past total: none
        pages = table[seq, blk]                                # [B items, bp]
        k = k_cache[layer, pages].reshape(B, kb, kvh, hd).transpose(0, 2, 1, 3)
        v = v_cache[layer, pages].reshape(B, kb, kvh, hd).transpose(0, 2, 1, 3)
        k_pos = blk[:, None] * kb + jnp.arange(kb)[None, :]
        live = (k_pos < kv_lens[seq][:, None]) & real[:, None]  # [items, kb]
        mask = (live[:, None, :] & (k_pos[:, None, :] <= q_pos[seq][:, :, None]))[:, None]
        s = jnp.einsum("ckrd,cksd->ckrs", rows[seq], k.astype(jnp.float32))
        s = jnp.where(mask, s, NEG_INF)
        m = s.max(-1)                                          # [items, kvh, R]
        p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
        v = jnp.where(live[:, None, :, None], v.astype(jnp.float32), 0.0)  # stale slots: any
        acc = jnp.einsum("ckrs,cksd->ckrd", p, v)
        # merge the items into their sequences' running softmax (one-hot over [items, seqs]:
        # a few KFLOP, cheaper on the CPU than segment scatters)
        m_s, l_s, acc_s = state
        mine = ((seq[:, None] == jnp.arange(B)[None, :]) & real[:, None])[..., None, None]
        m_new = jnp.maximum(m_s, jnp.where(mine, m[:, None], NEG_INF).max(0))
        w = jnp.where(mine, jnp.exp(m[:, None] - m_new[None]), 0.0)  # [items, seqs, kvh, R]
        alpha = jnp.exp(m_s - m_new)
        return (m_new, l_s * alpha + jnp.einsum("cbkr,ckr->bkr", w, p.sum(-1)),
                acc_s * alpha[..., None] + jnp.einsum("cbkr,ckrd->bkrd", w, acc))

    init = (jnp.full((B, kvh, R), NEG_INF, jnp.float32), jnp.zeros((B, kvh, R), jnp.float32),
            jnp.zeros((B, kvh, R, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, (total + B - 1) // B, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]                            # [B, kvh, R, hd]
    out = out.reshape(B, kvh, T, g, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, nq, hd).astype(q.dtype)


def paged_attention_xla(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                        scale: float, block_tokens: int = KV_BLOCK, q_block: int = Q_BLOCK):
    """Several sequences of at most one query block each ragged; the rest (one sequence:
    nothing to gain; long chunks: the causal skip of query blocks) blocked."""
    if q.shape[0] > 1 and q.shape[1] <= q_block:
        return ragged_attention(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                                scale, block_tokens)
    return blocked_attention(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table, scale,
                             block_tokens, q_block)


def blocked_attention(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                      scale: float, block_tokens: int = KV_BLOCK, q_block: int = Q_BLOCK):
    """Query blocks x KV blocks with an online softmax; every row walks to the batch's
    longest history."""
    B, T, nq, hd = q.shape
    ps, kvh = k_cache.shape[2], k_cache.shape[3]
    g = nq // kvh
    bp = max(1, block_tokens // ps)  # pages per KV block
    kb = bp * ps
    page_table = _blocked_table(page_table, bp)
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
        # leading KV blocks every row of every sequence sees whole (below the block's first
        # query and inside every history): they skip the masks (7-10% of the attention time)
        n_open = jnp.minimum(jnp.min(jnp.minimum(cached_lens + j * qb + 1, kv_lens)) // kb,
                             n_blocks)

        def body(masked: bool):
            def step(i, carry):
                m, l, acc = carry
                pages = jax.lax.dynamic_slice_in_dim(page_table, i * bp, bp, axis=1)
                k = k_cache[layer, pages].reshape(B, kb, kvh, hd).transpose(0, 2, 1, 3)
                v = v_cache[layer, pages].reshape(B, kb, kvh, hd).transpose(0, 2, 1, 3)
                v = v.astype(jnp.float32)
                s = jnp.einsum("bkrd,bksd->bkrs", qj, k.astype(jnp.float32))
                if masked:
                    k_pos = i * kb + jnp.arange(kb)
                    in_seq = k_pos[None, :] < kv_lens[:, None]  # past kv_len: garbage
                    v = jnp.where(in_seq[:, None, :, None], v, 0.0)
                    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & in_seq[:, None, :]
                    s = jnp.where(mask[:, None], s, NEG_INF)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])  # masked entries underflow to 0 (m finite)
                alpha = jnp.exp(m - m_new)
                return (m_new, l * alpha + p.sum(-1),
                        acc * alpha[..., None] + jnp.einsum("bkrs,bksd->bkrd", p, v))
            return step

        init = (jnp.full((B, kvh, R), NEG_INF, jnp.float32), jnp.zeros((B, kvh, R), jnp.float32),
                jnp.zeros((B, kvh, R, hd), jnp.float32))
        carry = jax.lax.fori_loop(0, n_open, body(False), init)
        _, l, acc = jax.lax.fori_loop(n_open, n_blocks, body(True), carry)
        return acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, kvh, R, hd]

    out = jax.lax.map(one_q_block, jnp.arange(T // qb))  # [n_q_blocks, B, kvh, R, hd]
    out = out.reshape(T // qb, B, kvh, qb, g, hd).transpose(1, 0, 3, 2, 4, 5)
    return out.reshape(B, T, nq, hd).astype(q.dtype)
