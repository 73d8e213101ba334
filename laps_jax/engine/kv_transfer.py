"""KV hand-off between engines: a finished prefill's pages copied into another engine's pool.

laps-spatial prefills long requests on one device group and decodes on the other; this moves a
sequence's computed K/V (every layer) from the prefilling engine to the decoding one. Copies are
bucketed by page count (powers of 4, padded with the trash page 0 on both sides) and compiled
by the engine's compile owner (`compile_owner.EngineExecutables.warm_copies`) in an
`ExecutableCache` like the step buckets, so a hand-off never compiles on the request path, and
one that would is counted with the steps' compiles after warm-up. Works with both layer loops
(stacked [L, pages, ...] pools or one pool per layer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from laps_jax.engine.executables import ExecutableCache
from laps_jax.engine.kv_cache import SeqPages
from laps_jax.engine.sequence import Sequence


def _gather(k_cache, v_cache, idx):
    take = lambda c: (jnp.stack([p[idx] for p in c]) if isinstance(c, list) else c[:, idx])
    return take(k_cache), take(v_cache)


def _scatter(k_cache, v_cache, idx, k, v):
    def put(c, x):
        if isinstance(c, list):
            return [p.at[idx].set(x[i]) for i, p in enumerate(c)]
        return c.at[:, idx].set(x)
    return put(k_cache, k), put(v_cache, v)


@dataclasses.dataclass
class KVPages:
    """K and V of some pages, every layer: [L, n, page_size, kv_heads, head_dim] each (padded
    to the copy bucket), plus how many tokens of the sequence they hold."""

    k: jax.Array
    v: jax.Array
    num_pages: int
    num_tokens: int


class KVTransfer:
    """Gathers a sequence's pages out of one runner's pools and scatters them into another's."""

    def __init__(self, runner):
        self.runner = runner
        self.sizes: list[int] = []
        n = 1
        while n < runner.pages_per_seq:
            self.sizes.append(n)
            n *= 4
        self.sizes.append(runner.pages_per_seq)
        self.executables = ExecutableCache(self._build)  # keys ("gather" | "scatter", pages)

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _build(self, key: tuple[str, int]):
        r = self.runner
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                  sharding=getattr(x, "sharding", None))
        kc, vc = jax.tree.map(abstract, r.k_cache), jax.tree.map(abstract, r.v_cache)
        kind, n = key
        idx = jax.ShapeDtypeStruct((n,), jnp.int32)
        if kind == "gather":
            return jax.jit(_gather), (kc, vc, idx)
        rest = (r.page_size, r.cfg.num_kv_heads, r.cfg.head_dim)
        data = jax.ShapeDtypeStruct((r.cfg.num_layers, n, *rest), r.kv_dtype)
        return jax.jit(_scatter, donate_argnums=(0, 1)), (kc, vc, idx, data, data)

    def _index(self, pages: list[int]) -> np.ndarray:
        idx = np.zeros(self.bucket(len(pages)), np.int32)  # padding reads/writes trash page 0
        idx[:len(pages)] = pages
        return idx

    def export(self, pages: list[int], num_tokens: int) -> KVPages:
        k, v = self.executables.get(("gather", self.bucket(len(pages))))(
            self.runner.k_cache, self.runner.v_cache, self._index(pages))
        jax.block_until_ready((k, v))  # copied out before the caller frees the pages
        return KVPages(k, v, len(pages), num_tokens)

    def import_(self, pages: list[int], data: KVPages, skip: int = 0) -> None:
        """Writes `data` into `pages`, leaving the first `skip` pages (already cached here)."""
        dst = list(pages[:data.num_pages])
        dst[:skip] = [0] * skip  # shared prefix pages hold the same tokens: do not touch them
        n = self.bucket(data.num_pages)
        if data.k.shape[1] != n:
            raise ValueError(f"K/V exported in a {data.k.shape[1]}-page bucket, this engine "
                             f"copies {n}: both engines need the same max_model_len and page size")
        target = jax.tree.leaves(self.runner.k_cache)[0].sharding
        k, v = jax.device_put((data.k, data.v), target)
        r = self.runner
        r.k_cache, r.v_cache = self.executables.get(("scatter", n))(r.k_cache, r.v_cache,
                                                                     self._index(dst), k, v)


def export_sequence(engine, seq: Sequence) -> KVPages:
    """The K/V of a sequence's computed tokens in `engine` (its pages stay where they are)."""
    n = engine.kv.pages_for(seq.num_computed)
    return engine.transfer.export(seq.pages.pages[:n], seq.num_computed)


def import_sequence(engine, seq: Sequence, data: KVPages) -> SeqPages:
    """Pages for `seq` in `engine` holding `data`; reuses what engine's prefix cache already
    has. Returns the new pages (the caller swaps them in). Raises OutOfPages, changing nothing."""
    tokens = seq.token_slice(0, data.num_tokens)
    pages = engine.kv.allocate(tokens)
    try:
        engine.transfer.import_(pages.pages, data, skip=pages.cached_len // engine.kv.page_size)
    except Exception:
        engine.kv.release(pages)
        raise
    engine.kv.commit(pages, tokens)
    return pages


__all__ = ["KVPages", "KVTransfer", "export_sequence", "import_sequence"]
