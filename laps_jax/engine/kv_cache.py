"""Host-side bookkeeping of the paged KV cache: page allocator and prefix cache.

Pages hold `page_size` tokens of K and V for every layer. Page 0 is never handed out: padded
tokens of a bucket write there. A full page whose tokens are known is registered in the prefix
cache under a chained hash (hash of the previous block's hash and this block's tokens), so a
follow-up turn that repeats the history finds it page by page. Pages nobody references stay
cached and are evicted least-recently-used when the free list runs dry.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np


class OutOfPages(RuntimeError):
    """Not enough free or evictable KV pages; the caller decides (queue, refuse, preempt)."""


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return block_hash_bytes(parent, np.asarray(tokens, dtype="<i4").tobytes())


def block_hash_bytes(parent: bytes, block: bytes) -> bytes:
    """`block_hash` of a block already in bytes (little-endian int32 ids): a caller hashing a
    whole prompt converts it once (the router's `prompt_hashes`)."""
    return hashlib.blake2b(parent + block, digest_size=16).digest()


@dataclasses.dataclass
class SeqPages:
    """The pages of one sequence and how many of its tokens were found in the prefix cache."""

    pages: list[int]
    cached_len: int
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # of registered full blocks


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True):
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (page 0 is reserved)")
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = [0] * num_pages
        self.free: collections.deque[int] = collections.deque(range(1, num_pages))
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hit_tokens = 0

    # -- accounting ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (free or evictable)."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        """Pages referenced by a live sequence."""
        return self.num_pages - 1 - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- allocation ---------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"need {n} KV pages, {self.num_free} free of {self.num_pages - 1}")
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.lru.popitem(last=False)
                del self.by_hash[self.hash_of.pop(page)]
            self.ref[page] = 1
            out.append(page)
        return out

    def _pin(self, page: int) -> None:
        if self.ref[page] == 0:
            self.lru.pop(page, None)
        self.ref[page] += 1

    def _unpin(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] == 0:
            if page in self.hash_of:
                self.lru[page] = None
            else:
                self.free.append(page)

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Cached pages of the longest full-block prefix, leaving at least one token to compute."""
        pages, hashes, parent = [], [], b""
        if not self.enable_prefix_cache:
            return pages, hashes
        ps = self.page_size
        for i in range((len(tokens) - 1) // ps):
            parent = block_hash(parent, tokens[i * ps:(i + 1) * ps])
            page = self.by_hash.get(parent)
            if page is None:
                break
            pages.append(page)
            hashes.append(parent)
        return pages, hashes

    def allocate(self, tokens: Sequence[int], reserve: int = 0) -> SeqPages:
        """Pages for a prompt (+ `reserve` more tokens), reusing cached history. All or nothing."""
        cached, hashes = self.match_prefix(tokens)
        need = self.pages_for(len(tokens) + reserve) - len(cached)
        for page in cached:
            self._pin(page)
        try:
            fresh = self._take(need)
        except OutOfPages:
            for page in cached:
                self._unpin(page)
            raise
        cached_len = len(cached) * self.page_size
        self.hit_tokens += cached_len
        return SeqPages(cached + fresh, cached_len, hashes)

    def grow(self, seq: SeqPages, num_tokens: int) -> None:
        """Makes room for `num_tokens` tokens in total (decode appends)."""
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self._take(need))

    def commit(self, seq: SeqPages, tokens: Sequence[int]) -> None:
        """Registers the full blocks of `tokens` (whose K/V are now written) for reuse."""
        if not self.enable_prefix_cache:
            return
        ps = self.page_size
        parent = seq.hashes[-1] if seq.hashes else b""
        for i in range(len(seq.hashes), len(tokens) // ps):
            parent = block_hash(parent, tokens[i * ps:(i + 1) * ps])
            seq.hashes.append(parent)
            page = seq.pages[i]
            if parent not in self.by_hash and page not in self.hash_of:
                self.by_hash[parent] = page
                self.hash_of[page] = parent

    def release(self, seq: SeqPages) -> None:
        for page in seq.pages:
            self._unpin(page)
        seq.pages = []

    def clear_prefix_cache(self) -> None:
        for page in list(self.lru):
            self.lru.pop(page)
            del self.by_hash[self.hash_of.pop(page)]
            self.free.append(page)
