"""What the router's failover asks of an instance (server/resume.py), on serve.py's app in this
process over a shared engine: each streamed token's id when the router asks, and a stream
resumed from the tokens the client already has, whose text, id, finish reason and usage are an
uninterrupted stream's (greedy and seeded: sampling is keyed by position, engine/sampling.py)."""

from __future__ import annotations

import json

import pytest

from inproc_server import serving
from laps_jax.engine.sampling import position_uniform
from laps_jax.server.resume import TOKEN_IDS_HEADER

IDS = {TOKEN_IDS_HEADER: "1"}


@pytest.fixture(scope="module")
def server(engine_for):
    with serving(engine_for) as s:
        yield s


def read_stream(raw: str) -> list[tuple[int | None, object]]:
    """(token id or None, data payload or None) per event of an SSE body."""
    out = []
    for event in raw.split("\n\n"):
        if not event:
            continue
        tid, data = None, None
        for line in event.split("\n"):
            if line.startswith(": id "):
                tid = int(line[5:])
            elif line.startswith("data: "):
                data = line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        out.append((tid, data))
    return out


def delta(data, kind: str) -> str:
    if not isinstance(data, dict) or not data.get("choices"):
        return ""
    c = data["choices"][0]
    return c["text"] if kind == "completion" else c["delta"].get("content") or ""


def stream(server, path: str, body: dict, headers=None) -> list:
    status, raw, _ = server.post(path, dict(body, stream=True), headers=headers)
    assert status == 200, raw
    return read_stream(raw)


def client_view(events, kind: str) -> tuple[str, str, dict | None, set]:
    """(text, finish reason, usage, response ids) as a client reads the stream."""
    datas = [d for _, d in events if isinstance(d, dict)]
    finish = [d["choices"][0]["finish_reason"] for d in datas if d.get("choices")
              and d["choices"][0]["finish_reason"]]
    usage = [d["usage"] for d in datas if d.get("usage")]
    return ("".join(delta(d, kind) for d in datas), finish[-1] if finish else None,
            usage[-1] if usage else None, {d["id"] for d in datas})


def counts(usage: dict | None) -> tuple | None:
    """Usage without cached_tokens (what this instance's cache held differs between runs)."""
    return None if usage is None else (usage["prompt_tokens"], usage["completion_tokens"])


def text_after(events, k: int, kind: str) -> str:
    """The text the client has once the events of the first k tokens reached it."""
    seen, text = 0, ""
    for tid, data in events:
        if seen == k:
            break
        seen += tid is not None
        text += delta(data, kind)
    return text


CASES = [  # (path, kind, body): greedy, seeded, a stop string, logprobs
    ("/v1/completions", "completion", {"prompt": "The quick brown fox", "max_tokens": 24,
                                       "temperature": 0}),
    ("/v1/completions", "completion", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 20,
                                       "temperature": 0.9, "seed": 1234, "logprobs": 2}),
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "Grüße 😀"}],
                                      "max_tokens": 20, "temperature": 1.0, "top_p": 0.9,
                                      "seed": 77, "stream_options": {"include_usage": True}}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_resumed_stream_reads_as_the_uninterrupted_one(server, case):
    path, kind, body = CASES[case]
    plain = stream(server, path, body)
    marked = stream(server, path, body, IDS)
    ids = [t for t, _ in marked if t is not None]
    want = client_view(plain, kind)
    # the ids are comments: the client's view is the same, one id per generated token
    got = client_view(marked, kind)
    assert got[:2] == want[:2] and counts(got[2]) == counts(want[2])
    if want[2] is not None:
        assert len(ids) == want[2]["completion_tokens"]
    (rid,) = got[3]
    created = next(d["created"] for _, d in marked if isinstance(d, dict))
    for k in sorted({0, 1, len(ids) // 2, len(ids) - 1, len(ids)}):
        more = stream(server, path, dict(body, laps_resume={
            "token_ids": ids[:k], "id": rid, "created": created}), IDS)
        text, finish, usage, rids = client_view(more, kind)
        assert text_after(marked, k, kind) + text == want[0], k
        assert finish == want[1] and rids == {rid}, k
        assert [t for t, _ in more if t is not None] == ids[k:]
        assert counts(usage) == counts(want[2])
        if kind == "chat":  # the role comes once, in the first chunk the client got
            roles = [d for _, d in more if isinstance(d, dict) and d.get("choices")
                     and "role" in d["choices"][0]["delta"]]
            assert len(roles) == (1 if k == 0 else 0)


def test_a_stop_string_that_spans_the_resume_point_still_stops(server):
    body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0}
    events = stream(server, "/v1/completions", body, IDS)
    full, _, _, (rid,) = client_view(events, "completion")
    ids = [t for t, _ in events if t is not None]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full.find(stop)  # where it first appears
    assert len(stop) == 3 and cut > 0
    stopped = stream(server, "/v1/completions", dict(body, stop=stop), IDS)
    want, reason, _, _ = client_view(stopped, "completion")
    assert want == full[:cut] and reason == "stop"
    n = len([t for t, _ in stopped if t is not None])
    for k in range(max(n - 4, 0), n + 1):
        more = stream(server, "/v1/completions", dict(body, stop=stop, laps_resume={
            "token_ids": ids[:k], "id": rid, "created": 1}), IDS)
        text, finish, _, _ = client_view(more, "completion")
        assert text_after(stopped, k, "completion") + text == want and finish == "stop", k


@pytest.mark.parametrize("resume,why", [
    ({"token_ids": [1], "id": "cmpl-abc", "created": 1}, "needs 'stream'"),
    ({"token_ids": [1] * 5, "id": "cmpl-abc", "created": 1}, "at most max_tokens (4)"),
    ({"token_ids": [-1], "id": "cmpl-abc", "created": 1}, "token ids in"),
    ({"token_ids": [1], "id": "chatcmpl-abc", "created": 1}, "'laps_resume.id'"),
    ({"token_ids": [1], "id": "cmpl-a\nb", "created": 1}, "'laps_resume.id'"),
    ({"token_ids": [1], "id": "cmpl-abc", "created": -1}, "'laps_resume.created'"),
    ({"token_ids": [1], "id": "cmpl-abc"}, "must be an object"),
    ([1, 2], "must be an object"),
])
def test_a_bad_resume_is_a_400_naming_the_field(server, resume, why):
    body = {"prompt": "hi", "max_tokens": 4, "laps_resume": resume,
            "stream": "needs 'stream'" not in why}
    status, got, _ = server.post("/v1/completions", body)
    assert status == 400 and why in got["error"]["message"], got
    assert got["error"]["param"].startswith("laps_resume")


def test_position_keyed_draws_are_uniform_and_independent_of_the_path():
    us = [position_uniform(42, i) for i in range(20000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.01
    assert sum(u < 0.1 for u in us) / len(us) == pytest.approx(0.1, abs=0.01)
    assert len(set(us)) > 19000 and us[:5] != [position_uniform(43, i) for i in range(5)]
