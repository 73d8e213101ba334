"""The network router (scripts/router.py, laps_jax/cluster/http_router.py) in front of two
real serve.py processes of a tiny checkpoint, on loopback (slow). Its bookkeeping and choices
without processes: test_router_books.py, test_router_pick.py."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request

import pytest

from laps_jax.cluster.policy import RouterConfig
from router_utils import (MODEL, WORDS, RouterThread, pages_used, post, sse,  # noqa: F401
                          stream_text)  # (test_pd_disagg.py and test_smg_gateway.py take them here)


@pytest.fixture(scope="module")
def routed(cluster):
    from laps_jax.text.tokenizer import Tokenizer
    path, procs = cluster
    r = RouterThread([p.url for p in procs], "round-robin", Tokenizer(path))
    r.wait(lambda s: s["healthy"] == 2, what="both instances healthy")
    yield r
    r.close()


@pytest.mark.slow
def test_greedy_output_through_the_router_equals_an_instance(cluster, routed):
    _, procs = cluster
    cases = [("/v1/completions", "completion",
              {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 20}),
             ("/v1/completions", "completion", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 12}),
             ("/v1/chat/completions", "chat",
              {"messages": [{"role": "user", "content": "Grüße 😀 hello"}], "max_tokens": 16})]
    for path, kind, body in cases:
        body = dict(body, temperature=0)
        status, direct, _ = post(procs[0].url, path, body)
        assert status == 200
        want = direct["choices"][0]["text" if kind == "completion" else "message"]
        want = want if kind == "completion" else want["content"]
        for _ in range(2):  # round-robin: once on each instance
            status, got, _ = post(routed.url, path, body)
            assert status == 200, got
            text = got["choices"][0]["text"] if kind == "completion" else \
                got["choices"][0]["message"]["content"]
            assert text == want
            assert got["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
            events = sse(routed.url, path, dict(body, stream=True,
                                                stream_options={"include_usage": True}))
            assert events[-1] == "[DONE]" and stream_text(events, kind) == want
            assert events[-2]["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    st = routed.status()
    assert all(i["routed"] >= 6 and i["healthy"] for i in st["instances"])
    with urllib.request.urlopen(routed.url + "/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [MODEL]
    with urllib.request.urlopen(routed.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'laps_router_instance_healthy{instance="%s"} 1.0' % procs[0].url in text
    assert "\nlaps_event_loop_stalls_total " in text  # the router's own loop watch


@pytest.mark.slow
def test_a_follow_up_turn_lands_where_its_history_is(routed):
    rng = random.Random(11)
    convs = [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]
             for _ in range(3)]

    def where(before, after):
        moved = [k for k in range(2) if after["instances"][k]["routed"] >
                 before["instances"][k]["routed"]]
        assert len(moved) == 1
        return moved[0]

    first = []
    for msgs in convs:  # round-robin spreads them: 0, 1, 0 (or 1, 0, 1)
        before = routed.status()
        _, r, _ = post(routed.url, "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 6, "temperature": 0})
        msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        msgs.append({"role": "user", "content": "and then?"})
        first.append((where(before, routed.status()), r["usage"]["prompt_tokens"]))
    assert {k for k, _ in first} == {0, 1}
    for msgs, (k, prompt1) in zip(reversed(convs), reversed(first)):
        before = routed.status()
        _, r, _ = post(routed.url, "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 4, "temperature": 0})
        assert where(before, routed.status()) == k
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt1 // 8 * 8
    assert routed.status()["by_affinity"] >= 3


@pytest.mark.slow
def test_laps_sends_short_and_long_work_to_their_groups(cluster):
    _, procs = cluster
    r = RouterThread([p.url for p in procs], "length-aware", threshold=32)
    try:
        st = r.wait(lambda s: s["healthy"] == 2, what="both healthy")
        assert [i["group"] for i in st["instances"]] == ["short", "long"]
        rng = random.Random(5)
        for n, k in ((10, 0), (100, 1), (20, 0), (200, 1)):  # (no shared prefixes)
            before = r.status()["instances"][k]["routed"]
            status, body, _ = post(r.url, "/v1/completions", {
                "prompt": [rng.randrange(3, 1000) for _ in range(n)], "max_tokens": 2})
            assert status == 200, body
            assert r.status()["instances"][k]["routed"] == before + 1
    finally:
        r.close()


@pytest.mark.slow
def test_a_skewed_burst_moves_an_instance_to_the_long_group_and_back(cluster):
    """laps with its groups on fast settings. Each group keeps one instance, so two instances
    could never move: the router gets three entries, the third a second route to instance 0
    (its load is reported twice, which the policy tolerates). Long prompts only: the short
    share of the compute falls to ~0 and one short entry joins the long group; a pause (the
    long work decays over tau) and then short prompts only: one long entry comes back."""
    from laps_jax.cluster.groups import GroupSettings
    _, procs = cluster
    fast = GroupSettings(share_tau_s=0.5, hysteresis=0.0, dwell_s=0.3, move_interval_s=0.2)
    r = RouterThread([procs[0].url, procs[1].url, procs[0].url], threshold=32,
                     config=RouterConfig(policy="laps", groups=fast))
    rng = random.Random(9)

    def burst(n_tokens: int, count: int) -> None:
        for _ in range(count):
            status, body, _ = post(r.url, "/v1/completions", {
                "prompt": [rng.randrange(3, 1000) for _ in range(n_tokens)], "max_tokens": 1})
            assert status == 200, body
            time.sleep(0.05)

    def sizes() -> tuple[int, int]:
        groups = [i["group"] for i in r.status()["instances"]]
        return groups.count("short"), groups.count("long")
    try:
        r.wait(lambda s: s["healthy"] == 3, what="three healthy entries")
        assert sizes() == (2, 1)
        burst(120, 8)
        st = r.status()
        assert sizes() == (1, 2) and st["moves"] == 1, st
        time.sleep(2.5)  # the long work decays (e^-5) and the dwell passes
        burst(8, 10)
        st = r.status()
        assert sizes() == (2, 1) and st["moves"] == 2, st
        assert [g[1:] for g in st["group_sizes"][-2:]] == [[1, 2], [2, 1]]
    finally:
        r.close()


@pytest.mark.slow
def test_aborted_requests_free_the_instance_pages(cluster, routed):
    _, procs = cluster
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    for _ in range(2):  # one on each instance
        events = sse(routed.url, "/v1/completions", body, stop_after=3)
        assert len(events) == 3
    import socket  # a non-streaming request whose client leaves before the answer
    with socket.create_connection(("127.0.0.1", int(routed.url.rsplit(":", 1)[1]))) as s:
        raw = json.dumps(dict(body, stream=False)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
        routed.wait(lambda st: sum(i["inflight"] for i in st["instances"]) == 1, 10,
                    "the request in flight")
    deadline = time.time() + 20
    while time.time() < deadline and any(pages_used(p.url) for p in procs):
        time.sleep(0.2)
    assert [pages_used(p.url) for p in procs] == [0, 0]
    routed.wait(lambda st: sum(i["inflight"] for i in st["instances"]) == 0, 5, "nothing in flight")


HOSTILE = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e999}'),
    ("/v1/completions", b"\xff\xfe\x00"),
    ("/v1/completions", b'{"prompt": 5}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "x"}'),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 9}'),
    ("/v1/completions", b'{"prompt": [1, -4]}'),
    ("/v1/completions", b'{"model": "nope", "prompt": "hi"}'),
    ("/v1/chat/completions", b'{"messages": "x"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}'),
]


@pytest.mark.slow
def test_hostile_requests_get_the_json_errors_serve_py_gives(cluster, routed):
    _, procs = cluster
    for path, raw in HOSTILE:
        direct = post(procs[0].url, path, raw=raw)
        got = post(routed.url, path, raw=raw)
        assert 400 <= got[0] < 500 and (got[0], got[1]) == (direct[0], direct[1]), raw
    status, body, _ = post(routed.url, "/v1/completions", raw=b'{"prompt": "' + b"a" * (5 << 20)
                           + b'"}')
    assert status == 413 and body["error"]["code"] == "request_too_large"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(routed.url + "/v1/nothing", timeout=10)
    assert e.value.code == 404 and "error" in json.loads(e.value.read())
    keyed = RouterThread([p.url for p in procs], api_key="sesame")
    try:
        keyed.wait(lambda s: s["healthy"] == 2)
        status, body, _ = post(keyed.url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body, _ = post(keyed.url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1},
                               headers={"Authorization": "Bearer sesame"})
        assert status == 200, body
    finally:
        keyed.close()


@pytest.mark.slow
def test_a_hung_instance_leaves_within_2_s_and_its_request_is_answered_by_the_other(
        cluster, routed):
    """A request in flight on a SIGSTOPped instance had no byte back: once the instance is
    down (within 2 s) it goes to the other instance, and the client sees only the answer."""
    import signal
    _, procs = cluster
    victim = procs[1]
    result = {}
    body = {"prompt": [7] * 20, "max_tokens": 400, "temperature": 0}
    want = post(procs[0].url, "/v1/completions", body)[1]["choices"][0]["text"]

    def slow_request(token: int):
        result["r"] = post(routed.url, "/v1/completions", dict(body, prompt=[token] * 20))
        result["t"] = time.time()

    # round-robin: send until one is in flight on the victim (a new prompt each time: a
    # repeated one would follow its cached history back to the same instance)
    t = None
    for attempt in range(2):
        t = threading.Thread(target=slow_request, args=(7 + attempt,))
        t.start()
        st = routed.wait(lambda s: sum(i["inflight"] for i in s["instances"]) == 1, 10)
        if st["instances"][1]["inflight"]:
            break
        t.join(120)
    if attempt == 1:  # (the victim's request is the second prompt)
        want = post(procs[0].url, "/v1/completions", dict(body, prompt=[8] * 20))[1][
            "choices"][0]["text"]
    victim.proc.send_signal(signal.SIGSTOP)
    stopped = time.time()
    try:
        routed.wait(lambda s: s["instances"][1]["state"] == "down", 2.0, "the victim down")
        t.join(120)
        assert not t.is_alive()
        status, got, _ = result["r"]
        assert status == 200 and got["choices"][0]["text"] == want, got
        assert time.time() - stopped < 60
        st = routed.status()
        assert st["instances"][1]["state"] == "down" and st["healthy"] == 1
        for _ in range(3):  # new requests go to the other
            assert post(routed.url, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2})[0] \
                == 200
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    routed.wait(lambda s: s["instances"][1]["healthy"], 10, "the instance back")


def _at_third_token(routed, act, record: dict):
    """An `sse` line callback: at the stream's third line, `act(k)` on the instance serving
    it, and `record` gets k and the time."""
    def on_line(i, _payload):
        if i == 2:
            st = routed.status()
            k = next(k for k, inst in enumerate(st["instances"]) if inst["inflight"])
            act(k)
            record.update(k=k, t=time.time())
    return on_line


def _stream_text(url: str, body: dict, on_line=None) -> tuple[str, list, list]:
    """(text, error events, [DONE] count) of a stream."""
    events = sse(url, "/v1/completions", body, on_line=on_line)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    return stream_text(events, "completion"), errors, events.count("[DONE]")


@pytest.mark.slow
def test_a_stream_on_a_hung_instance_resumes_on_the_other_within_2_s(cluster, routed):
    """The stream's reads are not raced against the instance's health one by one: the poller
    marking the instance down must still end the wait for its next token, and the stream goes
    on from the other instance with the text an uninterrupted run gives."""
    import signal
    _, procs = cluster
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    want = _stream_text(procs[0].url, body)[0]
    stopped, times = {}, []
    hang = _at_third_token(routed, lambda k: procs[k].proc.send_signal(signal.SIGSTOP), stopped)

    def on_line(i, payload):
        times.append(time.time())
        hang(i, payload)
    try:
        text, errors, done = _stream_text(routed.url, body, on_line)
    finally:
        if stopped:
            procs[stopped["k"]].proc.send_signal(signal.SIGCONT)
    assert text == want and errors == [] and done == 1
    after = [stopped["t"]] + [t for t in times if t > stopped["t"]]
    assert max(b - a for a, b in zip(after, after[1:])) < 2.5
    routed.wait(lambda s: s["instances"][stopped["k"]]["healthy"], 10, "the instance back")


@pytest.mark.slow
def test_sigkill_mid_stream_resumes_it_and_the_instance_rejoins_after_a_restart(
        cluster, routed):
    from server_utils import ServerProcess
    path, procs = cluster
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    want = _stream_text(procs[0].url, body)[0]
    killed = {}
    kill = _at_third_token(routed, lambda k: procs[k].proc.kill(), killed)
    text, errors, done = _stream_text(routed.url, body, kill)
    assert text == want and errors == [] and done == 1
    k = killed["k"]
    routed.wait(lambda s: not s["instances"][k]["healthy"], 2, "the dead instance out")
    for _ in range(4):
        status, r, _ = post(routed.url, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2})
        assert status == 200, r
    assert routed.status()["instances"][k]["state"] == "down"
    procs[k].stop()
    procs[k] = ServerProcess(path, "--served-model-name", MODEL, port=procs[k].port)
    routed.wait(lambda s: s["instances"][k]["healthy"], 10, "the restarted instance back")
    before = routed.status()["instances"][k]["routed"]
    for _ in range(2):
        assert post(routed.url, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2})[0] == 200
    assert routed.status()["instances"][k]["routed"] == before + 1
