"""The engine's one compile owner: every executable it will ever run is built, run once and
counted here.

Two caches hold the executables — the model steps (one per bucket of the grid, the runner's)
and the KV hand-off copies (one per page-count bucket, `KVTransfer`'s) — and both are
`ExecutableCache`s, so a compile after warm-up is counted the same way in either. Start-up
compiles what will run (all buckets for a server, only what its input needs for a batch job)
and then primes it: XLA's first run of a program is 60-200 ms slower than later ones on this
CPU, so each executable runs once on rows whose K/V goes to the trash page 0. A per-bucket
build choice, if one comes back, belongs in `compile`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from laps_jax.engine.buckets import Bucket
from laps_jax.engine.executables import ExecutableCache

Progress = Callable[[int, int], None] | None


class EngineExecutables:
    """Compiles, primes and counts the executables of one runner and its KV transfer."""

    def __init__(self, runner, transfer):
        self.runner, self.transfer = runner, transfer
        self.steps, self.copies = runner.executables, transfer.executables

    @property
    def compiles_after_warmup(self) -> int:
        return self.steps.compiles_after_warmup + self.copies.compiles_after_warmup

    def all_buckets(self, prompt_logprobs: bool = False) -> list[Bucket]:
        """Every shape a server runs: prefill and decode (and prompt log-prob prefill)."""
        grid = self.runner.grid
        buckets = grid.prefill_buckets() + grid.decode_buckets()
        if prompt_logprobs:
            buckets += grid.prefill_buckets(True)
        return buckets

    def copy_keys(self) -> list[tuple[str, int]]:
        """Every KV hand-off copy: a gather and a scatter per page-count bucket."""
        return [(k, n) for n in self.transfer.sizes for k in ("gather", "scatter")]

    def planned(self, prompt_logprobs: bool = False) -> list[tuple[ExecutableCache, object]]:
        """(cache, key) of every executable a server compiles: the step buckets, then the KV
        hand-off copies (what `warmup` and `warm_copies` build; engine/aot.py compiles
        this list, so it cannot drift from what runs)."""
        return ([(self.steps, b) for b in sorted(set(self.all_buckets(prompt_logprobs)))]
                + [(self.copies, k) for k in self.copy_keys()])

    def compile(self, buckets: Sequence[Bucket], progress: Progress = None) -> None:
        self.steps.warmup(list(buckets), progress)

    def prime(self, buckets: Sequence[Bucket], progress: Progress = None) -> None:
        """Runs each step executable once on a full batch whose pages are all the trash page 0
        (no sequence's K/V is touched). The rows are full (not 0 tokens): code inside the
        attention loops only warms up when it runs."""
        todo = sorted(set(buckets))
        for i, bucket in enumerate(todo):
            self.runner.run_trash(bucket, self.steps.get(bucket))
            if progress:
                progress(i + 1, len(todo))

    def warmup(self, prompt_logprobs: bool = False, progress: Progress = None) -> None:
        buckets = self.all_buckets(prompt_logprobs)
        self.compile(buckets, progress)
        self.prime(buckets)

    def warm_copies(self, progress: Progress = None) -> None:
        """Compiles every KV hand-off copy and runs each once on the trash page 0 only (the
        laps-spatial dispatcher asks for this before it takes requests)."""
        if self.copies.warm:
            return
        self.copies.warmup(self.copy_keys(), progress)
        r = self.runner
        for n in self.transfer.sizes:
            trash = np.zeros(n, np.int32)
            k, v = self.copies.get(("gather", n))(r.k_cache, r.v_cache, trash)
            r.k_cache, r.v_cache = self.copies.get(("scatter", n))(r.k_cache, r.v_cache,
                                                                   trash, k, v)
        jax.block_until_ready((r.k_cache, r.v_cache))
