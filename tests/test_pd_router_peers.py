"""The prefill/decode split's router against prefill peers that misbehave (cluster/pd_router.py),
with stub instances in this process and no model.

A prefill instance's answer is another process's input and becomes the decode leg's header:
each malformed, oversized or non-JSON answer must end that request alone with a 502 naming the
instance, before any decode instance is asked, and leave the router serving the next request.
A prefill instance that refuses the connection is skipped for another."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from laps_jax.cluster.pd_router import MAX_HANDOFF
from laps_jax.cluster.upstream import parse_metrics
from laps_jax.workload.http_compare import free_port
from router_utils import RouterThread, StubInstance, post

SECRET = "pd-peer-test-secret-0123456789ab"
FIRST = {"token_id": 7, "logprob": -0.5, "top": [[7, -0.5], [9, -1.5]]}
GOOD = {"handoff": {"address": "127.0.0.1:1", "uuid": 12345, "num_pages": 2,
                    "num_tokens": 12},
        "first": FIRST, "finish_reason": None}
BODY = {"prompt": "the question", "max_tokens": 4}


class Prefill:
    """A stub prefill instance whose answer the test sets: (status, body bytes, type)."""

    def __init__(self):
        self.answer = (200, json.dumps(GOOD).encode(), "application/json")
        self.stub = StubInstance(self.respond)

    async def respond(self, request):
        assert request.headers.get("X-Laps-PD") == "prefill"
        await request.read()
        status, body, ctype = self.answer
        return web.Response(body=body, status=status, content_type=ctype)


class Decode:
    """A stub decode instance: answers a completion and keeps the hand-off header it got."""

    def __init__(self):
        self.handoffs: list[str] = []
        self.refuse: dict | None = None  # an error to answer instead (status 400)
        self.stub = StubInstance(self.respond)

    async def respond(self, request):
        await request.read()
        self.handoffs.append(request.headers.get("X-Laps-PD-Handoff"))
        if self.refuse is not None:
            return web.json_response(self.refuse, status=400)
        return web.json_response({"id": "cmpl-stub", "object": "text_completion",
                                  "created": 1, "model": "stub", "choices": [
                                      {"index": 0, "text": " ok", "finish_reason": "length"}]})


def _split(urls: list[str], num_prefill: int) -> RouterThread:
    from laps_jax.cluster.pd_router import PDSplit
    r = RouterThread(urls, "least-load")
    r.router.split = PDSplit(r.router, num_prefill, SECRET)
    return r


@pytest.fixture(scope="module")
def peers():
    prefill, decode = Prefill(), Decode()
    r = _split([prefill.stub.url, decode.stub.url], 1)
    r.wait(lambda s: s["healthy"] == 2, what="both stubs healthy")
    yield r, prefill, decode
    r.close()
    prefill.stub.close()
    decode.stub.close()


BAD = {
    "html": (200, b"<html>oops</html>", "text/html"),
    "not utf-8": (200, b"\xff\xfe{", "application/json"),
    "a JSON list": (200, b"[1, 2]", "application/json"),
    "uuid a string": (200, json.dumps(dict(GOOD, handoff={"uuid": "12345"})).encode(),
                      "application/json"),
    "uuid a bool": (200, json.dumps(dict(GOOD, handoff={"uuid": True})).encode(),
                    "application/json"),
    "uuid negative": (200, json.dumps(dict(GOOD, handoff={"uuid": -1})).encode(),
                      "application/json"),
    "handoff a list": (200, json.dumps(dict(GOOD, handoff=[12345])).encode(),
                       "application/json"),
    "over the header cap": (200, json.dumps(dict(GOOD, pad="x" * MAX_HANDOFF)).encode(),
                            "application/json"),
    "escapes past the cap": (200, json.dumps(dict(GOOD, pad="\u00e9" * 2000),
                                             ensure_ascii=False).encode(), "application/json"),
    "a 500 page": (500, b"Internal Server Error", "text/plain"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_prefill_answer_fails_that_request_alone(peers, name):
    r, prefill, decode = peers
    asked = len(decode.handoffs)
    prefill.answer = BAD[name]
    status, body, _ = post(r.url, "/v1/completions", BODY)
    assert status == 502 and body["error"]["code"] == "upstream_failed", (name, body)
    assert prefill.stub.url in body["error"]["message"], body
    assert len(decode.handoffs) == asked  # no decode instance was asked for anything
    prefill.answer = (200, json.dumps(GOOD).encode(), "application/json")
    status, body, _ = post(r.url, "/v1/completions", BODY)  # the next one is served
    assert status == 200 and body["choices"][0]["text"] == " ok", body
    assert json.loads(decode.handoffs[-1]) == GOOD
    assert r.status()["healthy"] == 2  # a bad answer is not a dead instance


def test_the_prefill_instances_json_error_reaches_the_client(peers):
    r, prefill, decode = peers
    asked = len(decode.handoffs)
    err = {"error": {"message": "the prompt has 9000 tokens; the limit is 512",
                     "type": "invalid_request_error", "code": "prompt_too_long"}}
    prefill.answer = (400, json.dumps(err).encode(), "application/json")
    try:
        status, body, _ = post(r.url, "/v1/completions", BODY)
    finally:
        prefill.answer = (200, json.dumps(GOOD).encode(), "application/json")
    assert status == 400 and body == err
    assert len(decode.handoffs) == asked


def test_a_handoff_the_decode_side_refuses_is_the_prefills_fault(peers):
    """The decode side's 400 `invalid_handoff` reaches the client as a 502 naming the prefill
    instance; its other 400s (the client's own) pass as they are."""
    r, prefill, decode = peers
    refusal = {"error": {"message": "bad X-Laps-PD-Handoff header: first.token_id 99999 is "
                         "not a token id of this model (0..511)",
                         "type": "invalid_request_error", "code": "invalid_handoff"}}
    own = {"error": {"message": "max_tokens must be at least 1",
                     "type": "invalid_request_error", "code": None}}
    try:
        decode.refuse = refusal
        status, body, _ = post(r.url, "/v1/completions", BODY)
        assert status == 502 and body["error"]["code"] == "upstream_failed", body
        assert prefill.stub.url in body["error"]["message"]
        assert "first.token_id 99999" in body["error"]["message"]
        decode.refuse = own
        status, body, _ = post(r.url, "/v1/completions", BODY)
        assert status == 400 and body == own
    finally:
        decode.refuse = None


def test_an_endless_prefill_answer_is_cut_off_at_the_cap():
    """A peer streaming an answer without end is read only to the cap, then dropped."""
    state = {"written": 0, "finished": False}

    async def endless(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        chunk = b"[" * 65536
        try:
            for _ in range(4096):  # 256 MiB, unless the reader goes away
                await resp.write(chunk)
                state["written"] += len(chunk)
            state["finished"] = True
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp

    prefill, decode = StubInstance(endless), Decode()
    r = _split([prefill.url, decode.stub.url], 1)
    try:
        r.wait(lambda s: s["healthy"] == 2, what="both stubs healthy")
        t0 = time.time()
        status, body, _ = post(r.url, "/v1/completions", BODY, timeout=60)
        assert status == 502 and f"more than {MAX_HANDOFF} bytes" in body["error"]["message"]
        assert time.time() - t0 < 10
        time.sleep(0.5)
        assert not state["finished"] and state["written"] < 64 << 20, state
        assert decode.handoffs == []
    finally:
        r.close()
        prefill.close()
        decode.stub.close()


def test_a_prefill_instance_that_refuses_is_skipped_for_another(monkeypatch):
    """An instance that died between two health polls refuses the leg's connection: nothing
    was sent, so the leg goes to the next prefill instance and the client sees no error."""
    from laps_jax.cluster import http_router

    async def no_polls(*a, **k):  # each instance is as the test says (no health polls)
        await asyncio.Event().wait()
    monkeypatch.setattr(http_router, "poll_forever", no_polls)
    good, decode = Prefill(), Decode()
    dead = f"http://127.0.0.1:{free_port()}"
    r = _split([dead, good.stub.url, decode.stub.url], 2)
    try:
        async def all_healthy():  # the dead one, healthy and idle at its last poll, first
            for inst in r.router.instances:
                inst.mark_ok(parse_metrics(""), time.monotonic())
        r.call(all_healthy())
        assert r.status()["healthy"] == 3
        status, body, _ = post(r.url, "/v1/completions", BODY)
        assert status == 200 and body["choices"][0]["text"] == " ok", body
        assert good.stub.posts == 1 and len(decode.handoffs) == 1
        st = r.status()["instances"][0]
        assert not st["healthy"] and "ClientConnectorError" in st["last_error"], st
    finally:
        r.close()
        good.stub.close()
        decode.stub.close()
