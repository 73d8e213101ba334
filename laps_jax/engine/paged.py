"""Admission and release of sequences over a page pool, in plain Python (no JAX): the engine
and the simulator's stand-in share it, so both account pages the same way."""

from __future__ import annotations

import random

from laps_jax.engine.kv_cache import KVCacheManager
from laps_jax.engine.sequence import Sequence, Status

SEED_LIMIT = 1 << 64


class PagedSequences:
    """Admission and release of sequences over a `KVCacheManager` (`self.kv`): shared by the
    engine and the simulator's stand-in, so both account pages the same way."""

    kv: KVCacheManager

    def admit(self, seq: Sequence) -> None:
        """Gives a waiting sequence its pages, reusing cached history. Raises OutOfPages, or
        ValueError for a bad seed; either way before any page is taken, so nothing leaks.
        A request without a seed gets a random one here (its draws: sampling.position_uniform)."""
        seed = seq.params.seed if seq.params.seed is not None else random.getrandbits(63)
        if not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"seed must be a non-negative integer under 2**64, got {seed}")
        pages = self.kv.allocate(seq.prompt)
        seq.pages, seq.num_computed = pages, pages.cached_len
        seq.cached_tokens = pages.cached_len
        seq.status = Status.PREFILL
        seq.seed = seed

    def release(self, seq: Sequence, reason: str | None = None) -> None:
        """Frees a sequence's pages (finished, aborted or disconnected)."""
        if seq.pages is not None:
            self.kv.release(seq.pages)
            seq.pages = None
        if seq.status is not Status.FINISHED:
            seq.status = Status.FINISHED
            seq.finish_reason = seq.finish_reason or reason or "abort"
