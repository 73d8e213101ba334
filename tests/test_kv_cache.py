"""Page allocator, reference counts, prefix cache and LRU eviction (host-side, no device)."""

from __future__ import annotations

import pytest

from laps_jax.engine.kv_cache import KVCacheManager, OutOfPages


def test_allocate_release_counts_and_page_zero_reserved():
    kv = KVCacheManager(num_pages=9, page_size=4)
    a = kv.allocate(list(range(10)))  # 3 pages
    assert len(a.pages) == 3 and 0 not in a.pages and a.cached_len == 0
    assert kv.num_used == 3 and kv.num_free == 5
    kv.release(a)
    assert kv.num_used == 0 and kv.num_free == 8


def test_prefix_match_reuses_full_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_pages=20, page_size=4)
    hist = list(range(100, 111))  # 11 tokens: 2 full blocks
    a = kv.allocate(hist)
    kv.commit(a, hist)
    b = kv.allocate(hist + [7, 8, 9])
    assert b.cached_len == 8 and b.pages[:2] == a.pages[:2]
    assert kv.ref[a.pages[0]] == 2
    # a prompt equal to cached blocks still computes its last block (needs logits)
    c = kv.allocate(hist[:8])
    assert c.cached_len == 4
    # a different first block shares nothing
    d = kv.allocate([1] + hist[1:])
    assert d.cached_len == 0


def test_unreferenced_cached_pages_evicted_lru_and_out_of_pages_reported():
    kv = KVCacheManager(num_pages=7, page_size=2)  # 6 usable pages
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    a = kv.allocate(x); kv.commit(a, x); kv.release(a)
    b = kv.allocate(y); kv.commit(b, y); kv.release(b)
    assert kv.num_free == 6 and len(kv.lru) == 4
    kv.allocate(x + [9])  # touches x's blocks: y's are now least recent
    kv.allocate([11, 12, 13, 14, 15, 16])  # 3 pages: the last free one, then y's two (LRU)
    assert kv.match_prefix(y + [0])[0] == []          # y evicted
    assert len(kv.match_prefix(x + [0])[0]) == 2      # x kept (pinned)
    used_before = kv.num_used
    with pytest.raises(OutOfPages, match="need"):
        kv.allocate(list(range(50)))
    assert kv.num_used == used_before  # nothing leaked by the failed allocation


def test_failed_allocation_unpins_matched_prefix():
    kv = KVCacheManager(num_pages=5, page_size=2)
    x = [1, 2, 3, 4]
    a = kv.allocate(x); kv.commit(a, x)
    refs = list(kv.ref)
    with pytest.raises(OutOfPages):
        kv.allocate(x + list(range(20)))
    assert kv.ref == refs


def test_grow_for_decode():
    kv = KVCacheManager(num_pages=6, page_size=4)
    a = kv.allocate([1, 2, 3])
    kv.grow(a, 4)
    assert len(a.pages) == 1
    kv.grow(a, 5)
    assert len(a.pages) == 2
