"""Passing one request through to an instance, and its answer back, as it comes.

Each request has an "instance down" future (`Instance.inflight`, set by the poller when the
instance stops answering). Until the instance's answer starts, the wait for it races that
future; from then on the future closes the answer's connection, which ends whatever read is
pending (cheaper than a race per stream chunk). So a request on a dead or hung instance ends
at once: 502 JSON before the answer started, an error event and
`data: [DONE]` on a stream already under way. A stream that breaks (the instance's process
died) or ends without `data: [DONE]` ends the same way. A client that goes away closes the
connection to the instance, which aborts the request there and frees its pages.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from laps_jax.cluster.instances import Instance
from laps_jax.server.protocol import APIError

DONE = b"data: [DONE]\n\n"
PASS_HEADERS = ("Content-Type", "Retry-After", "Cache-Control")
HUNG = "it stopped answering the router's health checks"


class InstanceDown(Exception):
    """The instance refused the connection: nothing was sent, another one may take it."""


class _Gone(Exception):
    """The instance stopped answering after the request was sent."""


async def _race(aw, down: asyncio.Future):
    """`aw`'s result, or _Gone when the instance goes down first."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    raise _Gone(HUNG)


async def _read(aw, down: asyncio.Future):
    """`aw`'s result, a read of an answer whose connection `down` closes: _Gone when it did."""
    try:
        out = await aw
    except aiohttp.ClientError:
        if down.done():
            raise _Gone(HUNG) from None
        raise
    if down.done():
        raise _Gone(HUNG)
    return out


def _gone_error(inst: Instance, why: str) -> APIError:
    return APIError(f"the instance serving this request ({inst.url}) failed: {why}", 502,
                    "upstream_failed")


async def relay(request: web.Request, session: aiohttp.ClientSession, inst: Instance,
                path: str, raw: bytes, stream: bool, headers: dict,
                on_first: Callable[[], None] | None = None) -> web.StreamResponse:
    """`on_first` is called once the first token is back (the first chunk of a stream, or
    the whole answer): the router's load book stops counting the request's prefill."""
    on_first = on_first or (lambda: None)
    down = asyncio.get_running_loop().create_future()
    inst.inflight.add(down)
    up = None
    resp: web.StreamResponse | None = None
    try:
        try:
            up = await _race(session.post(inst.url + path, data=raw, headers={
                "Content-Type": "application/json", **headers}), down)
        except aiohttp.ClientConnectorError as e:
            raise InstanceDown(f"{type(e).__name__}: {e}") from None
        down.add_done_callback(lambda _: up.close())  # ends any read of the answer below
        out_headers = {h: up.headers[h] for h in PASS_HEADERS if h in up.headers}
        if not (stream and up.status == 200
                and up.headers.get("Content-Type", "").startswith("text/event-stream")):
            body = await _read(up.read(), down)
            on_first()
            return web.Response(body=body, status=up.status, headers=out_headers)
        resp = web.StreamResponse(status=200, headers=out_headers)
        await resp.prepare(request)
        tail = b""
        while True:
            chunk = await _read(up.content.readany(), down)
            if not chunk:
                break
            inst.last_data = time.monotonic()  # alive, however slow its polls (instances.py)
            if not tail:  # the first chunk
                on_first()
            await resp.write(chunk)
            tail = (tail + chunk)[-len(DONE):]
        if tail != DONE:
            raise _Gone("the stream ended before its end")
        await resp.write_eof()
        return resp
    except (_Gone, aiohttp.ClientError) as e:
        why = str(e) or type(e).__name__
        if isinstance(e, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
            why = f"the connection broke ({type(e).__name__})"
        err = _gone_error(inst, why)
        if resp is None:
            raise err from None
        await resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n" + DONE)
        await resp.write_eof()
        return resp
    finally:
        inst.inflight.discard(down)
        if up is not None:
            up.close()  # unread (client gone, error): the connection closes, the instance aborts
