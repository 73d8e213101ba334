"""The simulator's stand-in for the engine: the engine's bookkeeping, the latency model's clock.

`SimEngine` does what `Engine` does on the host (page allocation with the real prefix cache,
progress of each sequence, finishing at max_tokens) but produces deterministic stand-in tokens
instead of running a model. `SimExecutor` wraps it in the scheduler's `StepExecutor` interface
and makes each step take the latency model's prediction on the dispatcher's clock: under
`run_simulated` that is virtual time, so a simulation of an hour of traffic runs in seconds with
the exact pool, window and dispatch code that serves real requests. Simulator support, not
serving core: it lives here, and the scheduler only defines the interface it fills.
"""

from __future__ import annotations

from typing import Sequence as Seq

from laps_jax.engine.paged import PagedSequences
from laps_jax.engine.buckets import Bucket, BucketGrid, padding_fraction
from laps_jax.engine.kv_cache import KVCacheManager
from laps_jax.engine.sequence import Sequence, Status, TokenLogprobs
from laps_jax.scheduler.clock import Clock
from laps_jax.scheduler.executor import Admission, ExecutorStats, StepInfo
from laps_jax.scheduler.latency_model import LatencyModel, StepShape


class SimEngine(PagedSequences):
    """Host-side twin of `Engine` with fake tokens: token t of a sequence is a hash of
    (seq_id, t), so runs are reproducible."""

    def __init__(self, grid: BucketGrid, num_pages: int, page_size: int, max_model_len: int,
                 vocab_size: int, prefix_cache: bool = True):
        self.grid, self.max_model_len, self.vocab_size = grid, max_model_len, vocab_size
        self.kv = KVCacheManager(num_pages, page_size, prefix_cache)

    def prefill(self, work: Seq[tuple[Sequence, int]]) -> None:
        for seq, n in work:
            seq.num_computed += n
            self.kv.commit(seq.pages, seq.prompt[:seq.num_computed])
            if seq.num_computed == len(seq.prompt):
                seq.status = Status.DECODE
                self._append(seq)

    def decode(self, seqs: Seq[Sequence]) -> None:
        for s in seqs:
            self.kv.grow(s.pages, s.num_tokens)
        for s in seqs:
            s.num_computed = s.num_tokens
            self._append(s)

    def _append(self, seq: Sequence) -> None:
        tok = (seq.seq_id * 1_000_003 + seq.num_tokens * 7919) % self.vocab_size
        seq.output.append(tok)
        seq.logprobs.append(TokenLogprobs(tok, 0.0, []))
        if tok in seq.params.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason:
            self.kv.commit(seq.pages, seq.token_slice(0, seq.num_computed))
            self.release(seq)


class SimExecutor:
    """`StepExecutor` over a `SimEngine`; every step sleeps its predicted latency."""

    def __init__(self, engine: SimEngine, model: LatencyModel, clock: Clock, name: str = "sim"):
        self.engine, self.model, self.clock, self.name = engine, model, clock, name
        self.grid = engine.grid
        self.admission = Admission(engine.kv, engine.max_model_len)
        self.bucket_steps: dict[str, int] = {}
        self.real_tokens = self.bucket_tokens = 0

    def check(self, prompt: Seq[int], max_tokens: int) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_tokens > self.engine.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"the maximum context length of {self.engine.max_model_len} tokens")
        if self.admission.never_fits(len(prompt), max_tokens):
            raise ValueError("request needs more KV pages than the cache holds")

    def cached_prefix(self, prompt: Seq[int]) -> int:
        return len(self.engine.kv.match_prefix(prompt)[0]) * self.engine.kv.page_size

    async def admit(self, seqs: Seq[Sequence]) -> int:
        return self.admission.admit_all(list(seqs), self.engine.admit, self.engine.release)

    async def _step(self, kind: str, shape: StepShape, tokens: int) -> StepInfo:
        key = f"{shape.batch}x{shape.tokens}"
        self.bucket_steps[key] = self.bucket_steps.get(key, 0) + 1
        self.real_tokens += tokens
        self.bucket_tokens += shape.batch * shape.tokens
        dt = self.model.predict(shape)
        await self.clock.sleep(dt)
        return StepInfo(kind, len(shape.new), tokens, (shape.batch, shape.tokens), dt)

    async def prefill(self, work: Seq[tuple[Sequence, int]], bucket: Bucket) -> StepInfo:
        work = list(work)
        new = [n for _, n in work]
        self.grid.check_holds(bucket, new)
        info = await self._step("prefill", StepShape.bucketed(
            new, [s.num_computed for s, _ in work], bucket.batch, bucket.tokens), sum(new))
        self.engine.prefill(work)
        return info

    async def decode(self, seqs: Seq[Sequence], bucket: Bucket) -> StepInfo:
        seqs = list(seqs)
        self.grid.check_holds(bucket, [1] * len(seqs))
        info = await self._step("decode", StepShape.bucketed(
            [1] * len(seqs), [s.num_tokens - 1 for s in seqs], bucket.batch, 1), len(seqs))
        self.engine.decode(seqs)
        return info

    async def release(self, seqs: Seq[Sequence], reason: str) -> None:
        for s in seqs:
            self.engine.release(s, reason)

    # KV hand-off (laps-spatial): page accounting only; the copy itself is taken as free
    async def warmup_transfer(self) -> None:
        return None

    async def export_kv(self, seq: Sequence) -> int:
        return seq.num_computed

    async def import_kv(self, seq: Sequence, num_tokens: int):
        tokens = seq.token_slice(0, num_tokens)
        pages = self.engine.kv.allocate(tokens)  # raises OutOfPages, changing nothing
        self.engine.kv.commit(pages, tokens)
        return pages

    async def release_pages(self, pages) -> None:
        self.engine.kv.release(pages)

    def stats(self) -> ExecutorStats:
        kv = self.engine.kv
        return ExecutorStats(dict(self.bucket_steps),
                             padding_fraction(self.real_tokens, self.bucket_tokens), 0, kv.num_used, kv.num_free,
                             kv.hit_tokens)

    async def close(self) -> None:
        return None
