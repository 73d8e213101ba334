"""The aiohttp runner the server runs under: JSON for HTTP parser errors, and read timeouts.

aiohttp answers what its HTTP parser refuses (a header line over 8 KiB, a 100 KB URL, bytes
that are not HTTP) with a plain-text 400 from `RequestHandler.handle_error`, before any
middleware runs. The README promises every error as `{"error": {...}}`, so the runner's request
handler answers those in JSON too.

Slow clients: aiohttp closes a connection that has not sent a whole request head within its
keep-alive timeout (armed when the connection opens and after every response), so that timeout
is the header read timeout here; the body has the same limit in the handler (app.py).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from laps_jax.server.app import STATE
from laps_jax.server.protocol import APIError

SHUTDOWN_GRACE_S = 5.0


class JSONErrorHandler(RequestHandler):
    """aiohttp's connection handler, with its own error responses as OpenAI JSON errors."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs, checks nothing sent
        text = (getattr(exc, "message", None) or message or "") if status < 500 else ""
        err = APIError(f"bad HTTP request: {text}" if status < 500 else "internal server error",
                       status, "bad_http_request" if status < 500 else "internal_error")
        resp = web.json_response(err.body(), status=plain.status)
        resp.force_close()
        return resp


class _JSONErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JSONErrorHandler(self, loop=self._loop, **self._kwargs)


class JSONErrorRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer parser errors in JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JSONErrorServer  # same object, only its handler factory differs
        return server


def make_runner(app: web.Application, read_timeout_s: float | None = 30.0,
                **kwargs) -> JSONErrorRunner:
    """The runner for `app`: `read_timeout_s` bounds the wait for a request's head (and, set on
    the app's state, for its body); None waits forever, as aiohttp does by default."""
    app[STATE].read_timeout_s = read_timeout_s
    if read_timeout_s is not None:
        kwargs.setdefault("keepalive_timeout", read_timeout_s)
    # at exit, handlers still open after the drain (shutdown.py) get this long, not 60 s
    kwargs.setdefault("shutdown_timeout", SHUTDOWN_GRACE_S)
    return JSONErrorRunner(app, **kwargs)
