"""Bucketed, ahead-of-time compiled step executables (JAX's answer to CUDA Graphs).

Every shape the engine runs is a bucket: prefill (sequences, padded new tokens) and decode
(batch size, 1 token). All buckets are compiled at start-up with `lower().compile()`, with the
persistent compilation cache on, so the request path only ever calls a finished executable.
Any compile that happens after warm-up is counted (it is a bug; /metrics shows the count).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable

import jax

log = logging.getLogger(__name__)

_compile_events = 0
_listener_installed = False
_lock = threading.Lock()


def enable_persistent_cache(path: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache (minimum compile time 0), with unreadable
    entries replaced and hits counted (engine/compile_cache.py)."""
    from laps_jax.engine import compile_cache
    compile_cache.install()
    path = path or os.environ.get("LAPS_JAX_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "laps_jax", "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _on_event(event: str, *args, **kwargs) -> None:
    global _compile_events
    if event == "/jax/compilation_cache/compile_requests_use_cache" or event.endswith(
            "backend_compile_duration"):
        with _lock:
            _compile_events += 1


def jax_compile_events() -> int:
    """Process-wide count of XLA backend compiles seen by jax.monitoring."""
    global _listener_installed
    if not _listener_installed:
        jax.monitoring.register_event_duration_secs_listener(
            lambda e, d, **kw: _on_event(e))
        _listener_installed = True
    return _compile_events


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    tokens: int
    prompt_logprobs: bool = False

    @property
    def is_decode(self) -> bool:
        return self.tokens == 1


def pow2_range(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return sorted(set(out))


@dataclasses.dataclass
class BucketGrid:
    """Which (batch, tokens) shapes exist. Prefill batches stay under a token budget."""

    prefill_batches: list[int]
    prefill_tokens: list[int]
    decode_batches: list[int]
    max_batch_tokens: int

    @classmethod
    def default(cls, max_chunk: int = 2048, max_prefill_batch: int = 8, max_decode_batch: int = 32,
                min_tokens: int = 16, max_batch_tokens: int | None = None) -> "BucketGrid":
        budget = max_batch_tokens or max_chunk
        min_tokens = min(min_tokens, max_chunk)
        # a batch size with no bucket under the budget is never compiled nor planned
        batches = [b for b in pow2_range(1, max_prefill_batch) if b * min_tokens <= budget]
        return cls(batches or [1], pow2_range(min_tokens, max_chunk),
                   pow2_range(1, max_decode_batch), budget)

    def prefill_buckets(self, prompt_logprobs: bool = False) -> list[Bucket]:
        return list(self._prefill_buckets(prompt_logprobs))

    def _prefill_buckets(self, prompt_logprobs: bool) -> tuple[Bucket, ...]:
        key = (prompt_logprobs, tuple(self.prefill_batches), tuple(self.prefill_tokens),
               self.max_batch_tokens)
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:  # the scheduler asks on every plan: build the list once
            cache[key] = tuple(Bucket(b, t, prompt_logprobs) for b in self.prefill_batches
                               for t in self.prefill_tokens
                               if b == 1 or b * t <= self.max_batch_tokens)
        return cache[key]

    def decode_buckets(self) -> list[Bucket]:
        return [Bucket(b, 1) for b in self.decode_batches]

    @property
    def max_chunk(self) -> int:
        return self.prefill_tokens[-1]

    def fit_prefill(self, n_seqs: int, max_new: int, prompt_logprobs: bool = False) -> Bucket | None:
        """Smallest bucket (fewest padded tokens) holding n_seqs sequences of <= max_new tokens."""
        best = None
        for b in self._prefill_buckets(prompt_logprobs):
            if b.batch >= n_seqs and b.tokens >= max_new:
                if best is None or (b.batch * b.tokens, b.tokens) < (best.batch * best.tokens,
                                                                     best.tokens):
                    best = b
        return best

    def fit(self, n_seqs: int, max_new: int, prompt_logprobs: bool = False) -> Bucket | None:
        """The bucket a step of n_seqs sequences (<= max_new new tokens each) runs in: a decode
        bucket for one token each, else the smallest prefill bucket; None if none holds it."""
        if max_new == 1 and not prompt_logprobs:
            b = self.fit_decode(n_seqs)
            if b is not None:
                return b
        return self.fit_prefill(n_seqs, max_new, prompt_logprobs)

    def fit_decode(self, n_seqs: int) -> Bucket | None:
        for b in self.decode_batches:
            if b >= n_seqs:
                return Bucket(b, 1)
        return None


class ExecutableCache:
    """Compiled executables keyed by bucket; `build(bucket)` returns the jitted function and its
    abstract arguments, `get(bucket)` the compiled executable."""

    def __init__(self, build: Callable[[Bucket], tuple[Callable, tuple]]):
        self._build = build
        self._compiled: dict[Bucket, Callable] = {}
        self.warm = False
        self.compiles_after_warmup = 0
        self.compile_seconds = 0.0

    def _compile(self, bucket: Bucket):
        fn, args = self._build(bucket)
        t0 = time.perf_counter()
        exe = fn.lower(*args).compile()
        with _lock:
            self.compile_seconds += time.perf_counter() - t0
            self._compiled[bucket] = exe
        return exe

    def warmup(self, buckets: list[Bucket], progress: Callable[[int, int], None] | None = None,
               workers: int | None = None):
        """Compiles every bucket; XLA compiles run on a thread pool (they release the GIL)."""
        todo = [b for b in sorted(set(buckets)) if b not in self._compiled]
        if workers is None:  # measured on the 2-core CPU: threads only slowed it down
            workers = 1 if jax.default_backend() == "cpu" else min(len(todo), os.cpu_count() or 1, 8)
        workers = max(1, min(workers, len(todo)))
        done = 0
        if workers > 1:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(workers) as pool:
                for _ in pool.map(self._compile, todo):
                    done += 1
                    if progress:
                        progress(done, len(todo))
        else:
            for b in todo:
                self._compile(b)
                done += 1
                if progress:
                    progress(done, len(todo))
        self.warm = True

    def get(self, bucket: Bucket):
        exe = self._compiled.get(bucket)
        if exe is None:
            if self.warm:
                self.compiles_after_warmup += 1
                log.warning("compiling bucket %s after warm-up", bucket)
            exe = self._compile(bucket)
        return exe

    def __contains__(self, bucket: Bucket) -> bool:
        return bucket in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)
