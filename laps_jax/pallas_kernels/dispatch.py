"""Pick the Pallas kernel for a call: decode when T == 1, ragged prefill otherwise.

Pallas runs natively only on GPU (Triton lowering); elsewhere it runs interpreted, which is slow
but exact, so tests on CPU exercise the same kernel code. LAPS_PALLAS_INTERPRET=0/1 overrides the
automatic choice (scripts/device_check.py sets 0 to run the tests natively on a GPU).
"""

from __future__ import annotations

import os

import jax

from laps_jax.pallas_kernels.decode_kernel import paged_decode_attention
from laps_jax.pallas_kernels.prefill_kernel import paged_prefill_attention

INTERPRET_ENV = "LAPS_PALLAS_INTERPRET"


def use_interpret() -> bool:
    """Interpret unless on GPU; the env var, when set to 0 or 1, wins."""
    env = os.environ.get(INTERPRET_ENV, "").strip().lower()
    if env in ("0", "false", "no"):
        return False
    if env in ("1", "true", "yes"):
        return True
    return jax.default_backend() != "gpu"


def paged_attention_pallas(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer,
                           q_lens: jax.Array, cached_lens: jax.Array, page_table: jax.Array,
                           scale: float) -> jax.Array:
    """Causal attention over the paged cache (layout: reference.py); [B,T,nq,hd] in q.dtype."""
    interpret = use_interpret()
    if q.shape[1] == 1:
        return paged_decode_attention(q, k_cache, v_cache, layer, q_lens, cached_lens,
                                      page_table, scale, interpret=interpret)
    return paged_prefill_attention(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table,
                                   scale, interpret=interpret)
