#!/usr/bin/env python
"""A whole engine decode step with the ragged attention path against the blocked one.

Two engines on the same random `bench-cpu` weights in one process: the first compiles its
executables as shipped; the second while the module's ragged path is swapped for the blocked
one. Their decode steps are called alternately on the same histories and the speedup is the
median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from laps_jax.builder import EngineBuild, build
from laps_jax.config import PRESETS, EngineConfig
from laps_jax.engine.engine import Engine
from laps_jax.engine.sequence import SamplingParams, Sequence
from laps_jax.models.qwen2 import init_params
from laps_jax.pallas_kernels import xla_attention
from laps_jax.timing import paired_times

BATCHES = ("300x8", "2000x8", "2000x1+300x7", "2000x1+300x15", "128x8")


def histories(spec: str) -> list[int]:
    """'2000x1+300x7' -> [2000, 300, 300, ...]."""
    out = []
    for part in spec.split("+"):
        n, k = part.split("x")
        out += [int(n)] * int(k)
    return out


def fill(eng: Engine, lens: list[int], rng, vocab: int) -> list[Sequence]:
    seqs = [Sequence(rng.integers(0, vocab, n).tolist(),
                     SamplingParams(max_tokens=10 ** 6, ignore_eos=True)) for n in lens]
    eng.prefill_prompts(seqs)
    return seqs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default=",".join(BATCHES),
                    help="comma-separated batches of histories, LENxCOUNT joined by +")
    ap.add_argument("--steps", type=int, default=15, help="timed decode steps per side")
    args = ap.parse_args(argv)
    cfg = PRESETS["bench-cpu"]
    ecfg = EngineConfig(page_size=16, kv_cache_tokens=32768, max_model_len=4096, max_chunk=512,
                        max_prefill_batch=1, max_decode_batch=16)
    params = init_params(cfg)
    spec = EngineBuild("bench-cpu", ecfg)
    ragged = build(spec, weights=(cfg, params)).engine
    shipped = xla_attention.ragged_attention
    xla_attention.ragged_attention = (lambda q, k, v, layer, ql, cl, pt, scale, bt=256:
                                      xla_attention.blocked_attention(q, k, v, layer, ql, cl,
                                                                      pt, scale, bt))
    try:
        blocked = build(spec, weights=(cfg, params)).engine
    finally:
        xla_attention.ragged_attention = shipped
    rng = np.random.default_rng(0)
    print("| histories | ragged ms | blocked ms | ragged speedup (median of pairs) |\n"
          "|---|---|---|---|")
    for spec in args.batches.split(","):
        lens = histories(spec)
        a, b = fill(ragged, lens, rng, cfg.vocab_size), fill(blocked, lens, rng, cfg.vocab_size)
        t_r, t_b, speedup = paired_times(lambda: ragged.decode(a), lambda: blocked.decode(b),
                                         args.steps)
        print(f"| {spec} | {1e3 * t_r:.1f} | {1e3 * t_b:.1f} | {speedup:.2f}x |", flush=True)
        for s in a:
            ragged.release(s)
        for s in b:
            blocked.release(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
