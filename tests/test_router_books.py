"""The network router's bookkeeping, without processes: its load book, the block index hashed
as the engine hashes its prefix cache, and the reading of an instance's /metrics."""

from __future__ import annotations

import random

import pytest

from laps_jax.cluster.upstream import (BlockIndex, LoadBook, cached_prefixes, parse_metrics,
                                       prompt_hashes)
from laps_jax.engine.kv_cache import KVCacheManager
from router_utils import METRICS


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


def test_load_book_drops_a_prefill_when_its_first_token_is_back():
    """Own work counts from sending to first token, with no poll between; the report adds
    only work the router did not send, and caps the router's older open work."""
    b = LoadBook()
    a, c = b.sent(300, now=1.0), b.sent(40, now=1.1, short=True)
    assert b.load == 340 and b.short_load == 40
    b.prefilled(a, now=1.2)  # its first token came back: at once, not at the next poll
    assert b.load == 40 and b.short_load == 40
    # a poll begun at 1.15 (the 300 still open then): 900 reported, 250 of it short,
    # so 900 - 340 = 560 are another client's, 210 of them short
    b.report(900, poll_started=1.15, pending_short=250)
    assert b.foreign == 560 and b.foreign_short == 210
    assert b.load == 40 + 560 and b.short_load == 40 + 210
    b.prefilled(c, now=1.3)
    assert b.load == 560
    # the instance did an open request's prefill before its token reached the router (a
    # non-streamed answer): the next report holds less than the router's own open work
    d = b.sent(500, now=2.0)
    b.report(100, poll_started=2.5)
    assert b.load == 100 and b.foreign == 0
    b.prefilled(d, now=3.0)
    b.prefilled(d, now=3.1)  # twice (the proxy's finally): nothing more happens
    assert b.load == 0
    b.sent(5, 10.0)
    b.clear()
    assert b.load == 0


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



def test_parse_metrics():
    r = parse_metrics(METRICS)
    assert (r.pending_tokens, r.block_size, r.num_blocks) == (342.0, 8, 1024)
    assert (r.waiting, r.running, r.kv_usage, r.pages_used) == (2.0, 1.0, 0.25, 5.0)
    empty = parse_metrics("# nothing\n")
    assert empty.pending_tokens is None and empty.block_size is None


def _reference_report(text: str) -> tuple:
    """parse_metrics' fields read with prometheus_client's own parser (the reference)."""
    from prometheus_client.parser import text_string_to_metric_families
    got = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "laps_pending_prefill_tokens":
                got["pending"] = got.get("pending", 0.0) + s.value
                if s.labels.get("pool") == "short":
                    got["short"] = got.get("short", 0.0) + s.value
            elif s.name == "vllm:cache_config_info":
                got["layout"] = (int(s.labels["block_size"]), int(s.labels["num_gpu_blocks"]))
            elif s.name in ("vllm:num_requests_waiting", "laps_short_threshold_tokens",
                            "laps_long_chunk_tokens"):
                got[s.name] = s.value
    return (got.get("pending"), got.get("short"), got.get("layout"),
            got.get("vllm:num_requests_waiting"), got.get("laps_short_threshold_tokens"),
            got.get("laps_long_chunk_tokens"))


def test_parse_metrics_agrees_with_prometheus_client_on_rendered_text():
    """Random registries rendered by prometheus_client (other metrics with quotes, commas,
    braces and newlines in their labels, histograms, counters) read the same as its parser."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    rng = random.Random(7)
    for _ in range(20):
        reg = CollectorRegistry()
        pools = rng.sample(["admission", "short", "long", 'we"ird}, pool="short"\\n'],
                           rng.randint(1, 4))
        pend = Gauge("laps_pending_prefill_tokens", "x", ["pool"], registry=reg)
        for p in pools:
            pend.labels(p).set(rng.randint(0, 10_000))
        Gauge("vllm:cache_config_info", "x", ["block_size", "num_gpu_blocks"], registry=reg
              ).labels(str(rng.choice([8, 16, 32])), str(rng.randint(1, 99_999))).set(1)
        Gauge("vllm:num_requests_waiting", "x", registry=reg).set(rng.randint(0, 50))
        Gauge("laps_short_threshold_tokens", "x", registry=reg).set(rng.randint(1, 4096))
        if rng.random() < 0.7:
            Gauge("laps_long_chunk_tokens", "x", registry=reg).set(rng.randint(16, 4096))
        odd = Counter("laps_requests", "x", ["endpoint", "status"], registry=reg)
        odd.labels('/v1/"x"}, pool="short"', "a\\b\nc").inc(rng.randint(1, 9))
        h = Histogram("laps_ttft_seconds", "x", ["pool"], registry=reg)
        h.labels("short").observe(rng.random())
        text = generate_latest(reg).decode()
        r = parse_metrics(text)
        layout = (r.block_size, r.num_blocks)
        assert (r.pending_tokens, r.pending_short, layout, r.waiting,
                r.threshold, r.long_chunk) == _reference_report(text)
    with pytest.raises(ValueError):
        parse_metrics("<html>not metrics</html>\n")
    with pytest.raises(ValueError):
        parse_metrics('vllm:cache_config_info{block_size="8" 1.0\n')


@pytest.mark.parametrize("line, named", [
    ("laps_long_chunk_tokens +Inf", "laps_long_chunk_tokens"),
    ("laps_long_chunk_tokens 0", "laps_long_chunk_tokens"),
    ("laps_short_threshold_tokens -5", "laps_short_threshold_tokens"),
    ("laps_short_threshold_tokens 1e30", "laps_short_threshold_tokens"),
    ('laps_pending_prefill_tokens{pool="short"} NaN', "laps_pending_prefill_tokens"),
    ("laps_pending_prefill_tokens -1", "laps_pending_prefill_tokens"),
    ("vllm:num_requests_waiting 1e300", "vllm:num_requests_waiting"),
])
def test_a_forged_report_is_refused_naming_the_metric(line, named):
    # a peer's numbers are input: one the router would misread (a negative or infinite load,
    # a zero chunk that makes every instance look far behind) is refused, not routed on
    with pytest.raises(ValueError, match=named):
        parse_metrics(METRICS + line + "\n")


def test_a_block_layout_out_of_range_is_left_unknown():
    for labels in ('block_size="0",num_gpu_blocks="10"', 'block_size="-8",num_gpu_blocks="10"',
                   'block_size="x",num_gpu_blocks="10"', 'num_gpu_blocks="10"'):
        r = parse_metrics(f"vllm:cache_config_info{{{labels}}} 1.0\n")
        assert (r.block_size, r.num_blocks) == (None, None), labels
    r = parse_metrics('vllm:cache_config_info{block_size="16",num_gpu_blocks="-1"} 1.0\n')
    assert (r.block_size, r.num_blocks) == (16, None)


def test_a_forged_report_marks_that_instance_down_and_polling_goes_on():
    """Through the poller: an instance whose /metrics says +Inf is down, with no report kept;
    the next honest report brings it back (the poll loop survived)."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from laps_jax.cluster.instances import Instance, poll_once

    body = {"metrics": METRICS + "laps_long_chunk_tokens +Inf\n"}

    async def go():
        async def health(request):
            return web.json_response({"status": "ok"})

        async def metrics(request):
            return web.Response(text=body["metrics"])

        async def models(request):
            return web.json_response({"data": []})

        app = web.Application()
        for path, handler in (("/health", health), ("/metrics", metrics), ("/v1/models", models)):
            app.router.add_get(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        inst = Instance(f"http://127.0.0.1:{port}")
        seen = []
        try:
            async with aiohttp.ClientSession() as http:
                await poll_once(inst, http, timeout=1.0)
                seen.append((inst.state, inst.report))
                body["metrics"] = METRICS
                await poll_once(inst, http, timeout=1.0)
                seen.append((inst.state, inst.report.pending_tokens))
        finally:
            await runner.cleanup()
        return seen, inst

    seen, inst = asyncio.run(go())
    assert seen[0] == ("down", None)
    assert seen[1] == ("ok", 342.0)


def test_the_routers_block_hashes_are_the_engines():
    """`prompt_hashes` (the tokens turned to bytes once) gives the hashes the engine registers
    for the same prompt's full pages, over the whole id range, and stops at `limit`."""
    rng = random.Random(11)
    for page in (1, 4, 16):
        ids = [rng.randrange(1 << 31) for _ in range(rng.randrange(page, 40 * page))]
        kv = KVCacheManager(num_pages=64, page_size=page)
        seq = kv.allocate(ids)
        kv.commit(seq, ids)
        assert prompt_hashes(ids, page) == seq.hashes and len(seq.hashes) == len(ids) // page
        assert prompt_hashes(ids, page, limit=3) == seq.hashes[:3]


def test_a_prompts_kept_block_hashes_find_the_same_prefixes_as_hashing_it_again():
    """The router hashes a prompt once (`Estimate.block_hashes`) and looks it up when held, when
    placed and when remembered: the same cached prefixes as hashing it at each lookup."""
    from laps_jax.cluster.http_router import Estimate
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 300))]
        indexes = [BlockIndex(rng.choice([4, 16])) for _ in range(3)]
        for ix in indexes:
            for _ in range(3):
                ix.add([rng.randrange(4) for _ in range(rng.randrange(1, 300))])
            ix.add(ids[:rng.randrange(0, len(ids) + 1)])
        est = Estimate(ids, len(ids), True)
        assert cached_prefixes(ids, indexes, est.block_hashes) == cached_prefixes(ids, indexes)
        kept = BlockIndex(16)
        kept.add_hashes(est.block_hashes(16))
        assert cached_prefixes(ids, [kept]) == [(len(ids) - 1) // 16 * 16]
