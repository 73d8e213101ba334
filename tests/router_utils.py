"""Shared by the router tests: an idle router made in this process (or as router.py makes
it), the router app on its own thread in front of real instances, and small HTTP clients."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import SERVED_MODEL as MODEL  # noqa: F401 (the `cluster` fixture serves it)

from laps_jax.cluster.http_router import HTTPRouter
from laps_jax.cluster.policy import RouterConfig
from laps_jax.cluster.upstream import parse_metrics

METRICS = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="8",num_gpu_blocks="1024"} 1.0
# TYPE laps_pending_prefill_tokens gauge
laps_pending_prefill_tokens{pool="admission"} 30.0
laps_pending_prefill_tokens{pool="long"} 300.0
laps_pending_prefill_tokens{pool="short"} 12.0
# TYPE laps_kv_pages_used gauge
laps_kv_pages_used{engine="0"} 5.0
"""


def idle_router(n=2, policy="least-load", **kw) -> HTTPRouter:
    r = HTTPRouter([f"http://127.0.0.1:{9000 + k}" for k in range(n)],
                   RouterConfig(policy=policy), **kw)
    for inst in r.instances:
        inst.mark_ok(parse_metrics(METRICS.replace("342", "0")), 0.0)
    return r


def cli_router(*flags: str, n: int = 2) -> HTTPRouter:
    """A router as `scripts/router.py` makes it from `flags`, its instances idle and healthy."""
    from laps_jax.cluster.router_cli import build_parser, make_router
    urls = [a for k in range(n) for a in ("--instance", f"http://127.0.0.1:{9000 + k}")]
    r = make_router(build_parser().parse_args(urls + list(flags)))
    for inst in r.instances:
        inst.mark_ok(parse_metrics(METRICS.replace("342", "0")), 0.0)
    return r


def refused(flag: str, values) -> None:
    """router.py refuses each value of `flag`, naming the flag."""
    from laps_jax.cluster.router_cli import build_parser, make_router
    for bad in values:
        args = build_parser().parse_args(["--instance", "http://127.0.0.1:9000", flag, bad])
        with pytest.raises(ValueError, match=flag):
            make_router(args)


WORDS = ("apple river stone cloud seven orange quiet laptop mountain signal garden window "
         "yellow engine pocket silver").split()


class RouterThread:
    """The router app in this process, on its own event-loop thread, on a free port."""

    def __init__(self, urls, policy="round-robin", tokenizer=None, api_key=None,
                 config: RouterConfig | None = None, **kw):
        from laps_jax.cluster.http_router import create_router_app
        from laps_jax.server.http_runner import make_runner
        self.router = HTTPRouter(urls, config or RouterConfig(policy=policy),
                                 tokenizer=tokenizer, **kw)
        self.app = create_router_app(self.router, api_key)
        self.key = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.runner = make_runner(self.app, 30.0, access_log=None, handler_cancellation=True)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start())

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        from aiohttp import web
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def status(self) -> dict:
        req = urllib.request.Request(self.url + "/router/status", headers=self.key)
        with urllib.request.urlopen(req, timeout=10) as r:  # (behind the key, when set)
            return json.loads(r.read())

    def wait(self, pred, timeout: float = 30.0, what: str = "") -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.status()
            if pred(s):
                return s
            time.sleep(0.1)
        raise AssertionError(f"router status never showed {what}: {self.status()}")

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class StubInstance:
    """A stand-in instance on its own event-loop thread: healthy to the router's polls (serving
    `model`), and `completions(request)` answers its POST /v1/completions."""

    def __init__(self, completions, model: str = MODEL):
        from aiohttp import web
        app = web.Application()

        async def ok(request):
            return web.json_response({"status": "ok"})

        async def models(request):
            return web.json_response({"object": "list", "data": [
                {"id": model, "object": "model", "max_model_len": 512}]})

        async def metrics(request):
            return web.Response(text="")

        self.posts = 0

        async def counted(request):
            self.posts += 1
            return await completions(request)

        app.router.add_post("/v1/completions", counted)
        app.router.add_get("/health", ok)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
            return self.runner.addresses[0][1]
        port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def post(url: str, path: str, body=None, raw: bytes | None = None, headers=None,
         timeout: float = 120):
    """(status, JSON body, headers)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def sse(url: str, path: str, body: dict, stop_after: int | None = None, on_line=None):
    """The `data:` payloads of a stream (JSON decoded, "[DONE]" as is); `stop_after` lines
    then the client goes away; `on_line(i, payload)` after each."""
    import aiohttp

    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            async with s.post(url + path, json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    out.append(data.decode() if data == b"[DONE]" else json.loads(data))
                    if on_line is not None:
                        on_line(len(out), out[-1])
                    if stop_after is not None and len(out) >= stop_after:
                        break
        return out
    return asyncio.run(go())


def stream_text(events, kind: str) -> str:
    if kind == "completion":
        return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)
                       and e.get("choices"))
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def pages_used(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode()).pages_used
