"""The network router (scripts/router.py, laps_jax/cluster/http_router.py).

Fast tests: its bookkeeping without processes (load, block index hashed as the engine hashes,
metrics parsing, the policy's eligible mask, picking). Slow tests: two real serve.py processes
of a tiny checkpoint behind the router in this process, on loopback."""

from __future__ import annotations

import asyncio
import json
import math
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


def _cli_router(*flags: str, n: int = 2) -> HTTPRouter:
    """A router as `scripts/router.py` makes it from `flags`, its instances idle and healthy."""
    from laps_jax.cluster.router_cli import build_parser, make_router
    urls = [a for k in range(n) for a in ("--instance", f"http://127.0.0.1:{9000 + k}")]
    r = make_router(build_parser().parse_args(urls + list(flags)))
    for inst in r.instances:
        inst.mark_ok(parse_metrics(METRICS.replace("342", "0")), 0.0)
    return r


def _refused(flag: str, values) -> None:
    """router.py refuses each value of `flag`, naming the flag."""
    from laps_jax.cluster.router_cli import build_parser, make_router
    for bad in values:
        args = build_parser().parse_args(["--instance", "http://127.0.0.1:9000", flag, bad])
        with pytest.raises(ValueError, match=flag):
            make_router(args)


def test_laps_sends_a_request_away_from_an_instance_its_streams_decode_on():
    loop = asyncio.new_event_loop()
    try:
        for step, want in ((None, 1), (300.0, 1), (0.0, 0)):  # (0: the default, not counted)
            r = _router(2, "laps", decode_step_tokens=step)
            inst = r.instances[0]
            ticket = inst.load.sent(40, 0.0, True)
            inst.inflight.add(loop.create_future())  # the relay holds it while streaming
            assert inst.decoding == 0  # still waiting for its first token
            inst.load.prefilled(ticket, 0.1)
            assert inst.decoding == 1 and r.status()["instances"][0]["decoding"] == 1
            # both idle in prefill: the decoding one costs a decode step (unless 0)
            assert r.pick(Estimate(list(range(30)), 30, True), set())[0] == want
    finally:
        loop.close()


def test_laps_counts_each_decoding_sequence_when_asked():
    loop = asyncio.new_event_loop()
    try:
        rng = random.Random(7)
        for _ in range(5):
            few, many = rng.randint(1, 3), rng.randint(4, 8)
            busy = rng.randrange(2)  # the instance with more sequences decoding
            for per_seq, want in ((25.0, 1 - busy), (0.0, None)):
                r = _router(2, "laps", decode_step_tokens=64.0, decode_seq_tokens=per_seq)
                for k, n in ((busy, many), (1 - busy, few)):
                    inst = r.instances[k]
                    for _ in range(n):
                        inst.load.prefilled(inst.load.sent(40, 0.0, True), 0.1)
                        inst.inflight.add(loop.create_future())
                    assert inst.decoding == n
                got = {r.pick(Estimate(None, 30, False), set())[0] for _ in range(4)}
                # counted: always the one with fewer; not: both decode, a tie taken in turn
                assert got == ({want} if want is not None else {0, 1})
    finally:
        loop.close()
    _refused("--decode-seq-tokens", ("-1", "inf", "nan"))


def test_pace_means_and_relative_speeds_by_hand():
    """The exponential mean of TTFT per token ahead (+ the overhead), and the factors around 1
    that pull back to 1 as a pace ages, against numbers made here from random samples."""
    from laps_jax.cluster.pace import CLIP, OVERHEAD_TOKENS, Pace, relative_speeds
    rng = random.Random(11)
    for _ in range(20):
        w = rng.uniform(0.1, 1.0)
        paces, want = [Pace(w), Pace(w), Pace(w)], []
        for p in paces[:2]:
            m = None
            for _ in range(rng.randint(1, 6)):
                sec, ahead, new = rng.uniform(0.01, 0.5), rng.uniform(0, 900), rng.randint(1, 600)
                x = sec / (ahead + new + OVERHEAD_TOKENS)
                m = x if m is None else (1 - w) * m + w * x
                p.observe(sec, ahead, new, now=10.0)
            assert p.value == pytest.approx(m)
            want.append(m)
        mean = sum(want) / 2
        got = relative_speeds(paces, now=10.0)  # fresh: no pull toward 1; the third unknown
        clip = lambda f: min(max(f, CLIP[0]), CLIP[1])  # noqa: E731
        assert got == pytest.approx([clip(want[0] / mean), clip(want[1] / mean), 1.0])
        aged = relative_speeds(paces, now=10.0 + 2.0, forget_s=2.0)
        assert aged[0] == pytest.approx(clip(1 + (want[0] / mean - 1) / math.e))
    one = [Pace(0.5), Pace(0.5)]
    one[0].observe(0.2, 0, 10, 1.0)
    one[0].observe(float("nan"), 0, 10, 1.0)  # ignored
    assert relative_speeds(one, 1.0) == [1.0, 1.0]  # one pace alone says nothing
    with pytest.raises(ValueError, match="pace weight"):
        Pace(0.0)


def test_laps_with_pace_leans_away_from_the_instance_slow_of_late():
    """router.py's default laps weighs pace (cluster/pace.py); `--pace-weight 0` does not."""
    from laps_jax.cluster.pace import OVERHEAD_TOKENS, relative_speeds
    rng = random.Random(5)
    for _ in range(5):
        slow = rng.randrange(2)
        for make, want in ((lambda: _router(2, "laps", pace_weight=0.5), {1 - slow}),
                           (lambda: _cli_router(), {1 - slow}),
                           (lambda: _cli_router("--pace-weight", "0"), {0, 1}),
                           (lambda: _router(2, "laps", pace_weight=0.0), {0, 1})):
            r = make()
            for k in range(2):
                inst = r.instances[k]
                t0 = time.monotonic()
                ticket = inst.load.sent(100, t0, True)
                # its first token back: the slow one took 3-5x as long for the same work
                sec = rng.uniform(0.05, 0.1) * (rng.uniform(3, 5) if k == slow else 1)
                if inst.pace is not None:
                    inst.pace.observe(sec, 0.0, 100, time.monotonic())
                inst.load.prefilled(ticket, t0 + sec)
            # both idle, alike in load: the slow one is avoided when paces are weighed,
            # else a tie taken in turn
            got = {r.pick(Estimate(None, 30, False), set())[0] for _ in range(4)}
            assert got == want
    # /router/status shows what laps believes: the slow one's pace and its factor over 1
    r = _cli_router()
    r.instances[0].pace.observe(0.5, 0.0, 100, time.monotonic())
    r.instances[1].pace.observe(0.1, 0.0, 100, time.monotonic())
    shown = r.status()["instances"]
    per_token = [0.5 / (100 + OVERHEAD_TOKENS) * 1e3, 0.1 / (100 + OVERHEAD_TOKENS) * 1e3]
    assert [i["pace_ms_per_token"] for i in shown] == pytest.approx(per_token, rel=1e-3)
    assert shown[0]["relative_speed"] > 1 > shown[1]["relative_speed"]
    assert "pace_ms_per_token" not in _cli_router("--pace-weight", "0").status()["instances"][0]
    # an instance Ray restarted at a new address is measured afresh, and picking goes on
    r.replace_instance(0, "http://127.0.0.1:9005/")
    assert r.instances[0].url == "http://127.0.0.1:9005" and r.instances[0].pace.value is None
    r.instances[0].mark_ok(parse_metrics(METRICS.replace("342", "0")), 0.0)
    assert r.pick(Estimate(None, 30, False), set())[0] in (0, 1)
    assert relative_speeds([None, r.instances[1].pace], time.monotonic()) == [1.0, 1.0]
    _refused("--pace-weight", ("-0.5", "1.5", "nan"))


def test_router_py_pace_forget_time_sets_how_fast_an_unrefreshed_pace_fades():
    """`--pace-forget-s F`: a pace last measured `age` s ago counts for exp(-age / F) of its
    difference from the others (the default 2 s, as pace.FORGET_S); numbers made here."""
    rng = random.Random(11)
    for flags, forget in (((), 2.0), (("--pace-forget-s", "6"), 6.0),
                          (("--pace-forget-s", "0.5"), 0.5)):
        r = _cli_router(*flags)
        now = time.monotonic()
        secs = [rng.uniform(0.2, 0.6), rng.uniform(0.05, 0.15)]  # instance 0 the slower
        age = rng.uniform(0.5, 3.0)
        for inst, sec in zip(r.instances, secs):
            inst.pace.observe(sec, 0.0, 100, now - age)
        mean = sum(secs) / 2
        want = [min(max(1 + (s / mean - 1) * math.exp(-age / forget), 0.5), 2.0) for s in secs]
        assert r.speeds() == pytest.approx(want, rel=1e-2)
        assert [i["relative_speed"] for i in r.status()["instances"]] == \
            pytest.approx(want, abs=2e-3)
    _refused("--pace-forget-s", ("-1", "inf", "nan"))


def test_pick_follows_the_cached_history_and_counts_load():
    r = _router()
    history = list(range(200, 264))
    r.instances[1].blocks.add(history)
    k, new, _ = r.pick(Estimate(history + [5, 6, 7], 67, False), set())
    assert k == 1 and new == 67 - 64
    # without history: least load, counted from the reports plus what was sent since
    r.instances[0].load.report(500, 0.0)
    r.instances[1].load.report(0, 0.0)
    r.instances[1].load.sent(600, time.monotonic())
    assert r.pick(Estimate(None, 10, False), set()) == (0, 10, True)
    assert r.pick(Estimate(None, 10, False), {0}) == (1, 10, True)


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


def test_a_timed_out_poll_is_slow_until_the_instance_has_been_silent_dead_s(caplog):
    """An instance that does not answer a poll in time is dead only once nothing has come
    from it (poll answers, bytes of answers) for DEAD_S: a stalled instance keeps its streams
    and its cache; a slow one's polls wait only until it would count as dead."""
    import logging

    import aiohttp

    from laps_jax.cluster.instances import DEAD_S, Instance, poll_once

    async def go():
        hold = asyncio.Event()

        async def silent(reader, writer):  # accepts, never answers (a SIGSTOPped process)
            await hold.wait()
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
        inst = Instance(url)
        inst.mark_ok(parse_metrics(METRICS), 0.0)
        inst.blocks.add(list(range(32)))  # 4 blocks of 8
        fut = asyncio.get_running_loop().create_future()
        inst.inflight.add(fut)
        states = []
        try:
            async with aiohttp.ClientSession() as http:
                inst.last_data = time.monotonic()  # a stream chunk just came back
                await poll_once(inst, http, timeout=0.2)
                states.append((inst.state, fut.done(), len(inst.blocks)))
                inst.last_ok = None  # no stream either: the last poll answered long ago
                inst.last_data = time.monotonic() - 1.0
                await poll_once(inst, http, timeout=0.2)  # silent 1.2 s: still slow
                states.append((inst.state, fut.done(), len(inst.blocks)))
                inst.last_data = time.monotonic() - (DEAD_S - 0.08)
                t0 = time.monotonic()
                await poll_once(inst, http, timeout=0.6)  # waits 0.08 s, not 0.6
                waited = time.monotonic() - t0
                states.append((inst.state, fut.done(), len(inst.blocks)))
        finally:
            hold.set()
            server.close()
        return states, waited

    assert DEAD_S < 2.0  # #24: a hung instance's requests end within 2 s
    with caplog.at_level(logging.INFO, logger="laps_jax.router"):
        states, waited = asyncio.run(go())
    assert states == [("slow", False, 4), ("slow", False, 4), ("down", True, 0)]
    assert 0.07 <= waited < 0.4, waited
    said = [r.getMessage() for r in caplog.records if r.name == "laps_jax.router"]
    assert any(": slow (no answer to its health check in 0.2 s; last sign of life" in m
               for m in said), said
    assert any(": down (silent for " in m and "no answer to its health checks" in m
               for m in said), said


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


def test_tokenizer_builtin_is_serve_py_s_default_model():
    """`--tokenizer builtin` (serve.py's default --model) tokenizes as that model does."""
    from laps_jax.cluster.router_cli import build_parser, make_router
    from laps_jax.config import builtin_model_dir
    from laps_jax.text.tokenizer import Tokenizer
    r = make_router(build_parser().parse_args(["--instance", "http://127.0.0.1:9000",
                                               "--tokenizer", "builtin"]))
    text = "Ünïcode and spaces   then code: def f(x): return x"
    want = Tokenizer(builtin_model_dir()).encode(text)
    got = estimate(json.dumps({"prompt": text}).encode(), "completion", r.tokenizer, 2048)
    assert got.ids == want and got.tokens == len(want) != len(text) // 4


def test_no_affinity_makes_round_robin_plain_data_parallelism():
    history = list(range(300, 364))
    picks = {}
    for flags in ([], ["--no-affinity"]):
        r = _cli_router("--policy", "round-robin", *flags)
        r.instances[0].blocks.add(history)
        picks[bool(flags)] = [r.pick(Estimate(history + [k], 65, False), set())[0]
                              for k in range(4)]
    assert picks[False] == [0, 0, 0, 0]  # every turn follows its cached history
    assert picks[True] == [0, 1, 0, 1]   # plain rotation
    with pytest.raises(ValueError, match="--no-affinity applies to"):
        _cli_router("--no-affinity")  # laps (default)


def test_the_cli_answers_503_while_no_instance_is_up_and_stops_on_sigterm():
    """scripts/router.py as a process, in front of a port nobody listens on."""
    import os
    import signal
    import subprocess
    import sys

    from laps_jax.workload.http_compare import free_port
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port, dead = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(root, "scripts", "router.py"),
                             "--instance", f"http://127.0.0.1:{dead}", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                raise AssertionError("healthy with no instance up")
            except urllib.error.HTTPError as e:
                assert e.code == 503 and json.loads(e.read())["healthy_instances"] == 0
                break
            except urllib.error.URLError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
                time.sleep(0.2)
        status, body, headers = post(url, "/v1/completions", {"prompt": [1, 2]})
        assert status == 503 and body["error"]["code"] == "unavailable"
        assert headers["Retry-After"] == "1"
        with urllib.request.urlopen(url + "/router/status", timeout=5) as r:
            st = json.loads(r.read())
        assert st["policy"] == "laps" and st["instances"][0]["state"] == "down"
        assert st["instances"][0]["group"] == "short"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


# -- slow: two real serve.py instances behind the router -----------------------------------

from conftest import SERVED_MODEL as MODEL  # noqa: E402 (the `cluster` fixture serves it)
WORDS = ("apple river stone cloud seven orange quiet laptop mountain signal garden window "
         "yellow engine pocket silver").split()


class RouterThread:
    """The router app in this process, on its own event-loop thread, on a free port."""

    def __init__(self, urls, policy="round-robin", tokenizer=None, api_key=None,
                 config: RouterConfig | None = None, **kw):
        from laps_jax.cluster.http_router import create_router_app
        from laps_jax.server.http_runner import make_runner
        self.router = HTTPRouter(urls, config or RouterConfig(policy=policy),
                                 tokenizer=tokenizer, **kw)
        self.app = create_router_app(self.router, api_key)
        self.runner = make_runner(self.app, 30.0, access_log=None, handler_cancellation=True)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start())

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        from aiohttp import web
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def status(self) -> dict:
        with urllib.request.urlopen(self.url + "/router/status", timeout=10) as r:
            return json.loads(r.read())

    def wait(self, pred, timeout: float = 30.0, what: str = "") -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.status()
            if pred(s):
                return s
            time.sleep(0.1)
        raise AssertionError(f"router status never showed {what}: {self.status()}")

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def post(url: str, path: str, body=None, raw: bytes | None = None, headers=None,
         timeout: float = 120):
    """(status, JSON body, headers)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def sse(url: str, path: str, body: dict, stop_after: int | None = None, on_line=None):
    """The `data:` payloads of a stream (JSON decoded, "[DONE]" as is); `stop_after` lines
    then the client goes away; `on_line(i, payload)` after each."""
    import aiohttp

    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            async with s.post(url + path, json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    out.append(data.decode() if data == b"[DONE]" else json.loads(data))
                    if on_line is not None:
                        on_line(len(out), out[-1])
                    if stop_after is not None and len(out) >= stop_after:
                        break
        return out
    return asyncio.run(go())


def stream_text(events, kind: str) -> str:
    if kind == "completion":
        return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)
                       and e.get("choices"))
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def pages_used(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode()).pages_used


@pytest.fixture(scope="module")
def routed(cluster):
    from laps_jax.text.tokenizer import Tokenizer
    path, procs = cluster
    r = RouterThread([p.url for p in procs], "round-robin", Tokenizer(path))
    r.wait(lambda s: s["healthy"] == 2, what="both instances healthy")
    yield r
    r.close()


@pytest.mark.slow
def test_greedy_output_through_the_router_equals_an_instance(cluster, routed):
    _, procs = cluster
    cases = [("/v1/completions", "completion",
              {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 20}),
             ("/v1/completions", "completion", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 12}),
             ("/v1/chat/completions", "chat",
              {"messages": [{"role": "user", "content": "Grüße 😀 hello"}], "max_tokens": 16})]
    for path, kind, body in cases:
        body = dict(body, temperature=0)
        status, direct, _ = post(procs[0].url, path, body)
        assert status == 200
        want = direct["choices"][0]["text" if kind == "completion" else "message"]
        want = want if kind == "completion" else want["content"]
        for _ in range(2):  # round-robin: once on each instance
            status, got, _ = post(routed.url, path, body)
            assert status == 200, got
            text = got["choices"][0]["text"] if kind == "completion" else \
                got["choices"][0]["message"]["content"]
            assert text == want
            assert got["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
            events = sse(routed.url, path, dict(body, stream=True,
                                                stream_options={"include_usage": True}))
            assert events[-1] == "[DONE]" and stream_text(events, kind) == want
            assert events[-2]["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    st = routed.status()
    assert all(i["routed"] >= 6 and i["healthy"] for i in st["instances"])
    with urllib.request.urlopen(routed.url + "/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [MODEL]
    with urllib.request.urlopen(routed.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'laps_router_instance_healthy{instance="%s"} 1.0' % procs[0].url in text
    assert "\nlaps_event_loop_stalls_total " in text  # the router's own loop watch


@pytest.mark.slow
def test_a_follow_up_turn_lands_where_its_history_is(routed):
    rng = random.Random(11)
    convs = [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]
             for _ in range(3)]

    def where(before, after):
        moved = [k for k in range(2) if after["instances"][k]["routed"] >
                 before["instances"][k]["routed"]]
        assert len(moved) == 1
        return moved[0]

    first = []
    for msgs in convs:  # round-robin spreads them: 0, 1, 0 (or 1, 0, 1)
        before = routed.status()
        _, r, _ = post(routed.url, "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 6, "temperature": 0})
        msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        msgs.append({"role": "user", "content": "and then?"})
        first.append((where(before, routed.status()), r["usage"]["prompt_tokens"]))
    assert {k for k, _ in first} == {0, 1}
    for msgs, (k, prompt1) in zip(reversed(convs), reversed(first)):
        before = routed.status()
        _, r, _ = post(routed.url, "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 4, "temperature": 0})
        assert where(before, routed.status()) == k
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt1 // 8 * 8
    assert routed.status()["by_affinity"] >= 3


@pytest.mark.slow
def test_laps_sends_short_and_long_work_to_their_groups(cluster):
    _, procs = cluster
    r = RouterThread([p.url for p in procs], "length-aware", threshold=32)
    try:
        st = r.wait(lambda s: s["healthy"] == 2, what="both healthy")
        assert [i["group"] for i in st["instances"]] == ["short", "long"]
        rng = random.Random(5)
        for n, k in ((10, 0), (100, 1), (20, 0), (200, 1)):  # (no shared prefixes)
            before = r.status()["instances"][k]["routed"]
            status, body, _ = post(r.url, "/v1/completions", {
                "prompt": [rng.randrange(3, 1000) for _ in range(n)], "max_tokens": 2})
            assert status == 200, body
            assert r.status()["instances"][k]["routed"] == before + 1
    finally:
        r.close()


@pytest.mark.slow
def test_a_skewed_burst_moves_an_instance_to_the_long_group_and_back(cluster):
    """laps with its groups on fast settings. Each group keeps one instance, so two instances
    could never move: the router gets three entries, the third a second route to instance 0
    (its load is reported twice, which the policy tolerates). Long prompts only: the short
    share of the compute falls to ~0 and one short entry joins the long group; a pause (the
    long work decays over tau) and then short prompts only: one long entry comes back."""
    from laps_jax.cluster.groups import GroupSettings
    _, procs = cluster
    fast = GroupSettings(share_tau_s=0.5, hysteresis=0.0, dwell_s=0.3, move_interval_s=0.2)
    r = RouterThread([procs[0].url, procs[1].url, procs[0].url], threshold=32,
                     config=RouterConfig(policy="laps", groups=fast))
    rng = random.Random(9)

    def burst(n_tokens: int, count: int) -> None:
        for _ in range(count):
            status, body, _ = post(r.url, "/v1/completions", {
                "prompt": [rng.randrange(3, 1000) for _ in range(n_tokens)], "max_tokens": 1})
            assert status == 200, body
            time.sleep(0.05)

    def sizes() -> tuple[int, int]:
        groups = [i["group"] for i in r.status()["instances"]]
        return groups.count("short"), groups.count("long")
    try:
        r.wait(lambda s: s["healthy"] == 3, what="three healthy entries")
        assert sizes() == (2, 1)
        burst(120, 8)
        st = r.status()
        assert sizes() == (1, 2) and st["moves"] == 1, st
        time.sleep(2.5)  # the long work decays (e^-5) and the dwell passes
        burst(8, 10)
        st = r.status()
        assert sizes() == (2, 1) and st["moves"] == 2, st
        assert [g[1:] for g in st["group_sizes"][-2:]] == [[1, 2], [2, 1]]
    finally:
        r.close()


@pytest.mark.slow
def test_aborted_requests_free_the_instance_pages(cluster, routed):
    _, procs = cluster
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    for _ in range(2):  # one on each instance
        events = sse(routed.url, "/v1/completions", body, stop_after=3)
        assert len(events) == 3
    import socket  # a non-streaming request whose client leaves before the answer
    with socket.create_connection(("127.0.0.1", int(routed.url.rsplit(":", 1)[1]))) as s:
        raw = json.dumps(dict(body, stream=False)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
        routed.wait(lambda st: sum(i["inflight"] for i in st["instances"]) == 1, 10,
                    "the request in flight")
    deadline = time.time() + 20
    while time.time() < deadline and any(pages_used(p.url) for p in procs):
        time.sleep(0.2)
    assert [pages_used(p.url) for p in procs] == [0, 0]
    routed.wait(lambda st: sum(i["inflight"] for i in st["instances"]) == 0, 5, "nothing in flight")


HOSTILE = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e999}'),
    ("/v1/completions", b"\xff\xfe\x00"),
    ("/v1/completions", b'{"prompt": 5}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "x"}'),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 9}'),
    ("/v1/completions", b'{"prompt": [1, -4]}'),
    ("/v1/completions", b'{"model": "nope", "prompt": "hi"}'),
    ("/v1/chat/completions", b'{"messages": "x"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}'),
]


@pytest.mark.slow
def test_hostile_requests_get_the_json_errors_serve_py_gives(cluster, routed):
    _, procs = cluster
    for path, raw in HOSTILE:
        direct = post(procs[0].url, path, raw=raw)
        got = post(routed.url, path, raw=raw)
        assert 400 <= got[0] < 500 and (got[0], got[1]) == (direct[0], direct[1]), raw
    status, body, _ = post(routed.url, "/v1/completions", raw=b'{"prompt": "' + b"a" * (5 << 20)
                           + b'"}')
    assert status == 413 and body["error"]["code"] == "request_too_large"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(routed.url + "/v1/nothing", timeout=10)
    assert e.value.code == 404 and "error" in json.loads(e.value.read())
    keyed = RouterThread([p.url for p in procs], api_key="sesame")
    try:
        keyed.wait(lambda s: s["healthy"] == 2)
        status, body, _ = post(keyed.url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body, _ = post(keyed.url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1},
                               headers={"Authorization": "Bearer sesame"})
        assert status == 200, body
    finally:
        keyed.close()


@pytest.mark.slow
def test_a_hung_instance_leaves_within_2_s_and_its_requests_get_502(cluster, routed):
    import signal
    _, procs = cluster
    victim = procs[1]
    result = {}

    def slow_request(token: int):
        result["r"] = post(routed.url, "/v1/completions",
                           {"prompt": [token] * 20, "max_tokens": 400, "temperature": 0})
        result["t"] = time.time()

    # round-robin: send until one is in flight on the victim (a new prompt each time: a
    # repeated one would follow its cached history back to the same instance)
    t = None
    for attempt in range(2):
        t = threading.Thread(target=slow_request, args=(7 + attempt,))
        t.start()
        st = routed.wait(lambda s: sum(i["inflight"] for i in s["instances"]) == 1, 10)
        if st["instances"][1]["inflight"]:
            break
        t.join(120)
    victim.proc.send_signal(signal.SIGSTOP)
    stopped = time.time()
    try:
        t.join(10)
        assert not t.is_alive()
        status, body, _ = result["r"]
        assert status == 502 and body["error"]["code"] == "upstream_failed", body
        assert result["t"] - stopped < 2.0
        st = routed.status()
        assert st["instances"][1]["state"] == "down" and st["healthy"] == 1
        for _ in range(3):  # new requests go to the other
            assert post(routed.url, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2})[0] \
                == 200
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    routed.wait(lambda s: s["instances"][1]["healthy"], 10, "the instance back")


def _at_third_token(routed, act, record: dict):
    """An `sse` line callback: at the stream's third line, `act(k)` on the instance serving
    it, and `record` gets k and the time."""
    def on_line(i, _payload):
        if i == 2:
            st = routed.status()
            k = next(k for k, inst in enumerate(st["instances"]) if inst["inflight"])
            act(k)
            record.update(k=k, t=time.time())
    return on_line


@pytest.mark.slow
def test_a_stream_on_a_hung_instance_gets_an_error_event_within_2_s(cluster, routed):
    """The stream's reads are not raced against the instance's health one by one: the poller
    marking the instance down must still end a stream stuck waiting for its next token."""
    import signal
    _, procs = cluster
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    stopped = {}
    hang = _at_third_token(routed, lambda k: procs[k].proc.send_signal(signal.SIGSTOP), stopped)
    try:
        events = sse(routed.url, "/v1/completions", body, on_line=hang)
        ended = time.time()
    finally:
        if stopped:
            procs[stopped["k"]].proc.send_signal(signal.SIGCONT)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "upstream_failed"
    assert "health checks" in events[-2]["error"]["message"]
    assert ended - stopped["t"] < 2.0
    routed.wait(lambda s: s["instances"][stopped["k"]]["healthy"], 10, "the instance back")


@pytest.mark.slow
def test_sigkill_mid_stream_ends_it_and_the_instance_rejoins_after_a_restart(cluster, routed):
    from server_utils import ServerProcess
    path, procs = cluster
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    killed = {}
    kill = _at_third_token(routed, lambda k: procs[k].proc.kill(), killed)
    events = sse(routed.url, "/v1/completions", body, on_line=kill)
    ended = time.time()
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "upstream_failed"
    assert ended - killed["t"] < 2.0
    k = killed["k"]
    routed.wait(lambda s: not s["instances"][k]["healthy"], 2, "the dead instance out")
    for _ in range(4):
        status, r, _ = post(routed.url, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2})
        assert status == 200, r
    assert routed.status()["instances"][k]["state"] == "down"
    procs[k].stop()
    procs[k] = ServerProcess(path, "--served-model-name", MODEL, port=procs[k].port)
    routed.wait(lambda s: s["instances"][k]["healthy"], 10, "the restarted instance back")
    before = routed.status()["instances"][k]["routed"]
    for _ in range(2):
        assert post(routed.url, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2})[0] == 200
    assert routed.status()["instances"][k]["routed"] == before + 1


def test_threshold_comes_from_the_instances_unless_given():
    from laps_jax.cluster.upstream import MetricsReport
    r = _router(2, "laps")
    assert r.threshold == 256  # nothing reported yet
    for k, t in enumerate((96, 128)):
        r.instances[k].mark_ok(MetricsReport(pending_tokens=0.0, threshold=t), 0.0)
    assert r.threshold == 96 and r.status()["threshold_from"] == "instances"
    assert r.pick(Estimate(None, 100, False), set())[2] is False  # 100 > 96: long
    assert _router(2, "laps", threshold=300).threshold == 300
    assert parse_metrics(METRICS + "laps_short_threshold_tokens 176.0\n").threshold == 176
    assert parse_metrics(METRICS).pending_short == 12.0


def test_each_instance_s_reported_long_chunk_reaches_the_policy():
    from laps_jax.cluster.upstream import MetricsReport
    r = _router(2, "laps")
    seen = {}
    real = r.policy.choose
    r.policy.choose = lambda *a, **kw: seen.update(kw) or real(*a, **kw)
    r.pick(Estimate(None, 10, False), set())
    assert seen["chunk"] == [512.0, 512.0]  # nothing reported: the router's default
    r.instances[1].mark_ok(MetricsReport(pending_tokens=0.0, long_chunk=128), 0.0)
    r.pick(Estimate(None, 10, False), set())
    assert seen["chunk"] == [512.0, 128.0]
    assert r.status()["instances"][1]["long_chunk"] == 128
    fixed = _router(2, "laps", long_chunk_tokens=300)
    fixed.instances[1].mark_ok(MetricsReport(pending_tokens=0.0, long_chunk=128), 0.0)
    assert [fixed.long_chunk(i) for i in fixed.instances] == [300.0, 300.0]
    assert parse_metrics(METRICS + "laps_long_chunk_tokens 256.0\n").long_chunk == 256
