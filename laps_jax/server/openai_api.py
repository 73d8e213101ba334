"""OpenAI's answer formats: a whole `completion` / `chat.completion` object, or a stream of
chunks as server-sent events (a resumed stream replays its text so far, resume.py). `answer`
is `respond` in these formats: what /v1/completions, /v1/chat/completions and the decode leg of
a prefill/decode split send back.
"""

from __future__ import annotations

import json

from aiohttp import web

from laps_jax.server.handling import collect, events, failure, finish_reason, respond
from laps_jax.server.output import (ResponseBuilder, TextStream, chat_logprobs,
                                    completion_logprobs, usage)
from laps_jax.server.protocol import GenerationRequest
from laps_jax.server.resume import TOKEN_IDS_HEADER, id_line, replay
from laps_jax.server.state import ServerState


async def answer(request: web.Request, state: ServerState, req: GenerationRequest,
                 handle) -> web.StreamResponse:
    """The OpenAI answer (JSON or a stream) of a submitted request; its pages freed at the end."""
    return await respond(request, state, req, handle, whole, stream)


async def whole(request, state, req: GenerationRequest, handle) -> web.Response:
    got, text, stats = await collect(request, state, req, handle)
    out = ResponseBuilder(req.kind, req.model)
    lp = None
    if req.logprobs is not None:
        lp = (completion_logprobs(state.tokenizer, got) if req.kind == "completion"
              else chat_logprobs(state.tokenizer, got))
    body = out.whole(text.text, finish_reason(stats, text), lp,
                     usage(len(req.prompt_ids), len(got), stats.cached_tokens))
    if req.return_token_ids:
        body["choices"][0]["token_ids"] = [ev.token_id for ev in got]
    return web.json_response(body)


async def stream(request, state, req: GenerationRequest, handle) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    r = req.resume  # a stream resumed here: its id, and its text so far replayed (resume.py)
    out = ResponseBuilder(req.kind, req.model, *((r.id, r.created) if r is not None else ()))
    text = TextStream(state.tokenizer, req.stop)
    ids = request.headers.get(TOKEN_IDS_HEADER) == "1"  # the router's: each token's id

    async def send(obj, head: bytes = b"") -> None:
        await resp.write(head + b"data: " + json.dumps(obj).encode() + b"\n\n")

    n = replay(text, req)
    offset, first = text.emitted, n == 0
    async for ev in events(handle, request):
        n += 1
        delta = text.push(ev.token_id)
        lp = None
        if req.logprobs is not None:
            lp = (completion_logprobs(state.tokenizer, [ev], offset) if req.kind == "completion"
                  else chat_logprobs(state.tokenizer, [ev]))
        head = id_line(ev.token_id) if ids else b""
        if delta or lp is not None or first or req.return_token_ids:
            choice = out.choice(delta, None, lp, True, first)
            if req.return_token_ids:
                choice["token_ids"] = [ev.token_id]
            await send(out.chunk(choice), head)
            first = False
            offset += len(delta)
        elif head:
            await resp.write(head + b"\n")
        if text.stopped:
            handle.abort()
            break
    tail = text.finish()
    stats = await handle.result()
    if (err := failure(handle)) is not None:  # the status line went out long ago
        await send(err.body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    await send(out.chunk(out.choice(tail, finish_reason(stats, text), None, True, first)))
    if req.include_usage:
        p = req.prompt_tokens
        await send(out.chunk(None, usage(p, n, min(stats.cached_tokens, p))))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
