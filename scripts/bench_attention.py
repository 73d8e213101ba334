#!/usr/bin/env python
"""Times one layer of the XLA paged-attention path (the CPU default) at a prefill shape."""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from laps_jax.pallas_kernels import paged_attention_xla


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new", type=int, default=2048, help="new tokens (one sequence)")
    ap.add_argument("--cached", type=int, default=0, help="tokens already in the cache")
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    ps, n = args.page_size, args.new + args.cached
    pages = -(-n // ps)
    rng = np.random.default_rng(0)
    shape = (1, pages + 1, ps, args.kv_heads, args.head_dim)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = jnp.asarray(rng.standard_normal((1, args.new, args.heads, args.head_dim)), jnp.float32)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    fn = jax.jit(functools.partial(paged_attention_xla, scale=args.head_dim ** -0.5))
    call = lambda: fn(q, k, v, 0, jnp.array([args.new]), jnp.array([args.cached]),
                      table).block_until_ready()
    call()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    flops = 4 * args.heads * args.head_dim * args.new * (args.cached + args.new / 2)
    print(f"new {args.new} cached {args.cached}: {1000 * t:.1f} ms per layer, "
          f"{flops / t / 1e9:.1f} GFLOP/s (causal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
