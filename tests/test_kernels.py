"""Pallas prefill/decode kernels and the blocked XLA path against the pure-jnp reference.

CPU runs the kernels interpreted (outputs start as NaN there, so unwritten blocks show up);
scripts/device_check.py reruns this file natively on a GPU with LAPS_PALLAS_INTERPRET=0.
Shapes are small because interpret mode is slow; each case targets one layout hazard.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laps_jax.pallas_kernels import paged_attention
from laps_jax.pallas_kernels.decode_kernel import paged_decode_attention
from laps_jax.pallas_kernels.dispatch import use_interpret
from laps_jax.pallas_kernels.prefill_kernel import paged_prefill_attention
from laps_jax.pallas_kernels.reference import paged_attention_reference
from laps_jax.pallas_kernels.xla_attention import (blocked_attention, paged_attention_xla,
                                                   ragged_attention)

LAYERS, LAYER = 2, 1  # read layer 1 so a wrong layer offset shows


@pytest.fixture(autouse=True)
def exact_matmuls():
    """On GPU, XLA's default f32 matmul is TF32 (~1e-3 error): keep the reference exact."""
    with jax.default_matmul_precision("highest"):
        yield


@dataclass(frozen=True)
class Case:
    name: str
    nq: int
    kvh: int
    hd: int
    page_size: int
    block_k: int
    q_lens: tuple[int, ...]
    cached: tuple[int, ...]
    T: int = 0  # 0: max(q_lens); 1 for decode
    block_q: int = 32
    splits: int | None = None
    dtype: str = "float32"


PREFILL = [
    Case("single_g1", 2, 2, 64, 16, 32, (33,), (0,)),  # last key opens a new KV block
    Case("ragged_g5_pages_in_block", 10, 2, 64, 16, 64, (16, 7, 11), (0, 5, 45)),
    Case("page_bigger_than_block_g8", 8, 1, 128, 64, 32, (12, 9), (70, 3)),
    Case("padded_slots_g5_hd128", 5, 1, 128, 16, 32, (8, 0, 3, 0), (19, 0, 33, 7), T=10),
    Case("bf16_ragged_g5", 10, 2, 64, 16, 64, (16, 7, 11), (0, 5, 45), dtype="bfloat16"),
    Case("bf16_big_page_g8", 8, 1, 128, 64, 32, (12, 9), (70, 3), dtype="bfloat16"),
]
DECODE = [
    Case("decode_g1", 2, 2, 64, 16, 32, (1, 1, 1), (0, 17, 50), T=1, splits=1),
    Case("decode_g5_split_slots", 10, 2, 128, 16, 32, (1, 1, 0, 1), (40, 0, 95, 3), T=1,
         splits=3),
    Case("decode_g8_big_page_auto", 8, 1, 64, 64, 32, (1, 1), (100, 31), T=1),
    Case("decode_bf16_g5", 10, 2, 128, 16, 32, (1, 0, 1), (60, 9, 0), T=1, splits=2,
         dtype="bfloat16"),
]
# the XLA path's ragged attention: one long history among short ones, an empty slot, a 1-token one
RAGGED_DECODE = [
    Case("decode_ragged_one_long_g3", 6, 2, 64, 16, 32, (1, 1, 1, 0, 1, 1, 1, 1),
         (300, 5, 0, 70, 64, 31, 40, 2), T=1),
]
# long histories under several query blocks: the XLA blocked path's leading KV blocks that every
# row sees whole (no masks) meet the masked ones at different blocks per query block
OPEN_BLOCKS = [
    Case("open_blocks_one_seq_g3", 6, 2, 64, 16, 32, (40,), (100,)),
    Case("open_blocks_two_seqs_g3", 6, 2, 64, 16, 32, (24, 17), (70, 96)),
]


def make_inputs(c: Case, seed: int = 0, poison: bool = False):
    """Random q and cache (no zeros), shuffled pages per sequence, stale pages elsewhere.

    poison: every cache slot that holds no key of any sequence (spare pages, tails of last
    pages) is NaN, and unused table entries point at spare pages; the reference must then be
    computed on a clean copy (it multiplies masked values by zero).
    """
    rng = np.random.default_rng(seed)
    B = len(c.q_lens)
    T = c.T or max(c.q_lens)
    kv_max = max(q + k for q, k in zip(c.q_lens, c.cached))
    P = -(-kv_max // c.page_size) + 1  # one spare entry: unused entries hold any page
    num_pages = B * P + 3
    dt = jnp.dtype(c.dtype)
    q = jnp.asarray(rng.standard_normal((B, T, c.nq, c.hd)), dt)
    shape = (LAYERS, num_pages, c.page_size, c.kvh, c.hd)
    k = jnp.asarray(rng.standard_normal(shape), dt)
    v = jnp.asarray(rng.standard_normal(shape), dt)
    table = rng.permutation(num_pages)[:B * P].reshape(B, P)
    kv_lens = np.asarray(c.q_lens) + np.asarray(c.cached)
    used = -(-kv_lens // c.page_size)
    owned = np.concatenate([table[b, :used[b]] for b in range(B)])
    spare = np.setdiff1d(np.arange(num_pages), owned) if poison else np.arange(num_pages)
    live = np.zeros((num_pages, c.page_size), bool)
    for b in range(B):  # entries past the sequence point at other (stale or spare) pages
        table[b, used[b]:] = rng.choice(spare, P - used[b])
        pos = np.arange(used[b] * c.page_size).reshape(used[b], c.page_size)
        live[table[b, :used[b]]] = pos < kv_lens[b]
    if poison:
        dead = jnp.asarray(~live)[None, :, :, None, None]
        k, v = jnp.where(dead, jnp.nan, k).astype(dt), jnp.where(dead, jnp.nan, v).astype(dt)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return q, k, v, i32(c.q_lens), i32(c.cached), i32(table), 1.0 / np.sqrt(c.hd)


def check(c: Case, out: jax.Array, ref: jax.Array) -> None:
    """Relative error over valid rows; every row (padding, empty slots) must be finite."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all(), f"{c.name}: non-finite output (unwritten or NaN rows)"
    valid = np.arange(out.shape[1])[None, :] < np.asarray(c.q_lens)[:, None]
    err = np.linalg.norm(out32[valid] - ref32[valid]) / np.linalg.norm(ref32[valid])
    tol = 1e-5 if c.dtype == "float32" else 1e-2
    assert err < tol, f"{c.name}: relative error {err:.2e} >= {tol}"


def reference(c: Case, args):
    q, k, v, ql, cl, pt, scale = args
    return paged_attention_reference(q, k, v, jnp.int32(LAYER), ql, cl, pt, scale)


@pytest.mark.parametrize("c", PREFILL, ids=lambda c: c.name)
def test_prefill_kernel(c: Case):
    args = make_inputs(c)
    q, k, v, ql, cl, pt, scale = args
    fn = jax.jit(lambda q, k, v, layer, ql, cl, pt: paged_prefill_attention(
        q, k, v, layer, ql, cl, pt, scale, block_q=c.block_q, block_k=c.block_k,
        interpret=use_interpret()))
    check(c, fn(q, k, v, jnp.int32(LAYER), ql, cl, pt), reference(c, args))


@pytest.mark.parametrize("c", DECODE, ids=lambda c: c.name)
def test_decode_kernel(c: Case):
    args = make_inputs(c)
    q, k, v, ql, cl, pt, scale = args
    fn = jax.jit(lambda q, k, v, layer, ql, cl, pt: paged_decode_attention(
        q, k, v, layer, ql, cl, pt, scale, block_k=c.block_k, num_splits=c.splits,
        interpret=use_interpret()))
    check(c, fn(q, k, v, jnp.int32(LAYER), ql, cl, pt), reference(c, args))


XLA_PATHS = {"dispatch": paged_attention_xla, "blocked": blocked_attention,
             "ragged": ragged_attention}


@pytest.mark.parametrize("path", XLA_PATHS)
@pytest.mark.parametrize("c", PREFILL + DECODE + RAGGED_DECODE + OPEN_BLOCKS,
                         ids=lambda c: c.name)
def test_xla_path(c: Case, path: str):
    """Both XLA attention paths on every layout (the dispatch picks ragged for batches of
    short rows, blocked for one sequence or long chunks); the blocked path gets query blocks
    smaller than the rows, so it walks several."""
    args = make_inputs(c)
    q, k, v, ql, cl, pt, scale = args
    T = q.shape[1]
    qb = next((d for d in (8, 4, 2) if T % d == 0 and d < T), T)
    kw = {"q_block": qb} if path == "blocked" else {}
    fn = jax.jit(lambda *a: XLA_PATHS[path](*a, scale, block_tokens=c.block_k, **kw))
    check(c, fn(q, k, v, jnp.int32(LAYER), ql, cl, pt), reference(c, args))


@pytest.mark.parametrize("path", ["blocked", "ragged"])
@pytest.mark.parametrize("c", [PREFILL[1], RAGGED_DECODE[0]], ids=lambda c: c.name)
def test_xla_path_ignores_poisoned_slots(c: Case, path: str):
    """As the kernels: NaN in slots no sequence owns must not reach any output."""
    q, k, v, ql, cl, pt, scale = make_inputs(c, poison=True)
    fn = jax.jit(lambda *a: XLA_PATHS[path](*a, scale, block_tokens=c.block_k))
    out = fn(q, k, v, jnp.int32(LAYER), ql, cl, pt)
    clean = (q, jnp.nan_to_num(k), jnp.nan_to_num(v), ql, cl, pt, scale)
    check(c, out, reference(c, clean))


@pytest.mark.parametrize("c", [PREFILL[1], DECODE[1]], ids=lambda c: c.name)
def test_dispatch_in_layer_scan(c: Case):
    """backend="pallas" inside jit + lax.scan over layers, as the model calls it (traced layer)."""
    args = make_inputs(c)
    q, k, v, ql, cl, pt, scale = args

    @jax.jit
    def forward(q, k, v, ql, cl, pt):
        def body(carry, layer):
            o = paged_attention(q, k, v, layer, ql, cl, pt, scale=scale, backend="pallas")
            return carry, o
        return jax.lax.scan(body, 0, jnp.arange(LAYERS, dtype=jnp.int32))[1]

    outs = forward(q, k, v, ql, cl, pt)
    for layer in range(LAYERS):
        ref = paged_attention_reference(q, k, v, jnp.int32(layer), ql, cl, pt, scale)
        check(c, outs[layer], ref)


@pytest.mark.parametrize("c", [PREFILL[1], DECODE[1]], ids=lambda c: c.name)
def test_kernels_ignore_poisoned_slots(c: Case):
    """Slots beyond kv_len and pages the sequence does not own may hold NaN (stale memory)."""
    args = make_inputs(c, poison=True)
    q, k, v, ql, cl, pt, scale = args
    kernel = paged_decode_attention if c.T == 1 else paged_prefill_attention
    out = jax.jit(lambda *a: kernel(*a, scale, block_k=c.block_k, interpret=use_interpret()))(
        q, k, v, jnp.int32(LAYER), ql, cl, pt)
    assert bool(jnp.isnan(k).any()) and bool(jnp.isnan(v).any())
    clean = (q, jnp.nan_to_num(k), jnp.nan_to_num(v), ql, cl, pt, scale)
    check(c, out, reference(c, clean))
