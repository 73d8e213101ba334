"""The router's poll of an instance: one GET /load from serve.py, /health + /metrics from a
server without it, and what a forged or broken answer does (its instance goes down with the
reason; the next good answer brings it back; the poller never stops)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from laps_jax.cluster.instances import MAX_POLL_BYTES, Instance, poll_forever, poll_once
from laps_jax.cluster.upstream import parse_load, parse_metrics
from router_utils import METRICS

# METRICS's gauges as serve.py's /load sends them
GAUGES = [["vllm:num_requests_waiting", {}, 2], ["vllm:num_requests_running", {}, 1.0],
          ["vllm:kv_cache_usage_perc", {}, 0.25],
          ["vllm:cache_config_info", {"block_size": "8", "num_gpu_blocks": "1024"}, 1.0],
          ["laps_pending_prefill_tokens", {"pool": "admission"}, 30.0],
          ["laps_pending_prefill_tokens", {"pool": "long"}, 300.0],
          ["laps_pending_prefill_tokens", {"pool": "short"}, 12],
          ["laps_kv_pages_used", {"engine": "0"}, 5.0]]
LOAD = {"status": "ok", "gauges": GAUGES}


class FakeInstance:
    """An HTTP server answering the poll's paths from `answers` (path -> (status, body)); a
    path missing there is a 404. `seen` lists the paths asked, in order."""

    def __init__(self, answers: dict[str, tuple[int, bytes]]):
        self.answers, self.seen = answers, []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(request.path)
        status, body = self.answers.get(request.path, (404, b'{"error": "no such route"}'))
        return web.Response(status=status, body=body, content_type="application/json")

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def _json(obj) -> tuple[int, bytes]:
    return 200, json.dumps(obj).encode()


MODELS = _json({"object": "list", "data": [{"id": "m", "max_model_len": 4096}]})


def test_load_reads_as_the_same_metrics_text_reads():
    assert parse_load(json.dumps(LOAD).encode()) == parse_metrics(METRICS)


async def _polls(fake: FakeInstance, n: int, inst: Instance | None = None) -> Instance:
    async with fake as url:
        inst = inst or Instance(url)
        inst.url = url
        async with aiohttp.ClientSession() as http:
            for _ in range(n):
                await poll_once(inst, http, timeout=2.0)
    return inst


def test_a_serve_instance_is_polled_with_one_read():
    fake = FakeInstance({"/load": _json(LOAD), "/v1/models": MODELS,
                         "/health": _json({"status": "ok"}), "/metrics": (200, METRICS.encode())})
    inst = asyncio.run(_polls(fake, 3))
    assert fake.seen == ["/load", "/v1/models", "/load", "/load"]
    assert inst.state == "ok" and inst.max_model_len == 4096
    assert inst.report.pending_tokens == 342.0 and inst.report.pending_short == 12.0
    assert inst.blocks.block_size == 8


def test_a_server_without_load_is_polled_on_health_and_metrics_until_it_goes_down():
    """404 to /load: /health then /metrics from then on; once down (it may come back as
    another server), /load is asked again."""
    fake = FakeInstance({"/v1/models": MODELS, "/health": _json({"status": "ok"}),
                         "/metrics": (200, METRICS.encode())})
    inst = asyncio.run(_polls(fake, 2))
    assert fake.seen == ["/load", "/health", "/metrics", "/v1/models", "/health", "/metrics"]
    assert inst.state == "ok" and inst.report.pending_tokens == 342.0
    inst.mark_down("gone")
    fake.seen.clear()
    asyncio.run(_polls(fake, 1, inst))
    assert fake.seen[:2] == ["/load", "/health"] and inst.state == "ok"


@pytest.mark.parametrize("status,body,why", [
    (503, {"status": "draining"}, "/load answered 503 (draining)"),
    (503, {"status": "stalled", "lanes": ["laps"]}, "(stalled)"),
    (500, "not json", "/load answered 500 (unhealthy)"),
])
def test_load_answering_unhealthy_takes_no_new_work(status, body, why):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    fake = FakeInstance({"/load": (status, raw), "/v1/models": MODELS})
    inst = asyncio.run(_polls(fake, 1))
    assert inst.state == "unavailable" and why in inst.last_error
    assert fake.seen == ["/load"]  # not taken for a server without /load


DEEP = b'{"status": "ok", "gauges": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("body,why", [
    (b"<html>ok</html>", "JSONDecodeError"),
    (b"[1, 2]", "'gauges' must be a list"),
    (json.dumps({"status": "ok", "gauges": {"a": 1}}).encode(), "'gauges' must be a list"),
    (json.dumps({"status": "ok", "gauges": [["x", {}, 1]] * 5000}).encode(), "at most"),
    (json.dumps({"gauges": [["laps_pending_prefill_tokens", {}, True]]}).encode(),
     "a gauge must be"),
    (json.dumps({"gauges": [["laps_pending_prefill_tokens", {"pool": 3}, 1]]}).encode(),
     "a gauge must be"),
    (json.dumps({"gauges": [["laps_pending_prefill_tokens", {}, -5]]}).encode(), "-5"),
    (b'{"gauges": [["vllm:num_requests_waiting", {}, NaN]]}', "nan"),
    (b'{"gauges": [["vllm:num_requests_waiting", {}, 1' + b"0" * 400 + b"]]}", "over 1e+15"),
    (json.dumps({"gauges": [["laps_short_threshold_tokens", {}, 0]]}).encode(), "outside"),
    (DEEP, "nested too deep"),
    (b" " * (MAX_POLL_BYTES + 1), "over 1024 KiB"),
])
def test_a_forged_load_answer_fails_its_instance_alone(body, why):
    """The instance goes down with the reason, its last good report and cached blocks
    dropped (as for an unreadable /metrics); the next good answer brings it back."""
    fake = FakeInstance({"/load": _json(LOAD), "/v1/models": MODELS})

    async def go():
        async with fake as url:
            inst = Instance(url)
            async with aiohttp.ClientSession() as http:
                await poll_once(inst, http, timeout=5.0)
                first = inst.state
                inst.blocks.add(list(range(32)))  # 4 blocks of 8 routed there
                fake.answers["/load"] = (200, body)
                await poll_once(inst, http, timeout=5.0)
                forged = (inst.state, inst.last_error, len(inst.blocks))
                fake.answers["/load"] = _json(LOAD)
                await poll_once(inst, http, timeout=5.0)
                return first, forged, inst

    first, (state, error, blocks), inst = asyncio.run(go())
    assert first == "ok" and state == "down" and why in error and blocks == 0, error
    assert inst.state == "ok" and inst.report.pending_tokens == 342.0


@pytest.mark.parametrize("models", [[1, 2], {"data": 5}, {"data": [{"max_model_len": True}]}])
def test_a_forged_models_answer_neither_counts_nor_stops_the_poller(models):
    """/v1/models answering something other than {"data": [...]} takes the instance down (a
    list there once escaped the poll as an AttributeError and ended the instance's poller);
    a bool is not a context length."""
    fake = FakeInstance({"/load": _json(LOAD), "/v1/models": _json(models)})

    async def go():
        async with fake as url:
            inst = Instance(url)
            async with aiohttp.ClientSession() as http:
                task = asyncio.create_task(poll_forever(inst, http, interval=0.05, timeout=2.0))
                await asyncio.sleep(0.3)
                states = (inst.state, inst.last_error, inst.max_model_len)
                fake.answers["/v1/models"] = MODELS
                await asyncio.sleep(0.3)
                alive = not task.done()
                task.cancel()
                return states, alive, inst

    (state, error, max_len), alive, inst = asyncio.run(go())
    assert alive and inst.state == "ok"
    if isinstance(models, dict) and isinstance(models["data"], list):  # read, no length in it
        assert state == "ok" and max_len is None and inst.max_model_len is None
    else:  # down, then read again once it answers well
        assert state == "down" and "/v1/models" in error and inst.max_model_len == 4096
