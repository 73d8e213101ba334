"""Keeps JAX's persistent compilation cache honest.

jax 0.10.2, on an entry it cannot read (a truncated or garbled file, e.g. from a start killed
mid-write), warns and compiles, but its file cache never overwrites an existing key, so the bad
entry stays and every later start compiles that executable again. `install` wraps the cache read
so that a failed read deletes the entry first, and the write after the compile replaces it. It
also counts, through jax.monitoring, how many executables the cache served, so the start-up log
can report what happened rather than promise reuse.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading

import jax

log = logging.getLogger(__name__)

_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"
_ENTRY_SUFFIX = "-cache"   # jax._src.lru_cache: an entry is <dir>/<key>-cache
_ATIME_SUFFIX = "-atime"   # ... with <key>-atime beside it when eviction is on

_lock = threading.Lock()
_counts = {"requests": 0, "hits": 0, "replaced": 0}
_installed = False


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Compiles that consulted the persistent cache, since the process started."""

    requests: int = 0  # executables looked up in the cache
    hits: int = 0      # ... and loaded from it
    replaced: int = 0  # unreadable entries deleted, so their compile writes them again

    @property
    def compiled(self) -> int:
        return self.requests - self.hits

    def __sub__(self, other: "CacheStats") -> "CacheStats":
        return CacheStats(self.requests - other.requests, self.hits - other.hits,
                          self.replaced - other.replaced)

    def describe(self) -> str:
        """For the start-up log, e.g. '12 of 14 executables loaded from it, 2 compiled'."""
        if not self.requests:
            return "not used (no executable was looked up in it)"
        text = (f"{self.hits} of {self.requests} executables loaded from it, "
                f"{self.compiled} compiled")
        if self.replaced:
            text += f" ({self.replaced} unreadable entries replaced)"
        return text


def stats() -> CacheStats:
    with _lock:
        return CacheStats(**_counts)


def _on_event(event: str, **kwargs) -> None:
    key = {_REQUESTS: "requests", _HITS: "hits"}.get(event)
    if key:
        with _lock:
            _counts[key] += 1


def _drop_entry(cache_key: str, error: Exception) -> None:
    """Deletes the entry a read failed on (the file cache's put skips existing keys)."""
    from jax._src import compilation_cache as cc
    root = getattr(cc._cache, "_path", None)  # LRUCache, or VerificationCache around one
    if root is None:
        return
    removed = False
    for suffix in (_ENTRY_SUFFIX, _ATIME_SUFFIX):
        try:
            (root / f"{cache_key}{suffix}").unlink()
            removed = removed or suffix == _ENTRY_SUFFIX
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("persistent compilation cache: cannot remove %s%s: %s",
                        cache_key, suffix, e)
    if removed:
        with _lock:
            _counts["replaced"] += 1
        log.warning("persistent compilation cache: entry %s is unreadable (%s: %s); removed, "
                    "this compile writes it again", cache_key, type(error).__name__, error)


def _guard_reads() -> None:
    from jax._src import compilation_cache as cc
    read = getattr(cc, "get_executable_and_time", None)
    if read is None or getattr(read, "_laps_guarded", False):
        if read is None:
            log.warning("jax %s has no compilation_cache.get_executable_and_time: corrupt "
                        "persistent cache entries will not be replaced", jax.__version__)
        return

    @functools.wraps(read)
    def guarded(cache_key: str, *args, **kwargs):
        try:
            return read(cache_key, *args, **kwargs)
        except Exception as e:  # JAX warns and compiles; make the write after it land
            _drop_entry(cache_key, e)
            raise

    guarded._laps_guarded = True
    cc.get_executable_and_time = guarded  # jax._src.compiler looks it up on each read


def install() -> None:
    """Idempotent: guards cache reads and starts counting lookups and hits."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_listener(_on_event)
    _guard_reads()
