"""No request can hurt another (issue 22): one whose data breaks admission or a step fails
alone, with an error, its pages freed, never retried; the requests batched with it finish with
all their tokens; and /health turns 503 while a lane is stuck with work waiting."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

from inproc_server import MODEL, InProcessServer, is_json_error

FAIL_PREFILL, FAIL_DECODE, HANG = 1001, 1002, 1003  # top_k values marking a hostile request


@pytest.fixture(scope="module")
def srv(engine_for):
    from laps_jax.text.tokenizer import Tokenizer
    engine, path = engine_for("gqa2_untied")
    s = InProcessServer(engine, Tokenizer(path), stall_after_s=0.4)
    yield s
    s.stop()


@pytest.fixture
def hostile_pack(srv, monkeypatch):
    """runner.pack raises for a marked request (as the int32 top_k overflow did), in the step
    kind its mark names; `calls` counts the failures."""
    runner = srv.engine.runner
    pack = runner.pack
    calls = {"prefill": 0, "decode": 0}

    def patched(seqs, bucket):
        for s in seqs:
            if s.top_k == FAIL_PREFILL and bucket.tokens > 1:
                calls["prefill"] += 1
                raise OverflowError("Python int too large to convert to C int (test)")
            if s.top_k == FAIL_DECODE and bucket.tokens == 1:
                calls["decode"] += 1
                raise OverflowError("Python int too large to convert to C int (test)")
            if s.top_k == HANG and bucket.tokens > 1:  # its prefill takes 2 s
                time.sleep(2.0)
        return pack(seqs, bucket)

    monkeypatch.setattr(runner, "pack", patched)
    return calls


def _pages_back(srv, timeout: float = 10.0) -> int:
    deadline = time.time() + timeout
    while srv.engine.kv.num_used and time.time() < deadline:
        time.sleep(0.05)
    return srv.engine.kv.num_used


def _innocent(i: int) -> dict:
    return {"model": MODEL, "prompt": [(7 * i + k) % 200 + 3 for k in range(5 + 9 * i)],
            "max_tokens": 12, "temperature": 0, "return_token_ids": True}


def test_hostile_requests_in_a_batch_fail_alone(srv, hostile_pack):
    innocents = [_innocent(i) for i in range(8)]
    reference = [srv.post("/v1/completions", b)[1]["choices"][0]["token_ids"]
                 for b in innocents]
    hostile = [dict(_innocent(20), top_k=FAIL_PREFILL, max_tokens=5),
               dict(_innocent(21), top_k=FAIL_DECODE, max_tokens=5),
               dict(_innocent(22), top_k=FAIL_DECODE, max_tokens=5, stream=True)]
    failed_before = srv.dispatcher.counts["failed"]
    bodies = innocents[:4] + hostile[:2] + innocents[4:] + hostile[2:]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda b: srv.post("/v1/completions", b), bodies))
    by_body = {id(b): r for b, r in zip(bodies, results)}
    for body, ref in zip(innocents, reference):
        status, got, _ = by_body[id(body)]
        assert status == 200, got
        choice = got["choices"][0]
        assert choice["finish_reason"] in ("length", "stop") and choice["token_ids"] == ref
    for body in hostile[:2]:
        status, got, _ = by_body[id(body)]
        assert status == 500 and is_json_error(got), got
        assert got["error"]["code"] == "request_failed" and "OverflowError" in \
            got["error"]["message"]
    status, text, _ = by_body[id(hostile[2])]
    events = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    assert status == 200 and is_json_error(events[-1]) and text.rstrip().endswith("[DONE]")
    assert srv.dispatcher.counts["failed"] - failed_before == 3
    # each hostile request failed a bounded number of times (its batches' halves), once alone
    assert 1 <= hostile_pack["prefill"] <= 4 and 2 <= hostile_pack["decode"] <= 8
    assert _pages_back(srv) == 0 and srv.dispatcher.live == {}
    status, again, _ = srv.post("/v1/completions", innocents[0])
    assert status == 200 and again["choices"][0]["token_ids"] == reference[0]


def test_bad_seed_fails_in_admission_alone(srv):
    """A seed numpy refuses (the protocol refuses it first; here it reaches the scheduler
    directly) fails that request in admission: no pages taken, not retried; the requests
    admitted with it run."""
    from laps_jax.engine.sequence import SamplingParams
    engine = srv.engine
    admits = []
    admit = engine.admit

    def counting(seq):
        admits.append(seq.params.seed)
        return admit(seq)

    engine.admit = counting
    try:
        async def run():
            d = srv.dispatcher
            good = [d.submit([5, 6, 7, 8 + i], SamplingParams(max_tokens=6)) for i in range(3)]
            bad = d.submit([5, 6, 7, 9], SamplingParams(max_tokens=6, seed=-1))
            more = d.submit([9, 9, 9], SamplingParams(max_tokens=6, seed=-2 ** 70))
            stats = [await h.result() for h in good + [bad, more]]
            return stats, bad.error, [len(h.tokens) for h in good]
        stats, error, lengths = srv.call(run(), timeout=60)
    finally:
        del engine.admit
    assert [s.finish_reason for s in stats[:3]] == ["length"] * 3 and lengths == [6, 6, 6]
    assert stats[3].finish_reason == "error" and "non-negative" in error
    assert stats[4].finish_reason == "error"
    assert admits.count(-1) == 1  # never retried
    assert _pages_back(srv) == 0


def test_health_turns_503_while_a_lane_is_stuck(srv, hostile_pack):
    status, body, _ = srv.request("GET", "/health")
    assert status == 200 and body["status"] == "ok"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(srv.post, "/v1/completions", dict(_innocent(3), top_k=HANG))
        seen = []
        while not fut.done():
            seen.append(srv.request("GET", "/health")[:2])
            time.sleep(0.1)
        assert fut.result()[0] == 200
    assert any(s == 503 and b["status"] == "stalled" for s, b in seen), seen
    assert srv.request("GET", "/health")[0] == 200
