"""A dead instance costs the client nothing (laps_jax/cluster/failover.py).

Fast: the router in this process in front of fake instances that speak serve.py's stream (with
the token ids the router asks for) and fail on cue: refused, reset before any byte, or cut
mid-stream. Slow: two real serve.py processes behind scripts/router.py, the one serving a
200-token greedy stream SIGKILLed mid-way."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from laps_jax.cluster import http_router
from laps_jax.cluster.http_router import HTTPRouter, create_router_app
from laps_jax.cluster.policy import RouterConfig
from laps_jax.cluster.upstream import parse_metrics
from laps_jax.server.resume import TOKEN_IDS_HEADER

FORGED = {"X-Laps-Routed-Instance": "99"}
IDLE = parse_metrics('laps_pending_prefill_tokens{pool="short"} 0.0\n')


def word(i: int) -> str:
    return f"w{i} "


class FakeInstance:
    """Completions of `max_tokens` tokens 100, 101, ... (text "w0 w1 ..."), resumable as
    serve.py's are; `mode` "reset" closes each connection before answering, "endless" answers
    blanks without end (up to 64 MiB, counted in `written`); `cut_at` N ends the connection
    after the stream's N-th token. Every answer also carries a forged
    `X-Laps-Routed-Instance` (an instance's headers are not the router's word)."""

    def __init__(self, mode: str = "ok", cut_at: int | None = None):
        self.mode, self.cut_at, self.bodies, self.written = mode, cut_at, [], 0
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        self.server = TestServer(app, host="127.0.0.1")

    async def complete(self, request: web.Request):
        body = await request.json()
        self.bodies.append((body, dict(request.headers)))
        if self.mode == "reset":
            request.transport.abort()
            return web.Response()
        n, r = body.get("max_tokens", 16), body.get("laps_resume")
        start = len(r["token_ids"]) if r else 0
        assert not r or r["token_ids"] == [100 + i for i in range(start)]
        rid, created = (r["id"], r["created"]) if r else (f"cmpl-{id(self)}", 5)

        def chunk(text: str, finish: str | None) -> bytes:
            return json.dumps({"id": rid, "object": "text_completion", "created": created,
                               "choices": [{"index": 0, "text": text,
                                            "finish_reason": finish}]}).encode()
        if self.mode == "endless":  # an answer that never ends, unless its reader goes away
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            try:
                while self.written < 64 << 20:
                    await resp.write(b" " * 65536)
                    self.written += 65536
            except (ConnectionError, asyncio.CancelledError):
                pass
            return resp
        if not body.get("stream"):
            return web.Response(body=chunk("".join(map(word, range(n))), "length"),
                                content_type="application/json", headers=FORGED)
        ids = request.headers.get(TOKEN_IDS_HEADER) == "1"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **FORGED})
        await resp.prepare(request)
        for i in range(start, n):
            if i == self.cut_at:
                request.transport.abort()
                return resp
            head = b": id %d\n" % (100 + i) if ids else b""
            await resp.write(head + b"data: " + chunk(word(i), None) + b"\n\n")
            await asyncio.sleep(0.005)
        await resp.write(b"data: " + chunk("", "length") + b"\n\ndata: [DONE]\n\n")
        return resp


def run_router(fakes_or_urls, test, monkeypatch, config: RouterConfig | None = None):
    """`test(session, router url, router)` against a router (round-robin unless `config`)
    over the fakes (started here) or plain URLs, each instance taken as healthy (no polls)."""
    async def no_polls(*a, **k):
        await asyncio.Event().wait()
    monkeypatch.setattr(http_router, "poll_forever", no_polls)

    async def go():
        urls = []
        for f in fakes_or_urls:
            if isinstance(f, str):
                urls.append(f)
            else:
                await f.server.start_server()
                urls.append(str(f.server.make_url("")).rstrip("/"))
        router = HTTPRouter(urls, config or RouterConfig(policy="round-robin"))
        for inst in router.instances:
            inst.mark_ok(IDLE, 0.0)
        front = TestServer(create_router_app(router), host="127.0.0.1")
        await front.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                await test(s, str(front.make_url("")).rstrip("/"), router)
        finally:
            await front.close()
            for f in fakes_or_urls:
                if not isinstance(f, str):
                    await f.server.close()
    asyncio.run(go())


async def read_sse(s, url: str, body: dict) -> list:
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).decode()
    assert ": id" not in raw  # the token ids are the router's, never the client's
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:])
            for e in raw.split("\n\n") if e]


def metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(name + " "))


@pytest.mark.parametrize("failure", ["refused", "reset"])
def test_a_request_that_got_no_byte_goes_to_the_other_instance(monkeypatch, caplog, failure):
    from laps_jax.workload.http_compare import free_port
    good = FakeInstance()
    bad = f"http://127.0.0.1:{free_port()}" if failure == "refused" else FakeInstance("reset")
    want = "".join(map(word, range(6)))

    async def test(s, url, router):
        for stream in (False, True):  # round-robin: each goes to the failing one first
            router.policy._rr = 0
            body = {"prompt": [1, 2, 3], "max_tokens": 6, "stream": stream}
            if stream:
                events = await read_sse(s, url, body)
                assert events[-1] == "[DONE]" and "error" not in events[-2]
                assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
            else:
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    assert (await r.json())["choices"][0]["text"] == want
        text = await (await s.get(url + "/metrics")).text()
        assert metric(text, "laps_router_retries_total") == (1 if failure == "refused" else 2)
        assert metric(text, "laps_router_resumes_total") == 0
        assert router.instances[0].state == ("down" if failure == "refused" else "ok")
    with caplog.at_level(logging.WARNING, logger="laps_jax.router"):
        run_router([bad, good], test, monkeypatch)
    said = [r.getMessage() for r in caplog.records if "request sent again" in r.getMessage()]
    assert len(said) == (1 if failure == "refused" else 2)
    assert len(good.bodies) == 2


def test_each_answer_names_the_instance_that_served_it(monkeypatch):
    """`X-Laps-Routed-Instance` is the place of the instance that answered (after a retry:
    the one that took it over), never a value an instance sent; a replay records it and
    `bench.placement` counts each instance's work from it."""
    from laps_jax.bench.placement import placement
    from laps_jax.workload.http_client import ReplayConfig, RequestRecord, stream_completion
    from laps_jax.workload.http_compare import free_port
    fakes = [FakeInstance(), FakeInstance(), FakeInstance()]
    dead = f"http://127.0.0.1:{free_port()}"

    async def test(s, url, router):
        urls = [i.url for i in router.instances]
        seen = []
        for k in range(6):
            before = [len(f.bodies) for f in fakes]
            body = {"prompt": [1, 2, 3 + k], "max_tokens": 3, "stream": k % 2 == 1}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
                named = r.headers["X-Laps-Routed-Instance"]
            took = [j for j, f in enumerate(fakes) if len(f.bodies) > before[j]]
            assert len(took) == 1 and named == str(took[0] + 1)  # the dead one is place 0
            seen.append(int(named))
        assert sorted(set(seen)) == [1, 2, 3]  # the refused first pick went on elsewhere
        recs = [RequestRecord(f"r{k}", 0.0, 3) for k in range(4)]
        for k, rec in enumerate(recs):
            router.policy._rr = 1 + k % 3
            await stream_completion(s, url, "m", [5, 6, k], rec, ReplayConfig(), 0.0)
            assert rec.ok and rec.served_by == str(1 + k % 3), rec
        rows = placement(recs, urls)
        assert [row["requests"] for row in rows] == [0, 2, 1, 1]
        assert [row["computed_tokens"] for row in rows] == [0, 6, 3, 3]  # 3-token prompts
    run_router([dead, *fakes], test, monkeypatch)


@pytest.mark.parametrize("failure", ["refused", "reset", "cut"])
def test_laps_inflow_counts_a_long_request_sent_on_only_where_it_went(monkeypatch, failure):
    """laps-inflow prices the long work it sent each instance lately; a long request whose
    first instance failed (before any byte, or mid-stream and resumed) counts on the instance
    that took it over, not on the failed one too (which would push later long requests off
    it once it is back)."""
    from laps_jax.workload.http_compare import free_port
    good = FakeInstance()
    bad = {"refused": lambda: f"http://127.0.0.1:{free_port()}",
           "reset": lambda: FakeInstance("reset"), "cut": lambda: FakeInstance(cut_at=2)}[failure]()

    async def test(s, url, router):
        router.policy._rr = 0  # the tie goes to the failing instance first
        body = {"prompt": list(range(40)), "max_tokens": 4, "stream": failure == "cut"}
        if failure == "cut":
            events = await read_sse(s, url, body)
            assert events[-1] == "[DONE]"
        else:
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        text = await (await s.get(url + "/metrics")).text()
        again = "resumes" if failure == "cut" else "retries"
        assert metric(text, f"laps_router_{again}_total") >= 1
        counted = [(k, work) for _, k, work in router.policy.recent_long.items]
        assert counted == [(1, 40.0)]
    run_router([bad, good], test, monkeypatch,
               RouterConfig(policy="laps-inflow", threshold=8))
    assert len(good.bodies) == 1


def test_an_endless_answer_is_cut_off_and_sent_to_the_other_instance(monkeypatch):
    """An instance's whole answer is read to `MAX_ANSWER_BYTES` at most (a broken or forged
    one must not fill the router's memory); past it nothing has reached the client, so the
    request goes to the other instance."""
    from laps_jax.cluster import proxy
    monkeypatch.setattr(proxy, "MAX_ANSWER_BYTES", 1 << 20)
    endless, good = FakeInstance("endless"), FakeInstance()

    async def test(s, url, router):
        router.policy._rr = 0  # round-robin: the endless one first
        async with s.post(url + "/v1/completions",
                          json={"prompt": [1, 2, 3], "max_tokens": 6}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["text"] == "".join(map(word, range(6)))
        await asyncio.sleep(0.2)
        assert 1 << 20 <= endless.written < 16 << 20  # it stopped being read past the cap
    run_router([endless, good], test, monkeypatch)
    assert len(endless.bodies) == 1 and len(good.bodies) == 1


def test_a_stream_cut_mid_way_resumes_on_the_other_instance(monkeypatch, caplog):
    cut, good = FakeInstance(cut_at=7), FakeInstance()

    async def test(s, url, router):
        events = await read_sse(s, url, {"prompt": [1, 2, 3], "max_tokens": 20,
                                         "stream": True})
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == \
            "".join(map(word, range(20)))  # nothing lost, nothing twice
        assert {e["id"] for e in events[:-1]} == {f"cmpl-{id(cut)}"}  # the same response
        assert [e["choices"][0]["finish_reason"] for e in events[:-1]].count("length") == 1
        text = await (await s.get(url + "/metrics")).text()
        assert metric(text, "laps_router_resumes_total") == 1
        assert all(not i.inflight and i.load.load == 0 for i in router.instances)
    with caplog.at_level(logging.WARNING, logger="laps_jax.router"):
        run_router([cut, good], test, monkeypatch)
    (body, headers), = good.bodies
    assert headers[TOKEN_IDS_HEADER] == "1" and cut.bodies[0][1][TOKEN_IDS_HEADER] == "1"
    assert body["laps_resume"] == {"token_ids": list(range(100, 107)),
                                   "id": f"cmpl-{id(cut)}", "created": 5}
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 20  # the instance reduces it
    said = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert len(said) == 1 and "after 7 tokens" in said[0]


def test_a_client_may_not_send_the_resume_field(monkeypatch):
    good = FakeInstance()

    async def test(s, url, router):
        async with s.post(url + "/v1/completions", json={
                "prompt": [1], "stream": True, "laps_resume": {"token_ids": []}}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "laps_resume"
    run_router([good], test, monkeypatch)
    assert good.bodies == []


# -- slow: two builtin serve.py processes behind scripts/router.py ------------------------


class RouterProcess:
    """scripts/router.py over `urls` (nothing but --instance), once every instance is in."""

    def __init__(self, urls: list[str]):
        from laps_jax.workload.http_compare import free_port, wait_ready
        from server_utils import ROOT
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                     f"laps_router_{self.port}.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts", "router.py"), "--port",
             str(self.port), *[a for u in urls for a in ("--instance", u)]],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_ready(self.url, self.proc, 60)
        self.wait(lambda s: s["healthy"] == len(urls), "every instance in")

    def status(self) -> dict:
        with urllib.request.urlopen(self.url + "/router/status", timeout=10) as r:
            return json.loads(r.read())

    def wait(self, pred, what: str, timeout: float = 30.0) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if pred(s := self.status()):
                return s
            time.sleep(0.1)
        raise AssertionError(f"router status never showed {what}: {self.status()}")

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return metric(r.read().decode(), name)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


@pytest.fixture(scope="module")
def builtin_pair():
    """Two `serve.py --model builtin` instances (a test that kills one restarts it)."""
    from server_utils import ServerProcess
    procs = [None, None]

    def start(k):
        procs[k] = ServerProcess("builtin")
    threads = [threading.Thread(target=start, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(procs), "an instance did not start"
        yield procs
    finally:
        for p in procs:
            if p is not None:
                p.stop()


def chat(url: str, messages: list) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", method="POST", data=json.dumps(
        {"messages": messages, "max_tokens": 8, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_without_a_tokenizer_a_follow_up_turn_finds_its_history(builtin_pair):
    """#48 point 7: a router given nothing but --instance URLs (laps, the default) sends each
    conversation's second turn where its first went, and the instance reports cached tokens."""
    from router_utils import WORDS
    router = RouterProcess([p.url for p in builtin_pair])
    try:
        rng = random.Random(5)
        convs = [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(70))}]
                 for _ in range(2)]
        first = []
        for msgs in convs:
            before = [i["routed"] for i in router.status()["instances"]]
            r = chat(router.url, msgs)
            after = [i["routed"] for i in router.status()["instances"]]
            first.append([k for k in range(2) if after[k] > before[k]])
            msgs += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Tell me more."}]
        assert sorted(first) == [[0], [1]]  # the two conversations on the two instances
        # the follow-ups in reverse order: taken in turn, each would land on the other one
        for msgs, (k,) in zip(reversed(convs), reversed(first)):
            before = router.status()["instances"][k]["routed"]
            r = chat(router.url, msgs)
            assert router.status()["instances"][k]["routed"] == before + 1
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r["usage"]
    finally:
        router.stop()


def ms(xs) -> str:
    return f"median {statistics.median(xs) * 1e3:.0f} ms, max {max(xs) * 1e3:.0f} ms"


def stream_run(url: str, body: dict, on_event=None) -> dict:
    """A client's stream (a chat when `body` has messages): its text, ids, finish reasons,
    usage, errors and event times."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"

    async def go():
        out = {"text": "", "ids": set(), "finish": [], "usage": None, "errors": [],
               "times": [], "done": False}
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(url + path, json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    out["times"].append(time.monotonic())
                    if line.strip() == b"data: [DONE]":
                        out["done"] = True
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out["errors"].append(ev)
                        continue
                    out["ids"].add(ev["id"])
                    out["usage"] = ev.get("usage") or out["usage"]
                    for c in ev["choices"]:
                        out["text"] += c["text"] if "text" in c else \
                            c["delta"].get("content") or ""
                        if c["finish_reason"]:
                            out["finish"].append(c["finish_reason"])
                    if on_event is not None:
                        on_event(len(out["times"]))
            out["total"] = time.monotonic() - t0
        return out
    return asyncio.run(go())


STREAM = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}}


def killed_mid_stream(router: RouterProcess, procs: list, kill_at: int = 60) -> dict:
    """A 200-token greedy stream whose instance gets SIGKILL at the client's `kill_at`-th
    event; the killed instance is restarted on its port and back in the router after."""
    from server_utils import ServerProcess
    killed = {}

    def on_event(n: int) -> None:
        if n == kill_at:
            k = next(k for k, i in enumerate(router.status()["instances"]) if i["inflight"])
            procs[k].proc.kill()
            killed.update(k=k, t=time.monotonic(), n=n)
    run = stream_run(router.url, STREAM, on_event)
    k, ts = killed["k"], [killed["t"]] + [t for t in run["times"] if t > killed["t"]]
    run["stall"] = max(b - a for a, b in zip(ts, ts[1:]))  # the longest wait after the kill
    procs[k].proc.wait(10)
    procs[k].stop()
    procs[k] = ServerProcess("builtin", port=procs[k].port)
    router.wait(lambda s: s["instances"][k]["healthy"], "the restarted instance back")
    return run


@pytest.mark.slow
def test_sigkill_mid_stream_costs_the_client_nothing(builtin_pair):
    """#48 point 8: the instance serving a 200-token greedy stream is SIGKILLed mid-way; the
    client gets the uninterrupted run's text, one finish reason, the whole usage, no error,
    within about 2 s of the kill. `LAPS_FAILOVER_RUNS=N` repeats the kill N times and prints
    the added latency (docs/BENCHMARKS.md)."""
    router = RouterProcess([p.url for p in builtin_pair])
    try:
        want = stream_run(router.url, STREAM)
        assert not want["errors"] and want["done"] and want["finish"] == ["length"]
        runs = []
        for _ in range(int(os.environ.get("LAPS_FAILOVER_RUNS", "1"))):
            ref = stream_run(router.url, STREAM)  # uninterrupted, beside each interrupted one
            assert ref["text"] == want["text"]
            run = killed_mid_stream(router, builtin_pair)
            assert run["text"] == want["text"] and not run["errors"] and run["done"]
            assert run["finish"] == ["length"] and len(run["ids"]) == 1  # one response id
            assert [run["usage"][f] for f in ("prompt_tokens", "completion_tokens")] == \
                [want["usage"][f] for f in ("prompt_tokens", "completion_tokens")]
            assert run["stall"] < 2.0, run["stall"]
            runs.append((run["stall"], run["total"] - ref["total"], ref["total"],
                         max(b - a for a, b in zip(ref["times"], ref["times"][1:]))))
        # a seeded chat with a stop string on a hung instance (SIGSTOP): it is down after
        # 1.7 s of silence, the stream resumes on the other, and SIGCONT brings it back
        chat = {"messages": [{"role": "user", "content": "Tell me a story about a cat."}],
                "max_tokens": 120, "temperature": 0.8, "seed": 11, "stream": True}
        whole = stream_run(router.url, chat)
        assert not whole["errors"] and len(whole["text"]) > 40
        chat["stop"] = whole["text"][-12:-8]  # (it ends the text where it first appears)
        want = stream_run(router.url, chat)
        assert want["finish"] == ["stop"] and len(want["text"]) < len(whole["text"])
        stopped = {}

        def hang(n: int) -> None:
            if n == 10:
                k = next(k for k, i in enumerate(router.status()["instances"]) if i["inflight"])
                builtin_pair[k].proc.send_signal(signal.SIGSTOP)
                stopped["k"] = k
        try:
            got = stream_run(router.url, chat, hang)
        finally:
            builtin_pair[stopped["k"]].proc.send_signal(signal.SIGCONT)
        assert got["text"] == want["text"] and got["finish"] == ["stop"] and not got["errors"]
        assert len(got["ids"]) == 1 and got["done"]
        router.wait(lambda s: s["healthy"] == 2, "the stopped instance back")
        assert router.metric("laps_router_resumes_total") == len(runs) + 1
        assert router.output().count("resumed: http://") == len(runs) + 1
        if len(runs) > 1:
            stalls, added, plain, gaps = zip(*runs)
            print(f"\nfailover over {len(runs)} SIGKILLs: longest wait for an event after the "
                  f"kill {ms(stalls)} (uninterrupted: {ms(gaps)}); added to the stream's time "
                  f"{ms(added)}; uninterrupted stream {ms(plain)}")
    finally:
        router.stop()
