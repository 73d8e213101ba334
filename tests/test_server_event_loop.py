"""The event loop only does I/O (issue 22): /health answers fast while a multi-megabyte prompt
is refused, whether its size alone refuses it or it has to be tokenized first."""

from __future__ import annotations

import concurrent.futures
import statistics
import time

import pytest

from inproc_server import InProcessServer, is_json_error

POLL_S = 0.03
PROMPT = "the quick brown fox jumps over the lazy dog, again and again. " * 52_000  # 3.3 MB


class Unbounded:
    """The test tokenizer without a size bound: the prompt must be tokenized to be refused."""

    max_token_bytes = None

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from laps_jax.text.tokenizer import Tokenizer
    return Tokenizer(checkpoint("gqa2_untied"))


@pytest.fixture(scope="module")
def srv(engine_for, tokenizer):
    engine, _ = engine_for("gqa2_untied")
    s = InProcessServer(engine, tokenizer)
    yield s
    s.stop()


def _health_during(srv, path: str, body: dict) -> tuple[list[float], tuple, float]:
    """/health latencies (s) polled while `body` is being answered, its answer, its time.

    The latencies include the gaps between polls: this client is in the server's process, so a
    tokenizer holding the GIL would freeze the poller too, and only a gap would show it."""
    lat = []
    last = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        fut = pool.submit(srv.post, path, body)
        time.sleep(0.02)
        while not fut.done() or len(lat) < 3:
            t = time.perf_counter()
            status, got, _ = srv.request("GET", "/health", timeout=10)
            done = time.perf_counter()
            lat.append(max(done - t, done - last - POLL_S))
            last = done
            assert status == 200 and got["status"] == "ok"
            time.sleep(POLL_S)
        answer = fut.result()
        took = time.perf_counter() - t0
    return lat, answer, took


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": 4}),
])
def test_size_bound_refuses_before_tokenizing(srv, path, body):
    lat, (status, got, _), took = _health_during(srv, path, body)
    assert status == 400 and got["error"]["code"] == "context_length_exceeded", got
    assert took < 2.0, took  # tokenizing it takes seconds; the bound answers at once
    assert statistics.median(lat) < 0.1 and max(lat) < 0.5, lat


def test_health_answers_while_a_huge_prompt_tokenizes(srv, tokenizer):
    srv.state.tokenizer = Unbounded(tokenizer)
    try:
        lat, (status, got, _), took = _health_during(
            srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    finally:
        srv.state.tokenizer = tokenizer
    assert status == 400 and is_json_error(got) and "maximum context length" in \
        got["error"]["message"], got
    assert len(lat) >= 5, (lat, took)  # it was busy long enough to be polled
    assert statistics.median(lat) < 0.1 and max(lat) < 0.5, lat
