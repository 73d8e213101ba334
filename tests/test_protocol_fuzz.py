"""Property: whatever a client sends to either endpoint, the answer is a 200 or a 4xx JSON error,
never a 500, and afterwards the server holds no pages and serves a normal request (issue 22).

Bodies are random field types, extreme numbers (past int32, int64, float32 and float64, a
5,000-digit integer, NaN), random unicode (lone surrogates included) and random nesting (to
100,000 levels), spliced into JSON as raw text where Python's json could not write them."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from inproc_server import MODEL, is_json_error, serving


@dataclasses.dataclass(frozen=True)
class Raw:
    """JSON text spliced in as it is."""

    text: str


def dump(v) -> str:
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(dump(x) for x in v) + "]"
    return json.dumps(v)


RAW_NUMBERS = [Raw("9" * 5000), Raw("1" + "0" * 400), Raw("-" + "7" * 4301), Raw("1e999"),
               Raw("-1e999"), Raw("NaN"), Raw("Infinity"), Raw("1e-400"), Raw("-0")]
EXTREME = [0, -1, 1, 2, 2 ** 31 - 1, 2 ** 31, -2 ** 31 - 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64,
           -2 ** 63, 10 ** 100, 1e-40, 5e-324, 1e-7, 1.17e-38, 3.5e38, 1.7e308, -0.0, 0.5, 1.0,
           2.0, 2.0000001, 0.9999999]
NASTY_TEXT = ["", "\ud800", "a\udfffb", "\x00", "\u202e\u0301", "😀" * 20, "<|im_end|>",
              "<|endoftext|>", "\ufeff", "\U0010ffff", " " * 200, "{{ raise }}", "{%"]
DEEP = [Raw("[" * 100_000 + "]" * 100_000), Raw("[" * 990 + "]" * 990),
        Raw('{"a":' * 5000 + "1" + "}" * 5000)]

text = st.text(max_size=40) | st.sampled_from(NASTY_TEXT)
number = (st.sampled_from(EXTREME) | st.sampled_from(RAW_NUMBERS) | st.integers()
          | st.floats(allow_nan=True, allow_infinity=True))
leaf = st.none() | st.booleans() | number | text
nested = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(text, inner, max_size=3), max_leaves=8)
anything = leaf | nested | st.sampled_from(DEEP)
small_int = st.integers(min_value=1, max_value=4)

# valid bodies (small max_tokens, so a valid request ends fast) ...
good_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)
good_prompt = good_text | st.lists(st.integers(min_value=0, max_value=1000), min_size=1,
                                   max_size=12)
good_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system"]), "content": good_text}), min_size=1, max_size=3)
GOOD = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2 ** 63 - 1), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.lists(good_text, max_size=2), "model": st.just(MODEL),
    "return_token_ids": st.booleans(),
}
completion = st.fixed_dictionaries({"prompt": good_prompt, "max_tokens": small_int},
                                   optional=dict(GOOD, logprobs=st.integers(0, 5)))
chat = st.fixed_dictionaries({"messages": good_messages, "max_tokens": small_int},
                             optional=dict(GOOD, logprobs=st.booleans(),
                                           top_logprobs=st.integers(0, 5)))
# ... with one to three fields replaced by anything at all ...
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "n", "stop", "stream", "stream_options", "model", "logprobs",
          "top_logprobs", "echo", "presence_penalty", "logit_bias", "return_token_ids", "tools"]
hostile_value = anything | number | text | st.sampled_from(DEEP) | st.fixed_dictionaries(
    {"include_usage": anything}) | st.lists(st.fixed_dictionaries({}, optional={
        "role": anything, "content": anything, "name": anything}), max_size=3)
overrides = st.lists(st.tuples(st.sampled_from(FIELDS), hostile_value), min_size=1, max_size=3)


def _override(pair):
    body, changes = pair
    return dict(body, **dict(changes))


endpoint = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
request = (st.tuples(st.just("/v1/completions"), completion)
           | st.tuples(st.just("/v1/chat/completions"), chat)
           | st.tuples(st.just("/v1/completions"), st.tuples(completion, overrides).map(_override))
           | st.tuples(st.just("/v1/chat/completions"), st.tuples(chat, overrides).map(_override))
           # ... and bodies that are not requests at all
           | st.tuples(endpoint, anything))


@pytest.fixture(scope="module")
def srv(engine_for):
    with serving(engine_for) as s:
        yield s


def _check(srv, path: str, body) -> int:
    status, got, _ = srv.post(path, dump(body).encode("utf-8", "surrogatepass"))
    assert status == 200 or 400 <= status < 500, (status, got)
    if status != 200:
        assert is_json_error(got), got
    elif isinstance(got, str):  # an event stream
        assert got.rstrip().endswith("data: [DONE]"), got
    else:
        assert got["choices"][0]["finish_reason"] in ("length", "stop"), got
    return status


def test_any_request_gets_200_or_a_4xx_json_error(srv):
    seen: dict[int, int] = {}

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request)
    def prop(req):
        status = _check(srv, *req)
        seen[status] = seen.get(status, 0) + 1

    prop()
    assert seen.get(200, 0) >= 10 and sum(seen.values()) >= 150, seen
    deadline = time.time() + 10
    while (srv.engine.kv.num_used or srv.dispatcher.live) and time.time() < deadline:
        time.sleep(0.05)
    assert srv.engine.kv.num_used == 0 and srv.dispatcher.live == {}
    status, got, _ = srv.post("/v1/completions", {"model": MODEL, "prompt": "Hello there",
                                                  "max_tokens": 5, "temperature": 0})
    assert status == 200 and got["usage"]["completion_tokens"] == 5
    status, got, _ = srv.request("GET", "/health")
    assert status == 200 and got["status"] == "ok"
