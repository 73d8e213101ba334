"""The network router's choices, without processes: the policy's eligible mask, picking an
instance (load, cached history, decoding streams, pace, 503), instances going slow and down,
reading requests, router.py's flags, and what the instances report reaching the policy."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import urllib.error
import urllib.request

import pytest

from laps_jax.cluster.http_router import Estimate, estimate
from laps_jax.cluster.policy import RouterConfig, RoutingPolicy
from laps_jax.cluster.upstream import parse_metrics
from laps_jax.server.protocol import APIError
from router_utils import METRICS, cli_router, idle_router, post, refused

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



def test_laps_sends_a_request_away_from_an_instance_its_streams_decode_on():
    loop = asyncio.new_event_loop()
    try:
        for step, want in ((None, 1), (300.0, 1), (0.0, 0)):  # (0: the default, not counted)
            r = idle_router(2, "laps", decode_step_tokens=step)
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
                r = idle_router(2, "laps", decode_step_tokens=64.0, decode_seq_tokens=per_seq)
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
    refused("--decode-seq-tokens", ("-1", "inf", "nan"))


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
        for make, want in ((lambda: idle_router(2, "laps", pace_weight=0.5), {1 - slow}),
                           (lambda: cli_router(), {1 - slow}),
                           (lambda: cli_router("--pace-weight", "0"), {0, 1}),
                           (lambda: idle_router(2, "laps", pace_weight=0.0), {0, 1})):
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
    r = cli_router()
    r.instances[0].pace.observe(0.5, 0.0, 100, time.monotonic())
    r.instances[1].pace.observe(0.1, 0.0, 100, time.monotonic())
    shown = r.status()["instances"]
    per_token = [0.5 / (100 + OVERHEAD_TOKENS) * 1e3, 0.1 / (100 + OVERHEAD_TOKENS) * 1e3]
    assert [i["pace_ms_per_token"] for i in shown] == pytest.approx(per_token, rel=1e-3)
    assert shown[0]["relative_speed"] > 1 > shown[1]["relative_speed"]
    assert "pace_ms_per_token" not in cli_router("--pace-weight", "0").status()["instances"][0]
    # an instance Ray restarted at a new address is measured afresh, and picking goes on
    r.replace_instance(0, "http://127.0.0.1:9005/")
    assert r.instances[0].url == "http://127.0.0.1:9005" and r.instances[0].pace.value is None
    r.instances[0].mark_ok(parse_metrics(METRICS.replace("342", "0")), 0.0)
    assert r.pick(Estimate(None, 30, False), set())[0] in (0, 1)
    assert relative_speeds([None, r.instances[1].pace], time.monotonic()) == [1.0, 1.0]
    refused("--pace-weight", ("-0.5", "1.5", "nan"))


def test_router_py_pace_forget_time_sets_how_fast_an_unrefreshed_pace_fades():
    """`--pace-forget-s F`: a pace last measured `age` s ago counts for exp(-age / F) of its
    difference from the others (the default 2 s, as pace.FORGET_S); numbers made here."""
    rng = random.Random(11)
    for flags, forget in (((), 2.0), (("--pace-forget-s", "6"), 6.0),
                          (("--pace-forget-s", "0.5"), 0.5)):
        r = cli_router(*flags)
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
    refused("--pace-forget-s", ("-1", "inf", "nan"))


def test_pick_follows_the_cached_history_and_counts_load():
    r = idle_router()
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
    r = idle_router(max_inflight=1)
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
        r = idle_router()
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
        inst = Instance(url, since=time.monotonic() - 60.0)  # watched for a minute
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


def test_an_instance_that_never_answered_is_silent_since_the_router_began_watching_it(caplog):
    """A router whose first polls of a starting (or stalled) instance time out counts its
    silence from when it began watching it: slow at first, down DEAD_S after the start, and
    the log says so (it once said "silent for 1000061601.6 s" and took it down at the first
    timeout)."""
    import logging

    import aiohttp

    from laps_jax.cluster.instances import DEAD_S, Instance, poll_once

    async def go():
        hold = asyncio.Event()

        async def silent(reader, writer):
            await hold.wait()
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
        inst = Instance(url)
        states = []
        try:
            async with aiohttp.ClientSession() as http:
                await poll_once(inst, http, timeout=0.2)
                states.append(inst.state)
                inst.since = time.monotonic() - (DEAD_S - 0.05)  # watched almost DEAD_S
                await poll_once(inst, http, timeout=0.5)
                states.append(inst.state)
        finally:
            hold.set()
            server.close()
        return states

    with caplog.at_level(logging.INFO, logger="laps_jax.router"):
        states = asyncio.run(go())
    assert states == ["slow", "down"]
    said = [r.getMessage() for r in caplog.records if r.name == "laps_jax.router"]
    assert any(": slow (no answer to its health check in 0.2 s; none since the router began "
               "watching it " in m for m in said), said
    down = [m for m in said if ": down (" in m]
    assert len(down) == 1 and "never answered" in down[0], said
    silent = float(down[0].split("silent for ")[1].split(" s")[0])
    assert DEAD_S <= silent < DEAD_S + 0.5, down


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
    for bad in (b"[1, true]", b"[1, 2.0]", b"[1, -1]", b"[1, 2147483648]"):  # not token ids
        assert estimate(b'{"prompt": ' + bad + b"}", "completion", None, 512).tokens == 0
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
        r = cli_router("--policy", "round-robin", *flags)
        r.instances[0].blocks.add(history)
        picks[bool(flags)] = [r.pick(Estimate(history + [k], 65, False), set())[0]
                              for k in range(4)]
    assert picks[False] == [0, 0, 0, 0]  # every turn follows its cached history
    assert picks[True] == [0, 1, 0, 1]   # plain rotation
    with pytest.raises(ValueError, match="--no-affinity applies to"):
        cli_router("--no-affinity")  # laps (default)


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
        assert st["policy"] == "laps-inflow" and st["instances"][0]["state"] == "down"
        assert st["instances"][0]["group"] == "short"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_threshold_comes_from_the_instances_unless_given():
    from laps_jax.cluster.upstream import MetricsReport
    r = idle_router(2, "laps")
    assert r.threshold == 256  # nothing reported yet
    for k, t in enumerate((96, 128)):
        r.instances[k].mark_ok(MetricsReport(pending_tokens=0.0, threshold=t), 0.0)
    assert r.threshold == 96 and r.status()["threshold_from"] == "instances"
    assert r.pick(Estimate(None, 100, False), set())[2] is False  # 100 > 96: long
    assert idle_router(2, "laps", threshold=300).threshold == 300
    assert parse_metrics(METRICS + "laps_short_threshold_tokens 176.0\n").threshold == 176
    assert parse_metrics(METRICS).pending_short == 12.0


def test_each_instance_s_reported_long_chunk_reaches_the_policy():
    from laps_jax.cluster.upstream import MetricsReport
    r = idle_router(2, "laps")
    seen = {}
    real = r.policy.choose
    r.policy.choose = lambda *a, **kw: seen.update(kw) or real(*a, **kw)
    r.pick(Estimate(None, 10, False), set())
    assert seen["chunk"] == [512.0, 512.0]  # nothing reported: the router's default
    r.instances[1].mark_ok(MetricsReport(pending_tokens=0.0, long_chunk=128), 0.0)
    r.pick(Estimate(None, 10, False), set())
    assert seen["chunk"] == [512.0, 128.0]
    assert r.status()["instances"][1]["long_chunk"] == 128
    fixed = idle_router(2, "laps", long_chunk_tokens=300)
    fixed.instances[1].mark_ok(MetricsReport(pending_tokens=0.0, long_chunk=128), 0.0)
    assert [fixed.long_chunk(i) for i in fixed.instances] == [300.0, 300.0]
    assert parse_metrics(METRICS + "laps_long_chunk_tokens 256.0\n").long_chunk == 256


def test_router_status_sits_behind_the_api_key_health_and_metrics_do_not():
    """/router/status shows instance addresses, loads and their last errors: with --api-key it
    answers 401 (serve.py's JSON error) without the key; /health and /metrics stay open."""
    from router_utils import RouterThread
    r = RouterThread(["http://127.0.0.1:9"], api_key="sesame")  # nothing listens there
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            req = urllib.request.Request(r.url + "/router/status", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401
            assert json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
        req = urllib.request.Request(r.url + "/router/status",
                                     headers={"Authorization": "Bearer sesame"})
        with urllib.request.urlopen(req, timeout=10) as got:
            assert json.loads(got.read())["instances"][0]["url"] == "http://127.0.0.1:9"
        with urllib.request.urlopen(r.url + "/metrics", timeout=10) as got:
            assert b"laps_router_instance_healthy" in got.read()
        with pytest.raises(urllib.error.HTTPError) as e:  # no instance up: 503, not 401
            urllib.request.urlopen(r.url + "/health", timeout=10)
        assert e.value.code == 503 and "healthy_instances" in json.loads(e.value.read())
    finally:
        r.close()


def test_without_a_tokenizer_a_conversation_follows_its_text():
    """No --tokenizer: a follow-up turn (chat messages, or a completion prompt that extends the
    last) goes where its earlier turns went, by the text's block hashes, under laps (the
    default) and round-robin alike; another conversation is not pulled along."""
    from router_utils import WORDS
    rng = random.Random(3)

    def body(kind, turns):
        if kind == "chat":
            return json.dumps({"messages": turns}).encode()
        return json.dumps({"prompt": "".join(t["content"] for t in turns)}).encode()
    for flags in ((), ("--policy", "round-robin")):
        for kind in ("chat", "completion"):
            r = cli_router(*flags)
            convs = [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]
                     for _ in range(4)]
            where = []
            for turns in convs:
                est = estimate(body(kind, turns), kind, None, 4096)
                assert est.ids is None and len(est.text) >= 5
                k = r.pick(est, set())[0]
                r.remember(r.instances[k], est)
                where.append(k)
                turns += [{"role": "assistant", "content": " fine."},
                          {"role": "user", "content": " And then?"}]
            assert set(where) == {0, 1}
            for turns, k in zip(convs, where):
                assert r.pick(estimate(body(kind, turns), kind, None, 4096), set())[0] == k
            assert r.status()["instances"][0]["indexed_text_blocks"] > 0
            r.instances[0].mark_down("gone")  # a restarted instance holds nothing
            assert r.instances[0].texts is not None and len(r.instances[0].texts) == 0


def test_router_py_default_prices_inflow_in_seconds_from_the_measured_pace():
    """router.py's default policy gets each instance's seconds per token from its pace (the
    mean of the others' for one not yet measured; none before any is), so laps-inflow can turn
    the tokens it routed into a share of an instance's time."""
    from laps_jax.cluster.router_cli import build_parser
    assert build_parser().parse_args([]).policy == "laps-inflow"
    r = cli_router(n=3)
    assert r.config.policy == "laps-inflow"
    assert r.seconds_per_token() is None
    r.instances[0].pace.observe(1.0, 0, 1000 - 64, now=1.0)  # 1 ms a token
    r.instances[2].pace.observe(3.0, 0, 1000 - 64, now=1.0)  # 3 ms
    assert r.seconds_per_token() == pytest.approx([0.001, 0.002, 0.003])


def test_event_loop_flag_runs_uvloop_or_says_what_is_missing(monkeypatch, capsys):
    """--event-loop uvloop runs the router on uvloop's loop; without the package router.py
    exits 2 naming the flag and the package (and starts nothing)."""
    import asyncio
    import sys
    from laps_jax.cluster import router_cli
    args = router_cli.build_parser().parse_args(["--instance", "http://127.0.0.1:9000"])
    assert args.event_loop == "asyncio" and router_cli.loop_factory("asyncio") is None
    uvloop = pytest.importorskip("uvloop")
    factory = router_cli.loop_factory("uvloop")
    with asyncio.Runner(loop_factory=factory) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
    with pytest.raises(SystemExit):  # an unknown loop is argparse's error
        router_cli.build_parser().parse_args(["--instance", "http://x:1", "--event-loop", "trio"])
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import fails as if not installed
    assert router_cli.main(["--instance", "http://127.0.0.1:9000", "--port", "0",
                            "--event-loop", "uvloop"]) == 2
    err = capsys.readouterr().err
    assert "--event-loop uvloop needs the uvloop package" in err
