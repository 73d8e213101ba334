"""Ragged prefill flash attention over a paged KV cache, one pallas_call for the whole batch.

Layout: see reference.py. Grid (sequence b, kv head h, query block i). The g = nq/kvh query heads
that share kv head h are flattened with the new tokens into rows (row r = token r // g, head
r % g), so one block holds every head of a group and K/V are read once per group; blocks stay a
power of two (Triton needs that) even when g = 5 (Qwen2.5-32B). Inside, a loop walks the KV
blocks of the sequence's pages with an online softmax in float32:

- keys are gathered token by token through the page table (page = pos // page_size), so KV
  blocks need not align with pages: a block may span several small pages or part of a big one;
- the loop stops at the causal limit of the block's last token (and kv_len): fully masked KV
  blocks are never read; blocks wholly below the diagonal run without a mask;
- query blocks past q_len run zero iterations and write zeros (finite), as do q_len-0 slots.

page_table, lengths and the layer are plain whole-array inputs read as scalars in the kernel
(Triton has no scalar-prefetch grid spec); the KV cache is a whole-array ref indexed with
gathers, which Triton lowers to pointer arithmetic and interpret mode to jnp indexing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG_INF = -1e30


def dot_f32(a: jax.Array, b: jax.Array, trans_b: bool = False) -> jax.Array:
    """f32-accumulating dot; exact f32 (no TF32) when the inputs are f32."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_b=trans_b, precision=precision)


def gather_kv_block(k_ref, v_ref, pt_ref, b, h, layer, start, block_k: int):
    """K and V rows [block_k, hd] for positions start..start+block_k-1 of sequence b."""
    num_pages, page_size = k_ref.shape[1], k_ref.shape[2]
    pos = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    pidx = jnp.minimum(lax.div(pos, page_size), pt_ref.shape[1] - 1)  # tail block may overrun
    pages = jnp.clip(pt_ref[b, pidx], 0, num_pages - 1)
    offs = lax.rem(pos, page_size)
    return k_ref[layer, pages, offs, h, :], v_ref[layer, pages, offs, h, :]


def prefill_kernel(q_lens_ref, cached_ref, pt_ref, layer_ref, q_ref, k_ref, v_ref, o_ref, *,
                   group: int, block_k: int, scale: float):
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_m = q_ref.shape[0]
    q_len, cached, layer = q_lens_ref[b], cached_ref[b], layer_ref[0]
    kv_len = cached + q_len
    row0 = i * block_m
    t_first = lax.div(row0, group)
    t_last = jnp.minimum(lax.div(row0 + block_m - 1, group), q_len - 1)
    live = row0 < q_len * group
    # KV blocks this query block needs, and the prefix of them visible to every row.
    n_blocks = jnp.where(live, pl.cdiv(jnp.minimum(kv_len, cached + t_last + 1), block_k), 0)
    n_full = jnp.where(live, jnp.minimum(cached + t_first + 1, kv_len) // block_k, 0)
    q_pos = cached + lax.div(row0 + lax.broadcasted_iota(jnp.int32, (block_m,), 0), group)
    q = q_ref[...]

    def step(j, carry, masked: bool):
        m, l, acc = carry
        k, v = gather_kv_block(k_ref, v_ref, pt_ref, b, h, layer, j * block_k, block_k)
        s = dot_f32(q, k, trans_b=True) * scale
        if masked:
            k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len)
            s = jnp.where(mask, s, NEG_INF)
            v = jnp.where((k_pos < kv_len)[:, None], v, jnp.zeros_like(v))  # stale pages
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v)
        return m_new, l, acc

    hd = q_ref.shape[1]
    carry = (jnp.full((block_m,), NEG_INF, jnp.float32), jnp.zeros((block_m,), jnp.float32),
             jnp.zeros((block_m, hd), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    _, l, acc = lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def paged_prefill_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer,
                            q_lens: jax.Array, cached_lens: jax.Array, page_table: jax.Array,
                            scale: float, *, block_q: int = 64, block_k: int = 64,
                            interpret: bool = False, num_warps: int = 4,
                            num_stages: int = 2) -> jax.Array:
    """Causal attention of right-padded new tokens q [B,T,nq,hd] over paged K/V; [B,T,nq,hd].

    block_q counts rows (tokens x grouped heads); both blocks must be powers of two on GPU.
    """
    B, T, nq, hd = q.shape
    kvh = k_cache.shape[3]
    g = nq // kvh
    rows = T * g
    block_m = max(16, min(block_q, pl.next_power_of_2(rows)))
    n_q_blocks = pl.cdiv(rows, block_m)
    qr = q.reshape(B, T, kvh, g, hd).transpose(0, 2, 1, 3, 4).reshape(B, kvh, rows, hd)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, n_q_blocks * block_m - rows), (0, 0)))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(prefill_kernel, group=g, block_k=block_k, scale=float(scale))
    whole = pl.BlockSpec()  # the whole array, read by index inside the kernel
    qo_spec = pl.BlockSpec((None, None, block_m, hd), lambda b, h, i: (b, h, i, 0))
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                         num_stages=num_stages)
    out = pl.pallas_call(
        kernel,
        grid=(B, kvh, n_q_blocks),
        in_specs=[whole, whole, whole, whole, qo_spec, whole, whole],
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        interpret=interpret,
        compiler_params=params,
        name="laps_paged_prefill",
    )(q_lens.astype(jnp.int32), cached_lens.astype(jnp.int32), page_table.astype(jnp.int32),
      layer_arr, qr, k_cache, v_cache)
    out = out[:, :, :rows].reshape(B, kvh, T, g, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, nq, hd)
