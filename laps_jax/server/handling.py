"""Answering a submitted request, whichever API's format the answer takes: its token events
(aborted when the client goes away), the engine's failure as an error, the finish reason, and
`respond`, which runs an API's whole-answer or stream writer and frees the request's pages
however it ends.

app.py (OpenAI), sglang_api.py (SGLang) and pd.py (the decode leg) answer through these.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from laps_jax.server.output import TextStream
from laps_jax.server.protocol import APIError, GenerationRequest
from laps_jax.server.state import ServerState

DISCONNECT_POLL_S = 0.25


def _closed(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def events(handle, request: web.Request):
    """The handle's token events; aborts the request if the client goes away meanwhile."""
    it = handle.__aiter__()
    task = None
    try:
        while True:
            task = asyncio.ensure_future(it.__anext__())
            while not task.done():
                await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
                if not task.done() and _closed(request):
                    handle.abort()
                    raise ConnectionResetError("client disconnected")
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:  # cancelled or left early: the pending read must not outlive the response
        if task is not None and not task.done():
            task.cancel()
        elif task is not None and not task.cancelled():
            task.exception()  # a read that ended as the handler was cancelled: no error


async def respond(request: web.Request, state: ServerState, req: GenerationRequest,
                  handle, whole, stream) -> web.StreamResponse:
    """The answer of a submitted request by an API's `whole` (JSON) or `stream` writer;
    however it ends, the request is aborted (pages freed)."""
    state.live += 1
    try:
        if req.stream:
            return await stream(request, state, req, handle)
        return await whole(request, state, req, handle)
    finally:
        handle.abort()  # client gone, error or cancelled: free its pages now (no-op if done)
        state.live -= 1
        if handle.finished and state.metrics is not None:
            state.metrics.observe(handle.stats)


def failure(handle) -> APIError | None:
    """The error of a request the engine could not run (its batch-mates went on)."""
    if handle.stats.finish_reason != "error":
        return None
    return APIError(f"the request failed while it ran: {handle.error or 'engine error'}", 500,
                    "request_failed")


def finish_reason(stats, text: TextStream) -> str:
    if text.stopped:
        return "stop"
    return stats.finish_reason if stats.finish_reason in ("stop", "length") else "abort"


async def collect(request, state, req: GenerationRequest, handle):
    """(token events, text up to a stop string, stats) of a whole answer; the engine's failure
    raised as its APIError."""
    text = TextStream(state.tokenizer, req.stop)
    got = []
    async for ev in events(handle, request):
        got.append(ev)
        text.push(ev.token_id)
        if text.stopped:
            handle.abort()
            break
    text.finish()
    stats = await handle.result()
    if (err := failure(handle)) is not None:
        raise err
    return got, text, stats
