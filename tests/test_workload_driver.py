"""The session driver (`workload.driver`) with fake submit functions on a fake clock, and the
HTTP replayer's use of it (a failed turn ends its session; the rest is recorded not sent)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from laps_jax.workload.driver import SessionPacing, SessionTurn, run_session, run_sessions
from laps_jax.workload.http_client import ReplayConfig, RequestRecord, ServerInfo
from laps_jax.workload.http_replay import _Runner
from laps_jax.workload.records import TokenSpace
from laps_jax.workload.sessions import Session, SessionTrace, Turn

SPACE = TokenSpace(vocab_size=5000, seed=2)
SERVICE_S = 0.75  # every fake answer takes this long


class FakeClock:
    """One session's clock: time moves only when the driver sleeps or a fake server answers."""

    def __init__(self, t: float = 100.0):
        self.t = t
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += max(seconds, 0.0)
        await asyncio.sleep(0)


def _session(sid: str = "s", arrival: float = 3.0, n: int = 4) -> Session:
    turns = [Turn(40 + 7 * k, 5 + k, think_s=2.0 + k) for k in range(n)]
    return Session(sid, arrival, turns)


class FakeServer:
    """Answers each turn after SERVICE_S with ids no prompt contains; records what it saw."""

    def __init__(self, clock: FakeClock, fail_at: int | None = None):
        self.clock, self.fail_at = clock, fail_at
        self.seen: list[tuple[SessionTurn, float]] = []  # (turn, clock when submitted)
        self.done: list[float] = []

    async def submit(self, turn: SessionTurn) -> list[int] | None:
        self.seen.append((turn, self.clock.now()))
        self.clock.t += SERVICE_S
        self.done.append(self.clock.now())
        if turn.index == self.fail_at:
            return None
        return [10_000 + 100 * turn.index + i for i in range(turn.max_tokens)]


def _run(session: Session, server: FakeServer, pacing: SessionPacing, start: float = 100.0):
    return asyncio.run(run_session(session, SPACE, server.submit, server.clock, start, pacing))


def test_turns_go_in_order_and_each_prompt_is_the_last_one_plus_its_answer_plus_new_input():
    s, server = _session(), FakeServer(FakeClock())
    end = _run(s, server, SessionPacing())
    assert end.sent == 4 and end.reason == "done"
    turns = [t for t, _ in server.seen]
    assert [t.request_id for t in turns] == ["s/0", "s/1", "s/2", "s/3"]
    assert turns[0].prompt == s.new_input_ids(0, SPACE)
    for prev, cur in zip(turns, turns[1:]):
        answer = [10_000 + 100 * prev.index + i for i in range(prev.max_tokens)]
        history = prev.prompt + answer
        assert cur.prompt[:len(history)] == history
        assert cur.prompt[len(history):] == s.new_input_ids(cur.index, SPACE)
        assert cur.new_tokens == s.turns[cur.index].new_input_tokens
        assert cur.cached_tokens == len(history)


@pytest.mark.parametrize("time_scale,late_s", [(1.0, 0.0), (0.5, 0.0), (2.0, 0.125)])
def test_think_time_counts_from_the_answer_and_is_scaled(time_scale, late_s):
    s, server = _session(), FakeServer(FakeClock())
    _run(s, server, SessionPacing(time_scale=time_scale, late_s=late_s))
    (first, sent0), *later = server.seen
    assert first.arrival_s == pytest.approx(100.0 + s.arrival_s * time_scale)
    assert sent0 == pytest.approx(first.arrival_s + late_s)
    for (turn, sent), prev_done in zip(later, server.done):
        think = s.turns[turn.index].think_s * time_scale
        assert turn.arrival_s == pytest.approx(prev_done + think)
        assert sent == pytest.approx(turn.arrival_s + late_s)  # submitted when due, not before


def test_a_failed_turn_ends_its_session():
    s, server = _session(), FakeServer(FakeClock(), fail_at=1)
    end = _run(s, server, SessionPacing())
    assert (end.sent, end.reason) == (2, "failed")
    assert [t.index for t, _ in server.seen] == [0, 1]


def test_max_len_ends_a_conversation_before_the_turn_that_would_not_fit():
    s = _session()
    first_two = len(s.new_input_ids(0, SPACE)) + 5 + s.turns[1].new_input_tokens + 6
    server = FakeServer(FakeClock())
    end = _run(s, server, SessionPacing(max_len=first_two + 1, max_output=6))
    assert (end.sent, end.reason) == (2, "max_len")
    assert [t.max_tokens for t, _ in server.seen] == [5, 6]  # turn 1 asked 6: at the cap


def test_max_output_caps_what_a_turn_asks_for():
    server = FakeServer(FakeClock())
    _run(_session(), server, SessionPacing(max_output=6))
    assert [t.max_tokens for t, _ in server.seen] == [5, 6, 6, 6]


def test_sessions_run_at_once_from_one_start():
    """Several sessions on one clock: each first turn at the common start + its arrival (the
    clock has moved by the time the second session begins: its start is not read then)."""
    clock = FakeClock(t=50.0)
    starts: dict[str, float] = {}

    async def submit(turn: SessionTurn) -> list[int]:
        starts.setdefault(turn.session.session_id, turn.arrival_s)
        await asyncio.sleep(0)
        return [1]

    trace = SessionTrace("t", [_session("a", 2.0, 2), _session("b", 1.0, 3)], SPACE)
    ends = asyncio.run(run_sessions(trace, submit, clock))
    assert [e.sent for e in ends] == [2, 3]
    assert starts == {"a": 52.0, "b": 51.0}


class _FakeHttp(_Runner):
    """The HTTP runner with its network call replaced: turn `fail_at` gets an HTTP 500."""

    def __init__(self, fail_at: int):
        super().__init__(None, "http://x", ServerInfo("m", None), ReplayConfig(progress=False), 4)
        self.fail_at = fail_at
        self.sent: list[int] = []

    async def send(self, rec: RequestRecord, prompt_ids: list[int]) -> list[int]:
        self.sent.append(rec.turn)
        rec.status, rec.error = (500, "HTTP 500") if rec.turn == self.fail_at else (200, None)
        return [7, 8]


def test_http_stops_a_session_at_a_failed_turn_and_records_the_rest_not_sent():
    s = Session("h", 0.0, [Turn(4, 2, think_s=0.0) for _ in range(4)])
    recs = [RequestRecord(f"h/{k}", 0.0 if k == 0 else None, 2, "h", k) for k in range(4)]
    runner = _FakeHttp(fail_at=1)
    asyncio.run(runner.session(s, SPACE, recs))
    runner.bar.close()
    assert runner.sent == [0, 1]
    assert [r.ok for r in recs[:2]] == [True, False]
    assert all(r.arrival_s is not None for r in recs[:2])
    for r in recs[2:]:
        assert r.error == "not sent: turn 1 of the session failed" and r.sent_s is None


@contextlib.asynccontextmanager
async def _served(app):
    """`app` on a free loopback port while the block runs: its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def test_a_stream_s_error_event_is_the_request_s_error():
    """A router ends a stream whose instance failed with an error event and [DONE] (HTTP 200
    already sent): the replay must record that message, not just a missing finish reason."""
    import json
    import time

    import aiohttp
    from aiohttp import web

    from laps_jax.workload.http_client import stream_completion

    async def answer(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for tok in (5, 6):
            await resp.write(b"data: " + json.dumps({"choices": [
                {"token_ids": [tok], "text": "x", "finish_reason": None}]}).encode() + b"\n\n")
        await resp.write(b'data: {"error": {"message": "the instance serving this request '
                         b'failed: boom", "code": "upstream_failed"}}\n\ndata: [DONE]\n\n')
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        rec = RequestRecord("r", 0.0, 8)
        async with _served(app) as url, aiohttp.ClientSession() as http:
            ids = await stream_completion(http, url, "m", [1, 2], rec,
                                          ReplayConfig(progress=False), time.perf_counter())
        return ids, rec

    ids, rec = asyncio.run(go())
    assert ids == [] and not rec.ok and rec.ttft_s is not None
    assert rec.error == "error event: the instance serving this request failed: boom"


def test_a_503_from_v1_models_is_asked_again_until_the_wait_runs_out():
    """A router answers 503 while no instance is available (a stall of the machine): the
    replay asks again instead of ending there, and gives up with the status and the wait
    once `unavailable_wait_s` has passed. Any other status ends it at once."""
    import aiohttp
    from aiohttp import web

    from laps_jax.workload.http_client import fetch_server_info

    async def go(statuses: list[int], wait_s: float):
        asked = []

        async def models(request):
            asked.append(1)
            status = statuses.pop(0) if statuses else 200
            if status != 200:
                return web.json_response({"error": {"message": "no instance is available"}},
                                         status=status)
            return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        async with _served(app) as url, aiohttp.ClientSession() as http:
            try:
                out = await fetch_server_info(http, url, ReplayConfig(progress=False),
                                              unavailable_wait_s=wait_s, retry_s=0.02)
            except RuntimeError as e:
                out = e
        return len(asked), out

    asked, info = asyncio.run(go([503, 503], 5.0))
    assert asked == 3 and info == ServerInfo("m", 64)
    asked, err = asyncio.run(go([503] * 1000, 0.2))
    assert isinstance(err, RuntimeError) and 3 <= asked < 1000
    assert "answered 503 (503 for 0.2 s)" in str(err) and "no instance is available" in str(err)
    asked, err = asyncio.run(go([500, 503], 5.0))
    assert asked == 1 and "answered 500:" in str(err)
