"""Bucketed, ahead-of-time compiled step executables (JAX's answer to CUDA Graphs).

Every shape the engine runs is a bucket: prefill (sequences, padded new tokens) and decode
(batch size, 1 token). All buckets are compiled at start-up with `lower().compile()`, with the
persistent compilation cache on, so the request path only ever calls a finished executable.
Any compile that happens after warm-up is counted (it is a bug; /metrics shows the count).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import jax

from laps_jax.engine.buckets import Bucket, BucketGrid, pow2_range  # noqa: F401 (re-exported)

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


class ExecutableCache:
    """Compiled executables keyed by bucket; `build(bucket)` returns the jitted function and its
    abstract arguments, `get(bucket)` the compiled executable."""

    def __init__(self, build: Callable[[Bucket], tuple[Callable, tuple]]):
        self._build = build
        self._compiled: dict[Bucket, Callable] = {}
        self.warm = False
        self.compiles_after_warmup = 0
        self.compile_seconds = 0.0

    def compile(self, bucket: Bucket):
        """Compiles one bucket (for the devices its arguments are on) and keeps it."""
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
                for _ in pool.map(self.compile, todo):
                    done += 1
                    if progress:
                        progress(done, len(todo))
        else:
            for b in todo:
                self.compile(b)
                done += 1
                if progress:
                    progress(done, len(todo))
        self.warm = True

    def put(self, bucket: Bucket, exe) -> None:
        """An executable built elsewhere (loaded from disk: engine/executable_store.py) whose
        arguments match the bucket's; ValueError otherwise, and nothing is kept."""
        fn, args = self._build(bucket)
        sig = lambda tree: [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(tree)]
        if jax.tree.structure(exe.args_info) != jax.tree.structure((args, {})) or \
                sig(exe.args_info) != sig((args, {})):
            raise ValueError(f"its arguments are not bucket {bucket}'s")
        with _lock:
            self._compiled[bucket] = exe

    def get(self, bucket: Bucket):
        exe = self._compiled.get(bucket)
        if exe is None:
            if self.warm:
                self.compiles_after_warmup += 1
                log.warning("compiling bucket %s after warm-up", bucket)
            exe = self.compile(bucket)
        return exe

    def __contains__(self, bucket: Bucket) -> bool:
        return bucket in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)
