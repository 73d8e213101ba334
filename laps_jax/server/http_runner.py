"""The aiohttp runner the server runs under: JSON for HTTP parser errors, and read timeouts.

aiohttp answers what its HTTP parser refuses (a header line over 8 KiB, a 100 KB URL, bytes
that are not HTTP) with a plain-text 400 from `RequestHandler.handle_error`, before any
middleware runs. The README promises every error as `{"error": {...}}`, so the runner's request
handler answers those in JSON too. After such an answer the connection closes the way HTTP
servers close after an error (a "lingering close"): the server ends its side and reads and drops
what the client is still sending, for up to `LINGER_S`, before it closes the socket. A socket
closed with unread bytes sends a TCP reset, which can throw away the answer before the client
reads it (1 in 300 tries of a 100 KB URL on loopback).

Slow clients: aiohttp closes a connection that has not sent a whole request head within its
keep-alive timeout (armed when the connection opens and after every response), so that timeout
is the header read timeout here; the body has the same limit in the handler (app.py).
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from laps_jax.server.state import STATE
from laps_jax.server.protocol import APIError

SHUTDOWN_GRACE_S = 5.0
LINGER_S = 2.0


class _LingeringTransport:
    """A connection's transport whose `close()` sends EOF at once and closes the socket when the
    client closes its side or after `linger_s`; reads go on meanwhile and are dropped."""

    def __init__(self, transport, linger_s: float):
        self._transport, self._linger_s = transport, linger_s

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        t = self._transport
        if t.is_closing():
            return
        if t.can_write_eof():
            t.write_eof()  # the client reads the answer, then EOF; its close ends ours
            asyncio.get_running_loop().call_later(self._linger_s, t.close)
        else:
            t.close()


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
        if self.transport is not None and not isinstance(self.transport, _LingeringTransport):
            self.transport = _LingeringTransport(self.transport, LINGER_S)
        return resp

    def data_received(self, data: bytes) -> None:
        if isinstance(self.transport, _LingeringTransport):
            return  # after an error answer: drop the rest of the request
        super().data_received(data)

    def eof_received(self) -> None:
        if isinstance(self.transport, _LingeringTransport):
            self.transport._transport.close()  # the client closed its side: close ours now


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
