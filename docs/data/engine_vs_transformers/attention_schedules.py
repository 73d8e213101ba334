# Experiment of 2026-12-01 (not part of laps_jax): the blocked XLA attention against its query
# blocks and KV blocks unrolled in Python (no while loop), one layer of bench-cpu shapes.
# Run from the repository root: python docs/data/engine_vs_transformers/attention_schedules.py
import functools, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "scripts")
from bench_attention import paged_inputs
from laps_jax.pallas_kernels.xla_attention import blocked_attention
from laps_jax.timing import paired_times

def self_causal(q, k, v, q_lens, scale, qb=256, kb=256):
    """q [B,T,nq,hd], k/v [B,T,kvh,hd]: causal attention among the new tokens, unrolled."""
    B, T, nq, hd = q.shape; kvh = k.shape[2]; g = nq // kvh
    rows = (q.astype(jnp.float32) * scale).reshape(B, T, kvh, g, hd).transpose(0, 2, 1, 3, 4).reshape(B, kvh, T * g, hd)
    kt = k.astype(jnp.float32).transpose(0, 2, 1, 3); vt = v.astype(jnp.float32).transpose(0, 2, 1, 3)
    qb = min(qb, T); kb = min(kb, qb); R = qb * g
    outs = []
    for j in range(T // qb):
        qj = rows[:, :, j * R:(j + 1) * R]
        q_pos = j * qb + jnp.arange(R) // g
        m = jnp.full((B, kvh, R), -1e30); l = jnp.zeros((B, kvh, R)); acc = jnp.zeros((B, kvh, R, hd))
        for i in range(((j + 1) * qb) // kb):
            kk = kt[:, :, i * kb:(i + 1) * kb]; vv = vt[:, :, i * kb:(i + 1) * kb]
            s = jnp.einsum("bkrd,bksd->bkrs", qj, kk)
            k_pos = i * kb + jnp.arange(kb)
            if (i + 1) * kb > j * qb:  # diagonal block: causal + padding mask
                mask = (k_pos[None, :] <= q_pos[:, None])[None] & (k_pos[None, None, :] < q_lens[:, None, None])
                s = jnp.where(mask[:, None], s, -1e30)
            m_new = jnp.maximum(m, s.max(-1)); p = jnp.exp(s - m_new[..., None]); a = jnp.exp(m - m_new)
            l = l * a + p.sum(-1); acc = acc * a[..., None] + jnp.einsum("bkrs,bksd->bkrd", p, vv); m = m_new
        outs.append(acc / l[..., None])
    out = jnp.concatenate(outs, axis=2)
    return out.reshape(B, kvh, T, g, hd).transpose(0, 2, 1, 3, 4).reshape(B, T, nq, hd).astype(q.dtype)

rng = np.random.default_rng(0)
for T, qb, kb in ((2048, 256, 256), (2048, 256, 512), (2048, 512, 512), (1024, 256, 256), (512, 256, 256)):
    q, k, v, ql, cl, table = paged_inputs(rng, [T], [0], 6, 2, 64, 16)
    pages = table[:, : T // 16]
    kn = k[0, pages].reshape(1, T, 2, 64); vn = v[0, pages].reshape(1, T, 2, 64)
    fa = jax.jit(functools.partial(blocked_attention, layer=0, scale=0.125))
    fb = jax.jit(functools.partial(self_causal, scale=0.125, qb=qb, kb=kb))
    a = lambda: jax.block_until_ready(fa(q, k, v, q_lens=ql, cached_lens=cl, page_table=table))
    b = lambda: jax.block_until_ready(fb(q, kn, vn, ql))
    print("maxdiff", float(jnp.abs(fa(q, k, v, q_lens=ql, cached_lens=cl, page_table=table) - fb(q, kn, vn, ql)).max()))
    ta, tb, r = paired_times(a, b, 9, 3)
    print(f"T={T} qb={qb} kb={kb}: blocked {ta*1e3:.1f} ms, self-unrolled {tb*1e3:.1f} ms, ratio {r:.2f}", flush=True)
