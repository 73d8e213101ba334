"""The HTTP server in this process, on its own event-loop thread, over an engine a test already
has (nothing new compiles); tests talk to it over loopback and can patch its engine."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading

from aiohttp import web

from laps_jax.scheduler.dispatcher import Dispatcher
from laps_jax.server.app import create_app
from laps_jax.server.state import ServerState
from laps_jax.server.http_runner import make_runner
from laps_jax.server.shutdown import shut_down

MODEL = "ckpt"


class InProcessServer:
    def __init__(self, engine, tokenizer, *, read_timeout_s: float | None = 30.0,
                 max_request_bytes: int = 8 << 20, **state_kw):
        self.engine, self.tokenizer = engine, tokenizer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="inproc-server")
        self.thread.start()
        self.call(self._start(read_timeout_s, max_request_bytes, state_kw))

    def call(self, coro, timeout: float = 120):
        """Runs `coro` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, read_timeout_s, max_request_bytes, state_kw) -> None:
        self.dispatcher = Dispatcher(self.engine, "laps")
        await self.dispatcher.start()
        e = self.engine
        self.state = ServerState(self.dispatcher, [e], self.tokenizer, e.cfg.vocab_size,
                                 e.ecfg.max_model_len, (MODEL,), **state_kw)
        app = create_app(self.state, max_request_bytes)
        self.runner = make_runner(app, read_timeout_s, access_log=None,
                                  handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None, timeout: float = 120):
        """(status, parsed JSON or the raw text of an event stream, headers)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            raw = r.read()
            if r.getheader("Content-Type", "").startswith("text/event-stream"):
                return r.status, raw.decode(), dict(r.getheaders())
            return r.status, json.loads(raw) if raw else None, dict(r.getheaders())
        finally:
            conn.close()

    def post(self, path: str, body, **kw):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.request("POST", path, data, **kw)

    def stop(self, shutdown_timeout_s: float = 5.0) -> None:
        self.call(shut_down(self.state, self.dispatcher, self.runner, shutdown_timeout_s,
                            lambda msg: None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def is_json_error(body) -> bool:
    """The README's error shape: {"error": {"message", "type", "code", "param"}}."""
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and set(body["error"]) >= {"message", "type", "code", "param"}
            and isinstance(body["error"]["message"], str))


@contextlib.contextmanager
def serving(engine_for, layout: str = "gqa2_untied", **kw):
    """An `InProcessServer` over the shared engine of a test checkpoint layout, stopped after."""
    from laps_jax.text.tokenizer import Tokenizer
    engine, path = engine_for(layout)
    s = InProcessServer(engine, Tokenizer(path), **kw)
    try:
        yield s
    finally:
        s.stop()
