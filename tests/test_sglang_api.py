"""SGLang's native endpoints on serve.py (server/sglang_api.py), in process over a test engine:
`/generate` gives the same greedy tokens as `/v1/completions`, whole and streamed; bad bodies
get a JSON 400; `/v1/loads` reports what `/metrics` reports; `/flush_cache` empties the prefix
cache when idle and refuses while a request runs."""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time

import pytest

from inproc_server import MODEL, is_json_error, serving


@pytest.fixture(scope="module")
def srv(engine_for):
    with serving(engine_for) as s:
        yield s


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1000 + time.time_ns() % 1000)
    return [rng.randrange(3, 900) for _ in range(n)]


def _chunks(sse: str) -> list:
    out = []
    for line in sse.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_generate_equals_completions_whole_and_streamed(srv):
    ids = _prompt(37, 1)
    status, ref, _ = srv.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 9,
                                                  "temperature": 0, "return_token_ids": True})
    assert status == 200
    want = ref["choices"][0]["token_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 9, "temperature": 0},
            "model": "unknown", "log_metrics": True}  # (what smg adds on the way)
    status, got, _ = srv.post("/generate", body)
    assert status == 200, got
    assert got["output_ids"] == want and got["text"] == ref["choices"][0]["text"]
    meta = got["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (37, 9)
    assert meta["cached_tokens"] > 0  # the same prompt again: its full pages are cached
    status, sse, _ = srv.post("/generate", dict(body, stream=True))
    chunks = _chunks(sse)
    assert status == 200 and chunks[-1] == "[DONE]"
    steps = [c["output_ids"] for c in chunks[:-1]]
    assert steps[-1] == want and all(steps[k] == want[:k + 1] for k in range(len(want)))
    assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-2]["text"] == ref["choices"][0]["text"]


def test_generate_text_prompt_and_stop(srv):
    status, ref, _ = srv.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 6,
                                                  "temperature": 0})
    status2, got, _ = srv.post("/generate", {"text": "Hello there", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "top_k": -1}})
    assert status == status2 == 200 and got["text"] == ref["choices"][0]["text"]


@pytest.mark.parametrize("body, param", [
    ({"text": "a", "input_ids": [5, 6]}, "input_ids"),
    ({}, "input_ids"),
    ({"input_ids": [[5, 6], [7, 8]]}, "input_ids"),
    ({"text": ["a", "b"]}, "text"),
    ({"input_ids": [5, 6], "sampling_params": {"ignore_eos": True}}, "sampling_params"),
    ({"input_ids": [5, 6], "sampling_params": [1]}, "sampling_params"),
    ({"input_ids": [5, 6], "return_logprob": True}, "return_logprob"),
    ({"input_ids": [5, 10 ** 9]}, "prompt"),
    ([1, 2], None),
])
def test_generate_bad_bodies_are_json_400(srv, body, param):
    status, got, _ = srv.post("/generate", body)
    assert status == 400 and is_json_error(got), got
    assert param is None or got["error"]["param"] == param


def _held(srv):
    """Patches the engine so its next prefill waits for the returned event."""
    engine = srv.engine
    gate, entered, prefill = threading.Event(), threading.Event(), engine.prefill

    def held(*a, **kw):
        entered.set()
        gate.wait(30)
        return prefill(*a, **kw)

    engine.prefill = held
    return gate, entered, lambda: setattr(engine, "prefill", prefill)


def test_loads_and_flush_cache(srv):
    gate, entered, restore = _held(srv)
    prompts = [_prompt(n, 3 + n) for n in (20, 60, 130)]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futs = [pool.submit(srv.post, "/v1/completions", {"prompt": prompts[0], "max_tokens": 3})]
            assert entered.wait(30)
            futs += [pool.submit(srv.post, "/v1/completions", {"prompt": p, "max_tokens": 3})
                     for p in prompts[1:]]
            deadline = time.time() + 10
            while time.time() < deadline:
                status, rep, _ = srv.request("GET", "/v1/loads?include=core")
                if rep["loads"][0]["num_waiting_reqs"] == len(prompts):
                    break
                time.sleep(0.05)
            load = rep["loads"][0]
            assert status == 200 and rep["dp_rank_count"] == 1
            assert load["num_waiting_reqs"] == 3 and load["num_running_reqs"] == 0
            assert load["num_waiting_uncached_tokens"] == sum(map(len, prompts))
            assert 0 < load["num_used_tokens"] < load["max_total_num_tokens"]
            assert load["token_usage"] == load["num_used_tokens"] / load["max_total_num_tokens"]
            status, busy, _ = srv.post("/flush_cache", b"")  # requests are live: refused
            assert status == 400 and busy["error"]["code"] == "busy"
            gate.set()
            assert all(f.result(60)[0] == 200 for f in futs)
    finally:
        gate.set()
        restore()
    load = srv.request("GET", "/v1/loads")[1]["loads"][0]
    assert (load["num_waiting_reqs"], load["num_running_reqs"], load["num_used_tokens"],
            load["num_waiting_uncached_tokens"]) == (0, 0, 0, 0)
    again = {"prompt": prompts[2], "max_tokens": 2}
    assert srv.post("/v1/completions", again)[1]["usage"]["prompt_tokens_details"][
        "cached_tokens"] > 0
    status, ok, _ = srv.post("/flush_cache", b"")
    assert status == 200 and ok["status"] == "ok"
    assert srv.engine.kv.num_free == srv.engine.kv.num_pages - 1 and not srv.engine.kv.by_hash
    assert srv.post("/v1/completions", again)[1]["usage"]["prompt_tokens_details"][
        "cached_tokens"] == 0


def test_api_key_guards_the_sglang_routes(srv):
    srv.state.api_key = "sekret"
    try:
        for method, path, body in (("POST", "/generate", b'{"input_ids": [5, 6]}'),
                                   ("POST", "/flush_cache", b""), ("GET", "/v1/loads", None)):
            status, got, _ = srv.request(method, path, body)
            assert status == 401 and got["error"]["code"] == "invalid_api_key", path
            status, _, _ = srv.request(method, path, body,
                                       headers={"Authorization": "Bearer sekret"})
            assert status == 200, path
    finally:
        srv.state.api_key = None
