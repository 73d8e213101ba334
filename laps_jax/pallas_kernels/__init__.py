"""Attention over the paged KV cache: a backend switch between XLA (jnp) and Pallas kernels.

The bottom of the stack: imports nothing else of laps_jax.
"""

from __future__ import annotations

import jax

from laps_jax.pallas_kernels.reference import paged_attention_reference
from laps_jax.pallas_kernels.xla_attention import KV_BLOCK, Q_BLOCK, paged_attention_xla

BACKENDS = ("xla", "pallas")


def attention_blocks(backend: str) -> tuple[int, int]:
    """(kv_block, q_block) of a backend, what the latency model prices: the XLA path reads K/V
    in blocks of `kv_block` keys and runs batches of rows up to `q_block` tokens ragged; the
    Pallas kernels are exact per sequence (1) and have no ragged cut (0)."""
    return (KV_BLOCK, Q_BLOCK) if backend == "xla" else (1, 0)


def default_backend() -> str:
    """Pallas on GPU, the jnp/XLA path on CPU (where Pallas only runs interpreted)."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def paged_attention(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table, *,
                    scale: float, backend: str = "xla"):
    """Causal attention of new-token queries over a paged, partly cached KV (see reference.py)."""
    if backend == "xla":
        return paged_attention_xla(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                                   scale)
    if backend == "pallas":
        from laps_jax.pallas_kernels.dispatch import paged_attention_pallas
        return paged_attention_pallas(q, k_cache, v_cache, layer, q_lens, cached_lens,
                                      page_table, scale)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


__all__ = ["BACKENDS", "attention_blocks", "default_backend", "paged_attention", "paged_attention_reference",
           "paged_attention_xla"]
