# Experiment of 2026-12-01 (not part of laps_jax): the blocked XLA attention with wider KV and
# query blocks, one 2,048-token sequence of bench-cpu shapes.
# Run from the repository root: python docs/data/engine_vs_transformers/attention_blocks.py
import functools, sys
import jax, numpy as np
sys.path.insert(0, "scripts")
from bench_attention import paged_inputs
from laps_jax.pallas_kernels.xla_attention import blocked_attention
from laps_jax.timing import paired_times
rng = np.random.default_rng(0)
q, k, v, ql, cl, table = paged_inputs(rng, [2048], [0], 6, 2, 64, 16)
def mk(kb, qb):
    f = jax.jit(functools.partial(blocked_attention, layer=0, scale=0.125, block_tokens=kb, q_block=qb))
    g = lambda: jax.block_until_ready(f(q, k, v, q_lens=ql, cached_lens=cl, page_table=table))
    g(); return g
base = mk(256, 256)
for kb, qb in [(512, 256), (256, 512), (512, 512), (1024, 512), (512, 1024)]:
    alt = mk(kb, qb)
    ta, tb, r = paired_times(base, alt, 11, 3)
    print(f"kv {kb} q {qb}: base {ta*1e3:.1f} ms, alt {tb*1e3:.1f} ms, alt/base median of pairs {r:.2f}", flush=True)
