"""Late binding in the router (`--hold-tokens`, laps_jax/cluster/hold.py): the queue's order and
bounds by themselves, then the router in this process in front of two fake instances whose
first tokens the test releases, so when each request reaches an instance is seen exactly."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from laps_jax.cluster import http_router
from laps_jax.cluster.hold import HoldFull, HoldQueue
from laps_jax.cluster.http_router import HTTPRouter, create_router_app
from laps_jax.cluster.policy import RouterConfig
from laps_jax.cluster.upstream import parse_metrics


class Clock:
    def __init__(self):
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


def test_held_requests_go_fewest_tokens_first_with_aging():
    clock = Clock()
    rng = random.Random(7)
    aging = rng.uniform(200, 2000)

    async def go():
        room = [False]
        q = HoldQueue(lambda tokens: room[0], aging, max_held=64, now=clock.monotonic)
        order, tasks, arrived = [], [], {}
        for n in range(12):
            tokens = rng.randrange(1, 600)
            arrived[n] = (tokens, clock.t)

            async def one(n=n, tokens=tokens):
                await q.turn(tokens)
                order.append(n)
                q.sent()
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(0)
            clock.t += rng.uniform(0.0, 0.4)
        assert len(q.held) == 12 and not order  # nothing may go while no instance has room
        release_at = clock.t
        room[0] = True
        q.kick()
        await asyncio.gather(*tasks)
        # the rule, made here: tokens less the credit for the time held, at the release
        want = sorted(arrived, key=lambda n: (arrived[n][0] - aging * (release_at - arrived[n][1]),
                                             arrived[n][1]))
        assert order == want
        assert order != sorted(arrived, key=lambda n: arrived[n][1])  # not arrival order
    asyncio.run(go())


def test_one_release_at_a_time_and_the_bounds():
    async def go():
        room = [True]
        q = HoldQueue(lambda tokens: room[0], 1000.0, max_held=2)
        await q.turn(10)  # nothing held, room: goes at once
        assert q.releasing
        second = asyncio.create_task(q.turn(5))
        await asyncio.sleep(0.01)
        assert not second.done() and len(q.held) == 1  # the first is not counted yet
        q.sent()
        await asyncio.wait_for(second, 1)
        q.sent()
        room[0] = False
        held = [asyncio.create_task(q.turn(n)) for n in (1, 2)]
        await asyncio.sleep(0.01)
        with pytest.raises(HoldFull, match="2 requests wait in the router"):
            await q.turn(3)
        assert len(q.held) == 2
        # a client gone while held leaves the queue
        held[0].cancel()
        await asyncio.gather(held[0], return_exceptions=True)
        assert len(q.held) == 1
        # room comes back without a kick: the held one is looked at again within RECHECK_S
        room[0] = True
        await asyncio.wait_for(held[1], 1)
        # released, then gone before it ran: its turn passes on
        room[0] = False
        a, b = (asyncio.create_task(q.turn(n)) for n in (1, 2))
        await asyncio.sleep(0.01)
        q.sent()  # (held[1]'s)
        room[0] = True
        q.kick()
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        await asyncio.wait_for(b, 1)
    asyncio.run(go())


# -- the router in front of two fake instances ---------------------------------------------


class FakeInstance:
    """Answers streamed completions; each request's first token waits for the test."""

    def __init__(self, name: str):
        self.name, self.arrived, self.gates = name, [], {}
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        self.server = TestServer(app, host="127.0.0.1")

    async def complete(self, request: web.Request):
        body = await request.json()
        tag = body["user"]
        self.arrived.append(tag)
        gate = self.gates.setdefault(tag, asyncio.Event())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await gate.wait()
        await resp.write(b'data: {"choices": [{"text": "x", "index": 0}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def release(self, tag: str) -> None:
        self.gates.setdefault(tag, asyncio.Event()).set()


async def _stream(session, url: str, tag: str, tokens: int) -> str:
    body = {"model": "m", "prompt": list(range(1, tokens + 1)), "stream": True, "user": tag}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.read()).decode()


async def _until(pred, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


@pytest.fixture
def no_polls(monkeypatch):
    """The router reads no /metrics: each test marks its instances up with METRICS itself."""
    async def never(*a, **k):
        await asyncio.Event().wait()
    monkeypatch.setattr(http_router, "poll_forever", never)


METRICS = parse_metrics("laps_pending_prefill_tokens{pool=\"short\"} 0.0\n")


async def _front(hold_tokens: float):
    """Two fake instances, up and idle, behind an HTTPRouter (least load, threshold 10) with
    this hold: (fakes, router, its front server, the front's URL)."""
    fakes = [FakeInstance("a"), FakeInstance("b")]
    for f in fakes:
        await f.server.start_server()
    router = HTTPRouter([str(f.server.make_url("")) for f in fakes],
                        RouterConfig(policy="least-load"), threshold=10, hold_tokens=hold_tokens)
    for inst in router.instances:
        inst.mark_ok(METRICS, 0.0)
    front = TestServer(create_router_app(router), host="127.0.0.1")
    await front.start_server()
    return fakes, router, front, str(front.make_url("")).rstrip("/")


async def _close(front, fakes) -> None:
    await front.close()
    for f in fakes:
        await f.server.close()


@pytest.mark.parametrize("hold_tokens", [0.0, 100.0])
def test_the_router_holds_long_requests_until_an_instance_has_room(monkeypatch, no_polls,
                                                                   hold_tokens):
    # order by tokens alone here (the aging is the test above's): arrivals 50 ms apart
    monkeypatch.setattr(http_router, "HOLD_AGING_TOKENS_PER_S", 0.0)

    async def go():
        fakes, router, front, url = await _front(hold_tokens)
        sent = lambda: fakes[0].arrived + fakes[1].arrived  # noqa: E731
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(_stream(s, url, t, 150)) for t in ("A", "B")]
            await _until(lambda: len(sent()) == 2, "A, B sent")
            a_on = 0 if "A" in fakes[0].arrived else 1
            # long requests larger than A and B: 150 tokens ahead of each on both instances
            for tag, tokens in (("C", 300), ("D", 200), ("E", 250)):
                tasks.append(asyncio.create_task(_stream(s, url, tag, tokens)))
                await asyncio.sleep(0.05)
            # a short request, and a long one smaller than everything pending: never held
            tasks += [asyncio.create_task(_stream(s, url, t, n)) for t, n in (("S", 5),
                                                                              ("G", 120))]
            await _until(lambda: {"S", "G"} <= set(sent()), "S and G sent at once")
            status = await (await s.get(url + "/router/status")).json()
            if not hold_tokens:  # on arrival, as before
                assert sorted(sent()) == sorted("ABCDEGS") and status["held"] == 0
            else:  # C, D, E wait in the router
                assert sorted(sent()) == sorted("ABGS") and status["held"] == 3
                metric = await (await s.get(url + "/metrics")).text()
                assert "laps_router_held_requests 3.0" in metric
                router.hold.max_held = 3  # one more is refused, as JSON, with Retry-After
                async with s.post(url + "/v1/completions",
                                  json={"model": "m", "prompt": list(range(1, 400)),
                                        "user": "F"}) as r:
                    assert r.status == 503 and r.headers["Retry-After"] == "1"
                    assert "3 requests wait" in (await r.json())["error"]["message"]
                for tag in "ASG":  # A's instance drains (B stays ahead on the other)
                    fakes[a_on].release(tag)
                    fakes[1 - a_on].release(tag)
                # fewest tokens first, one at a time: each one sent is ahead of the next
                for tag, n in (("D", 1), ("E", 2), ("C", 3)):
                    await _until(lambda: fakes[a_on].arrived[-1:] == [tag], f"{tag} sent")
                    await asyncio.sleep(0.05)
                    assert len(router.hold.held) == 3 - n
                    fakes[a_on].release(tag)
                assert fakes[1 - a_on].arrived[0] == "B" and \
                    not {"C", "D", "E"} & set(fakes[1 - a_on].arrived)
                # C, D, E were held (the refused one was not), each for 50 ms at least
                status = await (await s.get(url + "/router/status")).json()
                assert status["held_total"] == 3 and status["held_seconds_total"] >= 0.15
                metric = await (await s.get(url + "/metrics")).text()
                assert "laps_router_held_total 3.0" in metric
            for f in fakes:
                for tag in "ABCDEGS":
                    f.release(tag)
            for out in await asyncio.gather(*tasks):
                assert '"text": "x"' in out and out.rstrip().endswith("data: [DONE]")
        assert all(not i.inflight and i.load.load == 0 for i in router.instances)
        assert router.hold is None or not router.hold.held and not router.hold.releasing
        await _close(front, fakes)
    asyncio.run(go())


def test_a_long_request_with_room_on_arrival_goes_where_the_policy_picks(no_polls):
    """Only a request that waited is confined to the instances with room: one that finds room
    on arrival is placed among all, as bound on arrival. (Confined, every such request went to
    the instance whose only pending work was one larger request, which each overtakes, and
    long work piled up there: cluster/hold.py.)"""
    async def go():
        fakes, router, front, url = await _front(100.0)
        on = lambda tag: next(k for k, f in enumerate(fakes) if tag in f.arrived)  # noqa: E731
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(_stream(s, url, "L", 400))]
            await _until(lambda: any("L" in f.arrived for f in fakes), "L sent")
            tasks.append(asyncio.create_task(_stream(s, url, "M", 150)))  # the other, emptier
            await _until(lambda: any("M" in f.arrived for f in fakes), "M sent")
            assert on("M") != on("L")
            # N (200): L's instance has room (L is larger, N would overtake it), M's has not
            # (M is ahead of N and over the hold); the least loaded is M's: N goes there
            tasks.append(asyncio.create_task(_stream(s, url, "N", 200)))
            await _until(lambda: any("N" in f.arrived for f in fakes), "N sent")
            assert on("N") == on("M")
            status = await (await s.get(url + "/router/status")).json()
            assert status["held_total"] == 0
            for f in fakes:
                for tag in "LMN":
                    f.release(tag)
            await asyncio.gather(*tasks)
        await _close(front, fakes)
    asyncio.run(go())


def test_the_hold_looks_at_the_first_held_request_with_its_own_tokens():
    """`can_send` is asked for the first in order, with its tokens: a larger request that
    would not fit does not keep a smaller one back, and is not sent by the smaller's room."""
    async def go():
        limit = [0]
        q = HoldQueue(lambda tokens: tokens < limit[0], 0.0, max_held=8)
        order = []

        async def one(n):
            await q.turn(n)
            order.append(n)
            q.sent()
        tasks = [asyncio.create_task(one(n)) for n in (300, 100)]
        await asyncio.sleep(0.01)
        assert len(q.held) == 2 and not order
        limit[0] = 150
        q.kick()
        await asyncio.wait_for(tasks[1], 1)
        await asyncio.sleep(0.1)  # rechecked meanwhile: 300 still does not fit
        assert order == [100] and [h.tokens for h in q.held] == [300]
        limit[0] = 301
        await asyncio.wait_for(tasks[0], 1)
        assert order == [100, 300]
    asyncio.run(go())


def test_router_py_refuses_bad_hold_values():
    from laps_jax.cluster.router_cli import build_parser, make_router
    for argv in (["--hold-tokens", "-1"], ["--hold-tokens", "nan"], ["--hold-tokens", "inf"]):
        args = build_parser().parse_args(["--instance", "http://127.0.0.1:9000", *argv])
        with pytest.raises(ValueError, match="--hold-tokens"):
            make_router(args)
    args = build_parser().parse_args(["--prefill", "http://127.0.0.1:9000", "--decode",
                                      "http://127.0.0.1:9001", "--hold-tokens", "256"])
    with pytest.raises(ValueError, match="--hold-tokens applies to --instance"):
        make_router(args)


def test_router_py_holds_by_each_instances_chunk_unless_told_not_to():
    from laps_jax.cluster.router_cli import build_parser, make_router
    from laps_jax.cluster.upstream import BlockIndex
    one = ["--instance", "http://127.0.0.1:9000", "--instance", "http://127.0.0.1:9001"]
    make = lambda *argv: make_router(build_parser().parse_args([*one, *argv]))  # noqa: E731
    r = make()  # the default: laps-inflow, long requests bound late by the instances' chunk
    assert r.config.policy == "laps-inflow" and r.hold is not None
    assert r.status()["hold_from"] == "instances"
    off = make("--hold-tokens", "0")  # bound on arrival
    assert off.hold is None and off.status()["hold_from"] is None
    for baseline in ("round-robin", "least-load", "prefix", "bucket", "laps"):  # as screened
        assert make("--policy", baseline).hold is None
    assert off.held_tokens(http_router.Estimate(list(range(900)), 900, True)) is None
    split = make_router(build_parser().parse_args(  # the prefill/decode split: never held
        ["--prefill", "http://127.0.0.1:9000", "--decode", "http://127.0.0.1:9001",
         "--pd-secret-file", __file__]))
    assert split.hold is None
    for policy in ("laps-inflow", "round-robin", "prefix"):
        h = make("--policy", policy, "--hold-tokens", "300", "--threshold", "10")
        assert h.hold is not None and h.status()["hold_tokens"] == 300.0
    # a request no larger than the hold (one step's work or so) is never held, a larger one is
    est = lambda n: http_router.Estimate(list(range(1, n + 1)), n, True)  # noqa: E731
    assert h.held_tokens(est(9)) is None and h.held_tokens(est(300)) is None
    assert h.held_tokens(est(301)) == 301 and h.held_tokens(est(900)) == 900
    # a turn whose history is cached on an instance at least as long as its new part goes at
    # once (to its holder, as the policy weighs it); with more new than cached it is held
    h.instances[0].blocks = BlockIndex(16)
    h.remember(h.instances[0], est(800))
    assert h.cached(est(1200)) == [800, 0]
    assert h.held_tokens(est(1200)) is None and h.held_tokens(est(1600)) is None
    assert h.held_tokens(est(1700)) == 900


def test_an_auto_hold_is_each_instances_own_long_chunk():
    """`--hold-tokens auto`: an instance is full at the long chunk it reports, and a request is
    held only when larger than the smallest such chunk (the fallback until one reports)."""
    from laps_jax.cluster.router_cli import build_parser, make_router
    one = ["--instance", "http://127.0.0.1:9000", "--instance", "http://127.0.0.1:9001"]
    r = make_router(build_parser().parse_args([*one, "--hold-tokens", "auto", "--threshold",
                                               "10"]))
    est = lambda n: http_router.Estimate(list(range(1, n + 1)), n, True)  # noqa: E731
    for i in r.instances:
        i.state = "ok"
    assert r.hold is not None and r.status()["hold_from"] == "instances"
    assert r.hold_size() == http_router.FALLBACK_CHUNK  # nothing reported yet
    r.instances[0].report = parse_metrics("laps_long_chunk_tokens 256.0\n")
    r.instances[1].report = parse_metrics("laps_long_chunk_tokens 512.0\n")
    assert r.status()["hold_tokens"] == 256.0
    assert r.held_tokens(est(256)) is None and r.held_tokens(est(257)) == 257
    for i in r.instances:
        i.load.sent(300, 1.0, short=True)
    # 300 ahead is over the first's chunk, not the second's: the request may go, not to the first
    assert r.can_send(1000) and r.held_back(1000) == {0}
    r.instances[1].load.sent(300, 1.0, short=True)
    assert not r.can_send(1000) and r.held_back(1000) == set()
    r.instances[0].state = "down"  # a sick instance's chunk no longer sizes the hold
    assert r.hold_size() == 512.0 and r.held_tokens(est(400)) is None
    # a fixed --long-chunk-tokens is every instance's chunk, so the hold too
    fixed = make_router(build_parser().parse_args([*one, "--hold-tokens", "auto",
                                                   "--long-chunk-tokens", "128"]))
    assert fixed.hold_size() == 128.0 and fixed.hold_at(fixed.instances[1]) == 128.0
    assert make_router(build_parser().parse_args([*one, "--hold-tokens", "0"])).status()[
        "hold_from"] is None
    with pytest.raises(SystemExit):  # neither 'auto' nor a number: argparse's usage error
        build_parser().parse_args([*one, "--hold-tokens", "some"])


def test_work_ahead_of_a_long_request_leaves_out_larger_long_work():
    from laps_jax.cluster.upstream import LoadBook
    b = LoadBook()
    b.sent(40, 1.0, short=True)
    big = b.sent(900, 1.0)
    b.sent(300, 1.0)
    assert b.load == 1240
    assert b.ahead(500) == 340      # the short request and the 300-token one run first
    assert b.ahead(900) == 1240     # (a request as large as it: both wait for the other)
    assert b.ahead(100) == 40       # only the short work
    b.prefilled(big, 2.0)
    assert b.ahead(500) == 340 and b.load == 340
    # other clients' work: their short work counts, their long work (sizes unseen) does not,
    # so it cannot hold this router's requests back for as long as they keep sending
    b.report(340 + 5000 + 60, 3.0, pending_short=40 + 60)
    assert b.load == 5400 and b.short_load == 100
    assert b.ahead(500) == 400 and b.ahead(100) == 100
