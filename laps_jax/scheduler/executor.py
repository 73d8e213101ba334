"""Step executors: where the scheduler's chosen steps run.

`StepExecutor` is the interface the dispatcher drives. `EngineExecutor` runs every engine call
(admission, prefill, decode, release) on one worker thread, so the event loop never waits on the
device and the engine's host state is only ever touched from that thread. The simulator's
`SimExecutor` (laps_jax/sim/engine.py) has the same interface and advances a virtual clock by
the latency model.

Admission is conservative: a request is admitted only if the free pages cover its whole prompt +
max_tokens on top of what every admitted request may still grow into, so decode never runs out
of pages and nothing needs preempting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time
from typing import Callable, Protocol, Sequence as Seq

from laps_jax.engine.buckets import Bucket, BucketGrid
from laps_jax.engine.kv_cache import KVCacheManager, OutOfPages
from laps_jax.engine.sequence import Sequence


@dataclasses.dataclass
class StepInfo:
    """What one step was: kind, real sequences and tokens, the bucket, and its duration."""

    kind: str            # "prefill" or "decode"
    seqs: int
    tokens: int
    bucket: tuple[int, int]  # (batch, tokens per row) of the executable
    seconds: float


@dataclasses.dataclass
class ExecutorStats:
    bucket_steps: dict[str, int]
    padding_fraction: float
    compiles_after_warmup: int
    kv_pages_used: int
    kv_pages_free: int
    prefix_hit_tokens: int


class StepExecutor(Protocol):
    name: str
    grid: BucketGrid

    def check(self, prompt: Seq[int], max_tokens: int) -> None:
        """Raises ValueError when a request can never run here."""

    def cached_prefix(self, prompt: Seq[int]) -> int:
        """Prompt tokens the prefix cache holds now (a read-only estimate, for routing)."""

    async def admit(self, seqs: Seq[Sequence]) -> int:
        """Admits a prefix of `seqs` in order (pages, cache match); returns how many. One that
        cannot run for its own reasons counts, finished with reason "error" and no pages."""

    async def prefill(self, work: Seq[tuple[Sequence, int]], bucket: Bucket) -> StepInfo:
        """Runs `work` in `bucket`, the one the plan chose (it must hold the rows)."""

    async def decode(self, seqs: Seq[Sequence], bucket: Bucket) -> StepInfo: ...

    async def release(self, seqs: Seq[Sequence], reason: str) -> None: ...

    def stats(self) -> ExecutorStats: ...

    async def close(self) -> None: ...


class Admission:
    """Admits only what can run to completion with the pages left (see module docstring)."""

    def __init__(self, kv: KVCacheManager, max_model_len: int):
        self.kv, self.max_model_len = kv, max_model_len
        self.live: list[Sequence] = []

    def pages_at_end(self, seq: Sequence) -> int:
        return self.kv.pages_for(min(len(seq.prompt) + seq.params.max_tokens, self.max_model_len))

    def fits(self, seq: Sequence) -> bool:
        self.live = [s for s in self.live if not s.is_finished]
        growth = sum(self.pages_at_end(s) - len(s.pages.pages) for s in self.live if s.pages)
        return self.pages_at_end(seq) + growth <= self.kv.num_free

    def admit_all(self, seqs: Seq[Sequence], admit: Callable[[Sequence], None],
                  release: Callable[[Sequence, str], None]) -> int:
        """Admits a prefix of `seqs`; returns its length. A sequence whose own data fails
        admission is in that prefix, finished with reason "error" (`seq.error` says why) and
        its pages freed: it is answered, never retried, and the ones after it go on."""
        for i, s in enumerate(seqs):
            if not self.fits(s):
                return i
            try:
                admit(s)
            except OutOfPages:
                return i
            except Exception as e:  # noqa: BLE001 - this sequence's data, not the engine's
                s.error = f"{type(e).__name__}: {e}"
                s.finish_reason = "error"
                release(s, "error")
                continue
            self.live.append(s)
        return len(seqs)

    def never_fits(self, prompt_len: int, max_tokens: int) -> bool:
        need = self.kv.pages_for(min(prompt_len + max_tokens, self.max_model_len))
        return need > self.kv.num_pages - 1


class EngineExecutor:
    """Runs an `Engine` on one worker thread."""

    def __init__(self, engine, name: str = "engine"):
        self.engine, self.name, self.grid = engine, name, engine.grid
        self.admission = Admission(engine.kv, engine.ecfg.max_model_len)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"laps-{name}")

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args))

    call = _call  # any engine call, on the worker thread (the prefill/decode split's, pd.py)

    def check(self, prompt: Seq[int], max_tokens: int) -> None:
        self.engine.check_prompt(prompt, max_tokens)
        if self.admission.never_fits(len(prompt), max_tokens):
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) needs "
                             f"more KV pages than the cache holds "
                             f"({self.engine.ecfg.kv_cache_tokens} tokens)")

    def cached_prefix(self, prompt: Seq[int]) -> int:
        pages, _ = self.engine.kv.match_prefix(prompt)
        return len(pages) * self.engine.kv.page_size

    async def admit(self, seqs: Seq[Sequence]) -> int:
        return await self._call(self.admission.admit_all, list(seqs), self.engine.admit,
                                self.engine.release)

    @staticmethod
    def _timed(kind: str, run, bucket: Bucket, rows: int, tokens: int) -> StepInfo:
        t0 = time.perf_counter()
        run()
        return StepInfo(kind, rows, tokens, (bucket.batch, bucket.tokens),
                        time.perf_counter() - t0)

    async def prefill(self, work: Seq[tuple[Sequence, int]], bucket: Bucket) -> StepInfo:
        work = list(work)
        run = functools.partial(self.engine.prefill, work, bucket=bucket)
        return await self._call(self._timed, "prefill", run, bucket, len(work),
                                sum(n for _, n in work))

    async def decode(self, seqs: Seq[Sequence], bucket: Bucket) -> StepInfo:
        seqs = list(seqs)
        run = functools.partial(self.engine.decode, seqs, bucket)
        return await self._call(self._timed, "decode", run, bucket, len(seqs), len(seqs))

    async def warmup_transfer(self) -> None:
        await self._call(self.engine.executables.warm_copies)

    async def export_kv(self, seq: Sequence):
        from laps_jax.engine.kv_transfer import export_sequence  # JAX: only with an engine
        return await self._call(export_sequence, self.engine, seq)

    async def import_kv(self, seq: Sequence, data):
        from laps_jax.engine.kv_transfer import import_sequence
        return await self._call(import_sequence, self.engine, seq, data)

    async def release_pages(self, pages) -> None:
        await self._call(self.engine.kv.release, pages)

    async def release(self, seqs: Seq[Sequence], reason: str) -> None:
        def run():
            for s in seqs:
                self.engine.release(s, reason)
        await self._call(run)

    async def clear_prefix_cache(self) -> None:
        await self._call(self.engine.kv.clear_prefix_cache)

    def stats(self) -> ExecutorStats:
        r, kv = self.engine.runner, self.engine.kv
        steps = {f"{b.batch}x{b.tokens}": n for b, n in sorted(r.stats.steps.items())}
        return ExecutorStats(steps, r.stats.padding_fraction,
                             self.engine.executables.compiles_after_warmup,
                             kv.num_used, kv.num_free,
                             kv.hit_tokens)

    async def close(self) -> None:
        await self._call(lambda: None)  # whatever was queued has run
        self._pool.shutdown(wait=False)
