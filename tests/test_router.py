"""The network router (scripts/router.py, laps_jax/cluster/http_router.py).

Fast tests: its bookkeeping without processes (load, block index hashed as the engine hashes,
metrics parsing, the policy's eligible mask, picking). Slow tests: two real serve.py processes
of a tiny checkpoint behind the router in this process, on loopback."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.error
import urllib.request

import pytest

from laps_jax.cluster.http_router import Estimate, HTTPRouter, estimate
from laps_jax.cluster.policy import RouterConfig, RoutingPolicy
from laps_jax.cluster.upstream import (BlockIndex, LoadBook, cached_prefixes, parse_metrics,
                                       prompt_hashes)
from laps_jax.engine.kv_cache import KVCacheManager
from laps_jax.server.protocol import APIError

# -- fast: bookkeeping ---------------------------------------------------------------------


def test_load_book_counts_what_was_sent_since_the_poll_began():
    b = LoadBook()
    b.sent(100, now=1.0)
    b.sent(50, now=2.0)
    assert b.load == 150 and b.since_poll == 150
    b.report(120, poll_started=1.5)  # the 100 sent at 1.0 are in the report; the 50 are not
    assert b.reported == 120 and b.since_poll == 50 and b.load == 170
    b.sent(7, now=3.0)
    b.report(0, poll_started=2.5)
    assert b.load == 7
    b.report(-3, poll_started=9.0)  # nonsense from an instance counts as nothing
    assert b.load == 0
    b.sent(5, 10.0)
    b.clear()
    assert b.load == 0 and b.since_poll == 0


@pytest.mark.parametrize("page_size", [4, 8, 16])
def test_block_index_hashes_as_the_engine_prefix_cache(page_size):
    """The router's estimate of an instance's cached prefix equals what the engine's own
    prefix cache matches, for prompts that share history at every offset."""
    rng = random.Random(page_size)
    kv = KVCacheManager(num_pages=512, page_size=page_size)
    index = BlockIndex(page_size)
    history = [rng.randrange(1000) for _ in range(70)]
    for n in (1, page_size - 1, page_size, page_size + 1, 33, 70):
        prompt = history[:n]
        seq = kv.allocate(prompt)
        kv.commit(seq, prompt)
        kv.release(seq)
        index.add(prompt)
    for n in range(1, 90):
        probe = history[:n] + [rng.randrange(1000) for _ in range(n % 5)]
        pages, _ = kv.match_prefix(probe)
        assert cached_prefixes(probe, [index])[0] == len(pages) * page_size, n
    other = [rng.randrange(1000, 2000) for _ in range(40)]
    assert cached_prefixes(other, [index]) == [0]


def test_cached_prefixes_per_instance_and_block_size():
    toks = list(range(100, 164))
    a, b, c = BlockIndex(8), BlockIndex(8), BlockIndex(16)
    a.add(toks[:40])
    b.add(toks[:17])
    c.add(toks)
    assert cached_prefixes(toks, [a, b, c, None, BlockIndex(8)]) == [40, 16, 48, 0, 0]
    assert cached_prefixes(toks[:16], [a, b, c]) == [8, 8, 0]  # the last token is computed


def test_block_index_forgets_least_recently_used_first():
    ix = BlockIndex(4, capacity=6)
    old, new = list(range(12)), list(range(50, 62))
    ix.add(old)
    ix.add(new)  # 3 + 3 blocks: full
    ix.add(old[:4])  # old's first block is used again
    ix.add(list(range(90, 94)))  # one more: the least recently used (old's 2nd block) goes
    hs = prompt_hashes(old, 4)
    assert len(ix) == 6 and hs[0] in ix and hs[1] not in ix
    assert cached_prefixes(old + [1], [ix]) == [4]


METRICS = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="8",num_gpu_blocks="1024"} 1.0
# TYPE laps_pending_prefill_tokens gauge
laps_pending_prefill_tokens{pool="admission"} 30.0
laps_pending_prefill_tokens{pool="long"} 300.0
laps_pending_prefill_tokens{pool="short"} 12.0
# TYPE laps_kv_pages_used gauge
laps_kv_pages_used{engine="0"} 5.0
"""


def test_parse_metrics():
    r = parse_metrics(METRICS)
    assert (r.pending_tokens, r.block_size, r.num_blocks) == (342.0, 8, 1024)
    assert (r.waiting, r.running, r.kv_usage, r.pages_used) == (2.0, 1.0, 0.25, 5.0)
    empty = parse_metrics("# nothing\n")
    assert empty.pending_tokens is None and empty.block_size is None


# -- fast: the policy's eligible mask -----------------------------------------------------


@pytest.mark.parametrize("policy", ["round-robin", "least-load", "length-aware"])
def test_all_eligible_decides_as_before(policy):
    cfg = RouterConfig(policy=policy, threshold=64, rebalance_interval_s=1.0)
    a = RoutingPolicy(4, cfg, lambda n, c: n <= 64, 100.0)
    b = RoutingPolicy(4, cfg, lambda n, c: n <= 64, 100.0)
    rng = random.Random(7)
    for t in range(300):
        n = rng.choice([10, 50, 200, 900])
        cached = [rng.choice([0, 0, 0, n // 2 + 1]) for _ in range(4)]
        loads = [rng.uniform(0, 500) for _ in range(4)]
        ca = a.choose(n, cached, loads, t * 0.3)
        cb = b.choose(n, cached, loads, t * 0.3, eligible=[True] * 4)
        assert ca == cb
    assert a.stats == b.stats and a.group == b.group


@pytest.mark.parametrize("policy", ["round-robin", "least-load", "length-aware"])
def test_ineligible_instances_get_nothing(policy):
    p = RoutingPolicy(4, RouterConfig(policy=policy, threshold=64), lambda n, c: n <= 64, 1.0)
    eligible = [False, True, False, True]
    rng = random.Random(3)
    for t in range(100):
        n = rng.choice([10, 900])
        cached = [n if k == 0 else 0 for k in range(4)]  # the dead one holds the prefix
        c = p.choose(n, cached, [rng.uniform(0, 9) for _ in range(4)], t, eligible)
        assert c.instance in (1, 3)
    with pytest.raises(ValueError):
        p.choose(10, [0] * 4, [0] * 4, 0.0, [False] * 4)


# -- fast: picking and reading requests ----------------------------------------------------


def _router(n=2, policy="least-load", **kw) -> HTTPRouter:
    r = HTTPRouter([f"http://127.0.0.1:{9000 + k}" for k in range(n)],
                   RouterConfig(policy=policy), **kw)
    for inst in r.instances:
        inst.mark_ok(parse_metrics(METRICS.replace("342", "0")), 0.0)
    return r


def test_pick_follows_the_cached_history_and_counts_load():
    r = _router()
    history = list(range(200, 264))
    r.instances[1].blocks.add(history)
    k, new = r.pick(Estimate(history + [5, 6, 7], 67, False), set())
    assert k == 1 and new == 67 - 64
    # without history: least load, counted from the reports plus what was sent since
    r.instances[0].load.report(500, 0.0)
    r.instances[1].load.report(0, 0.0)
    r.instances[1].load.sent(600, time.monotonic())
    assert r.pick(Estimate(None, 10, False), set()) == (0, 10)
    assert r.pick(Estimate(None, 10, False), {0}) == (1, 10)


def test_pick_answers_503_when_no_instance_can_take_it():
    r = _router(max_inflight=1)
    r.instances[0].mark_down("test")
    assert r.pick(Estimate(None, 10, False), set())[0] == 1
    r.instances[1].inflight.add(object())  # at its limit
    with pytest.raises(APIError) as e:
        r.pick(Estimate(None, 10, False), set())
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    r.instances[1].mark_unavailable("draining")
    with pytest.raises(APIError) as e:
        r.pick(Estimate(None, 10, False), set())
    assert "all 2 instances are unavailable" in e.value.message


def test_mark_down_ends_inflight_and_forgets_cache_and_load():
    async def go():
        r = _router()
        inst = r.instances[0]
        fut = asyncio.get_running_loop().create_future()
        inst.inflight.add(fut)
        inst.blocks.add(list(range(40)))
        inst.load.sent(99, time.monotonic())
        inst.mark_down("gone")
        assert fut.done() and len(inst.blocks) == 0 and inst.load.load == 0
        assert not inst.healthy and r.status()["instances"][0]["state"] == "down"
    asyncio.run(go())


def test_estimate_reads_prompts():
    assert estimate(b'{"prompt": [1, 2, 3]}', "completion", None, 512).ids == [1, 2, 3]
    assert estimate(b'{"prompt": [[4, 5]], "stream": true}', "completion", None, 512).stream
    e = estimate(b'{"prompt": "' + b"x" * 400 + b'"}', "completion", None, 512)
    assert e.ids is None and e.tokens == 101
    e = estimate(json.dumps({"messages": [{"role": "user", "content": "y" * 80}]}).encode(),
                 "chat", None, 512)
    assert e.ids is None and e.tokens == 21
    # what the instance refuses, it answers itself (the request goes through unjudged)
    assert estimate(b'{"prompt": {"a": 1}}', "completion", None, 512).tokens == 0
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b'{"prompt": NaN}'):
        with pytest.raises(APIError) as e:
            estimate(raw, "completion", None, 512)
        assert e.value.status == 400
