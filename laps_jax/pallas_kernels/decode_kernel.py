"""Paged decode attention: one new token per sequence over its pages, GQA, split-K.

Decode reads the whole KV history to produce one row per head, so it is bandwidth-bound and the
only parallelism is (sequence, kv head). With a small batch that leaves most SMs idle, so the KV
range is cut into `num_splits` parts (flash-decoding): grid (b, kv head h, split s). Each program
keeps the g query heads of kv head h as the rows of one block (padded to a power of two, at
least 16 on GPU for tl.dot), walks its share of KV blocks with an online softmax in float32 and
writes unnormalised (acc, m, l); a small jnp combine merges the splits. Empty splits and q_len-0
slots write acc = 0, l = 0 and end as zeros. Layout and paging: see prefill_kernel.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from laps_jax.pallas_kernels.prefill_kernel import NEG_INF, dot_f32, gather_kv_block


def decode_kernel(q_lens_ref, cached_ref, pt_ref, layer_ref, q_ref, k_ref, v_ref,
                  acc_ref, m_ref, l_ref, *, block_k: int, num_splits: int, scale: float):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, hd = q_ref.shape
    kv_len = cached_ref[b] + q_lens_ref[b]
    kv_len = jnp.where(q_lens_ref[b] > 0, kv_len, 0)
    layer = layer_ref[0]
    n_blocks = pl.cdiv(kv_len, block_k)
    per_split = pl.cdiv(n_blocks, num_splits)
    lo = jnp.minimum(s * per_split, n_blocks)
    hi = jnp.minimum(lo + per_split, n_blocks)
    q = q_ref[...]

    def step(j, carry):
        m, l, acc = carry
        k, v = gather_kv_block(k_ref, v_ref, pt_ref, b, h, layer, j * block_k, block_k)
        valid = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0) < kv_len
        sc = jnp.where(valid[None, :], dot_f32(q, k, trans_b=True) * scale, NEG_INF)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # stale pages may hold anything
        m_new = jnp.maximum(m, sc.max(axis=1))
        p = jnp.where(valid[None, :], jnp.exp(sc - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v)
        return m_new, l * alpha + p.sum(axis=1), acc

    carry = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, hd), jnp.float32))
    m, l, acc = lax.fori_loop(lo, hi, step, carry)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def default_num_splits(batch: int, kv_heads: int, max_kv_blocks: int,
                       target_programs: int = 264) -> int:
    """Enough splits to give ~2 programs per SM of an H100/H200 (132 SMs), at most 16."""
    want = pl.cdiv(target_programs, max(1, batch * kv_heads))
    return int(max(1, min(16, want, max_kv_blocks)))


def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer,
                           q_lens: jax.Array, cached_lens: jax.Array, page_table: jax.Array,
                           scale: float, *, block_k: int = 64, num_splits: int | None = None,
                           interpret: bool = False, num_warps: int = 4,
                           num_stages: int = 2) -> jax.Array:
    """Attention of one new token per sequence, q [B,1,nq,hd] -> [B,1,nq,hd] in q.dtype."""
    B, T, nq, hd = q.shape
    if T != 1:
        raise ValueError(f"decode attention takes one token per sequence, got T={T}")
    kvh = k_cache.shape[3]
    g = nq // kvh
    rows = pl.next_power_of_2(g) if interpret else max(16, pl.next_power_of_2(g))
    max_kv_blocks = pl.cdiv(page_table.shape[1] * k_cache.shape[2], block_k)
    if num_splits is None:
        num_splits = default_num_splits(B, kvh, max_kv_blocks)
    qr = jnp.pad(q.reshape(B, kvh, g, hd), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    whole = pl.BlockSpec()
    q_spec = pl.BlockSpec((None, None, rows, hd), lambda b, h, s: (b, h, 0, 0))
    acc_spec = pl.BlockSpec((None, None, None, rows, hd), lambda b, h, s: (b, h, s, 0, 0))
    ml_spec = pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0))
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                         num_stages=num_stages)
    acc, m, l = pl.pallas_call(
        functools.partial(decode_kernel, block_k=block_k, num_splits=num_splits,
                          scale=float(scale)),
        grid=(B, kvh, num_splits),
        in_specs=[whole, whole, whole, whole, q_spec, whole, whole],
        out_specs=[acc_spec, ml_spec, ml_spec],
        out_shape=[jax.ShapeDtypeStruct((B, kvh, num_splits, rows, hd), jnp.float32),
                   jax.ShapeDtypeStruct((B, kvh, num_splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((B, kvh, num_splits, rows), jnp.float32)],
        interpret=interpret,
        compiler_params=params,
        name="laps_paged_decode",
    )(q_lens.astype(jnp.int32), cached_lens.astype(jnp.int32), page_table.astype(jnp.int32),
      layer_arr, qr, k_cache, v_cache)
    # Merge the splits: rescale each to the global max, then normalise once.
    m_all = m.max(axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    l_sum = (l * w).sum(axis=2)
    out = (acc * w[..., None]).sum(axis=2) / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]
    return out[:, :, :g].reshape(B, 1, nq, hd).astype(q.dtype)
