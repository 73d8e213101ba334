#!/usr/bin/env python
"""Times one layer of the XLA paged-attention path (the CPU default).

Default: one sequence of --new tokens (2048) over --cached ones. With --contexts: a batch, one
sequence per history length, each with --new tokens (1: a decode step) on top; the ragged path
the dispatch takes for such batches against the blocked path (which walks every row to the
longest history), called alternately; the speedup is the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from laps_jax.pallas_kernels.xla_attention import (blocked_attention, paged_attention_xla,
                                                   ragged_attention)
from laps_jax.timing import median_time, paired_times


def paged_inputs(rng, q_lens: list[int], cached: list[int], heads: int, kv_heads: int,
                 head_dim: int, ps: int):
    """Random q and K/V caches, each sequence on its own shuffled pages (page 0 unused)."""
    kv = [q + c for q, c in zip(q_lens, cached)]
    per = max(-(-n // ps) for n in kv)
    pages = 1 + per * len(kv)
    shape = (1, pages, ps, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(kv), max(q_lens), heads, head_dim)), jnp.float32)
    table = jnp.asarray(1 + rng.permutation(pages - 1).reshape(len(kv), per), jnp.int32)
    return q, k, v, jnp.asarray(q_lens, jnp.int32), jnp.asarray(cached, jnp.int32), table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new", type=int, default=None,
                    help="new tokens per sequence (default 2048; with --contexts 1)")
    ap.add_argument("--cached", type=int, default=0, help="tokens already cached (one sequence)")
    ap.add_argument("--contexts", default=None,
                    help="a batch instead: comma-separated history lengths, one per sequence "
                         "(e.g. 2000,300,300,300,300,300,300,300)")
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    scale = args.head_dim ** -0.5
    dims = (args.heads, args.kv_heads, args.head_dim, args.page_size)
    if args.contexts:
        ctx = [int(x) for x in args.contexts.split(",")]
        new = args.new or 1
        inputs = paged_inputs(rng, [new] * len(ctx), ctx, *dims)
        run = lambda f: jax.jit(lambda q, k, v, ql, cl, pt: f(q, k, v, 0, ql, cl, pt, scale))
        ragged, blocked = run(ragged_attention), run(blocked_attention)
        out_r, out_b = ragged(*inputs), blocked(*inputs)
        err = float(jnp.abs(out_r - out_b).max())
        t_r, t_b, speedup = paired_times(lambda: ragged(*inputs).block_until_ready(),
                                         lambda: blocked(*inputs).block_until_ready(),
                                         args.repeats)
        print(f"{new} new tokens on each of {len(ctx)} histories of {sum(ctx)} tokens in all "
              f"(longest {max(ctx)}): "
              f"ragged {1000 * t_r:.2f} ms, blocked {1000 * t_b:.2f} ms per layer; ragged "
              f"{speedup:.2f}x faster (median of pairs); max |difference| {err:.1e}")
        return 0
    new = args.new or 2048
    inputs = paged_inputs(rng, [new], [args.cached], *dims)
    fn = jax.jit(lambda q, k, v, ql, cl, pt: paged_attention_xla(q, k, v, 0, ql, cl, pt, scale))
    t = median_time(lambda: fn(*inputs).block_until_ready(), args.repeats)
    flops = 4 * args.heads * args.head_dim * new * (args.cached + new / 2)
    print(f"new {new} cached {args.cached}: {1000 * t:.1f} ms per layer, "
          f"{flops / t / 1e9:.1f} GFLOP/s (causal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
