"""Prefill/decode disaggregation across processes (serve.py --role, router --prefill/--decode).

One module-scoped trio of real serve.py processes of a tiny checkpoint: a `--role prefill`, a
`--role decode` and a plain `both` (the reference), with a short `--pd-timeout`; the router
runs in this process. Faults are made without killing the shared pair: a decode instance that
dies mid-transfer is a stub that drops the connection, a prefill instance that dies is a
transfer server in a subprocess that exits, and pulls that never come are legs sent by hand.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from router_utils import StubInstance
from test_router import RouterThread, post, sse, stream_text

MODEL = "tiny-pd"
TIMEOUT_S = 3.0
SECRET = "pd-test-secret-0123456789abcdef"  # LAPS_PD_SECRET of the trio and the router
AUTH = {"X-Laps-PD-Secret": SECRET}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trio(checkpoint):
    from server_utils import ServerProcess
    path = checkpoint("gqa2_untied")
    common = ("--served-model-name", MODEL, "--threshold", "32")
    roles = {"prefill": ("--role", "prefill", "--pd-timeout", str(TIMEOUT_S)),
             "decode": ("--role", "decode", "--pd-timeout", str(TIMEOUT_S)), "both": ()}
    procs, errors = {}, []
    old = os.environ.get("LAPS_PD_SECRET")
    os.environ["LAPS_PD_SECRET"] = SECRET  # (ServerProcess passes the environment on)

    def start(name):
        try:
            procs[name] = ServerProcess(path, *common, *roles[name], timeout=900)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=start, args=(n,)) for n in roles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if old is None:
        os.environ.pop("LAPS_PD_SECRET")
    else:
        os.environ["LAPS_PD_SECRET"] = old
    if errors:
        for p in procs.values():
            p.stop()
        raise errors[0]
    yield path, procs
    for p in procs.values():
        p.stop()


def _router(urls, path, num_prefill=1) -> RouterThread:
    from laps_jax.cluster.pd_router import PDSplit
    from laps_jax.text.tokenizer import Tokenizer
    r = RouterThread(urls, "least-load", Tokenizer(path))
    r.router.split = PDSplit(r.router, num_prefill, SECRET)
    r.wait(lambda s: s["healthy"] >= num_prefill, what="the prefill instance healthy")
    return r


@pytest.fixture(scope="module")
def split(trio):
    path, procs = trio
    r = _router([procs["prefill"].url, procs["decode"].url], path)
    r.wait(lambda s: s["healthy"] == 2, what="both instances healthy")
    yield r
    r.close()


def _pages_back_to_zero(*procs, within: float = 10.0) -> None:
    deadline = time.time() + within
    while time.time() < deadline:
        if all(p.metric("laps_kv_pages_used") == 0 for p in procs):
            return
        time.sleep(0.2)
    raise AssertionError({p.url: p.metric("laps_kv_pages_used") for p in procs})


def _text(body, kind):
    c = body["choices"][0]
    return c["text"] if kind == "completion" else c["message"]["content"]


def test_greedy_output_equals_one_instance(trio, split):
    _, procs = trio
    long_prompt = [(i * 37) % 500 + 3 for i in range(300)]  # 38 pages of 8, the long pool
    cases = [("/v1/completions", "completion", {"prompt": "The quick brown fox", "max_tokens": 12}),
             ("/v1/completions", "completion", {"prompt": long_prompt, "max_tokens": 10}),
             ("/v1/chat/completions", "chat",
              {"messages": [{"role": "user", "content": "Grüße 😀 hello"}], "max_tokens": 10})]
    for path, kind, body in cases:
        body = dict(body, model=MODEL, temperature=0, return_token_ids=True)
        status, want, _ = post(procs["both"].url, path, body)
        assert status == 200, want
        status, got, _ = post(split.url, path, body)
        assert status == 200, got
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert _text(got, kind) == _text(want, kind)
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        events = sse(split.url, path, dict(body, stream=True))
        assert events[-1] == "[DONE]" and stream_text(events, kind) == _text(want, kind)
    # a follow-up turn: decoded where its history is, found in the decode side's prefix cache
    turn1 = cases[2][2]["messages"]
    _, first, _ = post(procs["both"].url, "/v1/chat/completions",
                       dict(cases[2][2], model=MODEL, temperature=0))
    msgs = turn1 + [{"role": "assistant", "content": _text(first, "chat")},
                    {"role": "user", "content": "And once more, in other words please?"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 10, "temperature": 0}
    _, want, _ = post(procs["both"].url, "/v1/chat/completions", body)
    status, got, _ = post(split.url, "/v1/chat/completions", body)
    assert status == 200 and _text(got, "chat") == _text(want, "chat")
    deadline = time.time() + 5  # the router releases the offers as each decode leg ends
    while split.router.split.released < 7 and time.time() < deadline:
        time.sleep(0.05)
    assert split.router.split.released >= 7
    _pages_back_to_zero(procs["prefill"], procs["decode"])


def test_max_tokens_one_ends_on_the_prefill_side(trio, split):
    _, procs = trio
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 1, "temperature": 0}
    _, want, _ = post(procs["both"].url, "/v1/completions", body)
    status, got, _ = post(split.url, "/v1/completions", body)
    assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["finish_reason"] == "length"


def dying_decode():
    """A stand-in decode instance that drops the connection of every request it is sent (a
    process that dies mid-transfer)."""
    async def die(request):
        await request.read()
        request.transport.abort()
        await asyncio.sleep(1)
    return StubInstance(die, MODEL)


def test_decode_dies_mid_transfer_client_gets_json_and_prefill_frees(trio):
    path, procs = trio
    stub = dying_decode()
    r = _router([procs["prefill"].url, stub.url], path)
    try:
        r.wait(lambda s: s["healthy"] == 2, what="both healthy")
        status, body, _ = post(r.url, "/v1/completions",
                               {"prompt": list(range(5, 90)), "max_tokens": 8})
        assert status == 502 and body["error"]["code"] == "upstream_failed", body
        _pages_back_to_zero(procs["prefill"], within=5.0)  # released by the router at once
    finally:
        r.close()
        stub.close()


def _handoff_header(offer: dict) -> dict:
    return {**AUTH, "X-Laps-PD": "decode", "X-Laps-PD-Handoff": json.dumps(
        {"handoff": offer, "first": {"token_id": 7, "logprob": -1.0, "top": []},
         "finish_reason": None})}


def test_prefill_dies_decode_frees_what_it_reserved(trio):
    _, procs = trio
    # a "prefill instance": a transfer server that is up when the pull starts, then exits
    code = ("import jax, time; from jax.experimental import transfer as t; "
            "s = t.start_transfer_server(jax.devices()[0].client, '127.0.0.1:0', "
            "['127.0.0.1:0']); print(s.address(), flush=True); time.sleep(1.5)")
    peer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        address = peer.stdout.readline().strip()
        prompt = list(range(20, 60))  # 40 tokens: 5 pages of 8
        _, hand, _ = post(procs["prefill"].url, "/v1/completions",  # a real descriptor's shape
                          {"prompt": prompt, "max_tokens": 4},
                          headers={**AUTH, "X-Laps-PD": "prefill"})
        offer = dict(hand["handoff"], address=address)
        t0 = time.time()
        status, body, _ = post(procs["decode"].url, "/v1/completions",
                               {"prompt": prompt, "max_tokens": 4},
                               headers=_handoff_header(offer))
        assert status == 502 and body["error"]["code"] == "kv_transfer_failed", body
        assert time.time() - t0 < TIMEOUT_S + 5
    finally:
        peer.kill()
        peer.wait()
    _pages_back_to_zero(procs["decode"], procs["prefill"], within=TIMEOUT_S + 5)


def test_pulls_that_never_come_time_out_and_free(trio):
    _, procs = trio
    # the prefill leg alone: an offer nobody pulls is freed after --pd-timeout
    status, hand, _ = post(procs["prefill"].url, "/v1/completions",
                           {"prompt": list(range(100, 180)), "max_tokens": 6, "temperature": 0},
                           headers={**AUTH, "X-Laps-PD": "prefill"})  # greedy: not ended at once
    assert status == 200 and hand["handoff"]["num_pages"] == 10, hand
    assert procs["prefill"].metric("laps_kv_pages_used") >= 10
    # the decode leg alone, for a uuid nobody offered: its pull times out, its pages freed
    offer = dict(hand["handoff"], uuid=hand["handoff"]["uuid"] ^ 1)
    t0 = time.time()
    status, body, _ = post(procs["decode"].url, "/v1/completions",
                           {"prompt": list(range(100, 180)), "max_tokens": 6},
                           headers=_handoff_header(offer))
    assert status == 502 and "timed out" in body["error"]["message"], body
    assert TIMEOUT_S - 0.5 < time.time() - t0 < TIMEOUT_S + 5
    _pages_back_to_zero(procs["prefill"], procs["decode"], within=TIMEOUT_S + 5)
    # a leg the instance's role does not take is a 400
    status, body, _ = post(procs["both"].url, "/v1/completions", {"prompt": "x"},
                           headers={**AUTH, "X-Laps-PD": "prefill"})
    assert status == 400 and "--role" in body["error"]["message"]


def _offer_of(procs, prompt: list[int]) -> dict:
    """A genuine hand-off descriptor (the prefill leg, sent by hand with the secret)."""
    status, hand, _ = post(procs["prefill"].url, "/v1/completions",
                           {"prompt": prompt, "max_tokens": 4},
                           headers={**AUTH, "X-Laps-PD": "prefill"})
    assert status == 200, hand
    return hand["handoff"]


def _genuine_ok(split, within: float) -> None:
    t0 = time.time()
    status, body, _ = post(split.url, "/v1/completions",
                           {"model": MODEL, "prompt": list(range(30, 70)), "max_tokens": 4,
                            "temperature": 0}, timeout=within + 5)
    assert status == 200 and time.time() - t0 < within, (status, body, time.time() - t0)


def test_forged_legs_are_refused_before_anything_is_spent(trio, split):
    """Legs without the split's secret (or with a wrong one) are 401 at once, on both sides
    and on /pd/release: they used to take the decode side's pull threads (every PD request
    then failed 'KV pull failed: timed out') and pin the prefill side's pages."""
    _, procs = trio
    prompt = list(range(200, 260))
    offer = _offer_of(procs, prompt)
    forged = dict(_handoff_header(dict(offer, uuid=offer["uuid"] ^ 5)))
    for auth in ({}, {"X-Laps-PD-Secret": "wrong-secret-0123456789"},
                 {"X-Laps-PD-Secret": "\u00e9" * 20}):
        headers = {k: v for k, v in forged.items() if k != "X-Laps-PD-Secret"}
        t0 = time.time()
        for url, leg in ((procs["decode"].url, headers),
                         (procs["prefill"].url, {"X-Laps-PD": "prefill"})):
            status, body, _ = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 4},
                                   headers={**leg, **{k: v.encode().decode("latin-1")
                                                       for k, v in auth.items()}})
            assert status == 401 and body["error"]["code"] == "invalid_pd_secret", body
        status, body, _ = post(procs["prefill"].url, "/pd/release", {"uuid": offer["uuid"]},
                               headers=auth)
        assert status == 401, body
        assert time.time() - t0 < 2.0
    assert procs["prefill"].metric("laps_pd_offers_held") == 1  # the genuine one, untouched
    _genuine_ok(split, within=5.0)


def test_every_handoff_field_is_checked(trio):
    """A hand-off with the secret but a bad field is a 400 JSON error before anything is
    reserved, streamed or not (token id -5 was a 500, or a dropped stream; 99999999 was
    taken)."""
    _, procs = trio
    prompt = list(range(300, 340))  # 5 pages of 8
    offer = dict(_offer_of(procs, prompt))
    first = {"token_id": 7, "logprob": -1.0, "top": []}
    cases = [({"first": dict(first, token_id=-5)}, "first.token_id"),
             ({"first": dict(first, token_id=99999999)}, "first.token_id"),
             ({"first": dict(first, top=[[-1, -0.5]])}, "top token_id"),
             ({"first": dict(first, logprob=3.0)}, "log-probability"),
             ({"handoff": dict(offer, num_pages=10 ** 9)}, "pages"),
             ({"handoff": dict(offer, shape=[1, 2, 3, 4, 5])}, "offered K/V"),
             ({"handoff": dict(offer, dtype="int8")}, "offered K/V"),
             ({"handoff": dict(offer, address="nowhere")}, "descriptor"),
             ({"finish_reason": "handoff"}, "finish_reason"),
             # past the split's cap (the router's too) yet under aiohttp's 8,190 per field
             ({"pad": None}, "too long")]
    for change, words in cases:
        hand = {"handoff": offer, "first": first, "finish_reason": None, **change}
        if "pad" in hand:
            hand["pad"] = ""
            hand["pad"] = "x" * (8100 - len(json.dumps(hand)))
        headers = {**AUTH, "X-Laps-PD": "decode", "X-Laps-PD-Handoff": json.dumps(hand)}
        for stream in (False, True):
            status, body, _ = post(procs["decode"].url, "/v1/completions",
                                   {"prompt": prompt, "max_tokens": 4, "stream": stream},
                                   headers=headers)
            assert status == 400 and body["error"]["code"] == "invalid_handoff", (change, body)
            assert words in body["error"]["message"], (words, body)
    assert procs["decode"].metric("laps_kv_pages_used") == 0


def test_dead_peer_handoffs_fail_fast_and_leave_genuine_requests_alone(trio, split):
    """Hand-offs (with the secret) naming a transfer server that is gone fail at once, each
    alone: before, each took a pull thread until --pd-timeout (for good, on a live address),
    and four of them failed every PD request after."""
    from server_utils import free_port
    import concurrent.futures
    _, procs = trio
    prompt = list(range(400, 440))
    offer = _offer_of(procs, prompt)
    dead = dict(offer, address=f"127.0.0.1:{free_port()}")
    send = lambda _: (time.time(), post(procs["decode"].url, "/v1/completions",
                                        {"prompt": prompt, "max_tokens": 4},
                                        headers=_handoff_header(dead)))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        t0 = time.time()
        results = list(pool.map(send, range(8)))
    for _, (status, body, _) in results:
        assert status == 502 and "unreachable" in body["error"]["message"], body
    assert time.time() - t0 < TIMEOUT_S, time.time() - t0
    _genuine_ok(split, within=5.0)
    _pages_back_to_zero(procs["decode"], within=5.0)


def test_prefill_legs_cannot_pin_the_whole_pool(trio, monkeypatch):
    """Raw prefill legs that nobody pulls pin at most --pd-max-pinned (half) of the pool,
    counted in /metrics; an ordinary request to the same instance still runs at once. (33 such
    legs used to hold 3,927 of 4,096 pages, uncounted, and queue normal requests behind.)
    Its own prefill instance, whose offers wait 30 s: longer than the legs take to run."""
    from server_utils import ServerProcess
    path, _ = trio
    monkeypatch.setenv("LAPS_PD_SECRET", SECRET)
    p = ServerProcess(path, "--served-model-name", MODEL, "--role", "prefill", timeout=900)
    try:
        _pin_flood(p)
    finally:
        p.stop()


def _pin_flood(p) -> None:
    import concurrent.futures
    pool_pages = p.metric("laps_kv_pages_used") + p.metric("laps_kv_pages_free")
    legs = [[(i * 131 + j * 7) % 900 + 5 for j in range(470)] for i in range(14)]  # 59 pages
    leg = lambda prompt: post(p.url, "/v1/completions", {"prompt": prompt, "max_tokens": 4},
                              headers={**AUTH, "X-Laps-PD": "prefill"})
    peak, released = 0.0, set()
    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        futs = [pool.submit(leg, prompt) for prompt in legs]
        time.sleep(1.0)
        t0 = time.time()
        status, body, _ = post(p.url, "/v1/completions",
                               {"prompt": list(range(500, 900)), "max_tokens": 4})
        assert status == 200 and time.time() - t0 < 3.0, (status, body, time.time() - t0)
        t0 = time.time()
        while not all(f.done() for f in futs):
            peak = max(peak, p.metric("laps_kv_pages_used"))
            assert p.metric("laps_pd_pinned_pages") <= p.metric("laps_pd_pin_limit_pages")
            if time.time() - t0 > 4.0:  # seen enough: release what was offered, as a router
                for f in futs:
                    if f.done() and f.result()[0] == 200 and id(f) not in released:
                        released.add(id(f))
                        offer = f.result()[1]["handoff"]  # null: the first token ended it
                        if offer is not None:
                            post(p.url, "/pd/release", {"uuid": offer["uuid"]}, headers=AUTH)
            time.sleep(0.1)
    peak = max(peak, p.metric("laps_kv_pages_used"))  # (the last leg may just have ended)
    assert peak <= pool_pages // 2 + 60, (peak, pool_pages)  # the limit, plus one leg
    assert 0 < p.metric("laps_pd_pin_limit_pages") <= pool_pages / 2
    for f in futs:
        status, body, headers = f.result()
        assert status == 200 or (status == 503 and headers.get("Retry-After")), body


def test_the_offer_is_freed_once_pulled_not_when_the_decode_ends(trio, split):
    """The decode instance releases the prefill's pages as soon as it has pulled them: while
    the client still streams, the prefill instance holds none (they used to stay pinned for
    the whole decode, which with the pin limit halved the split's concurrency)."""
    _, procs = trio
    seen = []

    def on_line(i, payload):
        if i == 1:
            deadline = time.time() + 1.0
            while procs["prefill"].metric("laps_kv_pages_used") and time.time() < deadline:
                time.sleep(0.02)
            seen.append((procs["prefill"].metric("laps_kv_pages_used"),
                         split.router.split.released))

    released = split.router.split.released
    events = sse(split.url, "/v1/completions",
                 {"model": MODEL, "prompt": list(range(600, 700)), "max_tokens": 400,
                  "temperature": 0, "stream": True}, on_line=on_line)
    assert events[-1] == "[DONE]" and len(events) > 5
    assert seen == [(0.0, released)]  # freed, and not by the router (its release comes after)
