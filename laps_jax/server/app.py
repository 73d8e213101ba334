"""The OpenAI-compatible aiohttp application.

Handlers validate (protocol.py), hand token ids to the dispatcher, and turn its token events
into JSON or server-sent events (output.py). Every error is a JSON body with a 4xx/5xx status;
a full queue answers 503 with Retry-After; a client that goes away aborts its request, which
frees its pages at once.

The event loop only does I/O: JSON decoding, validation, chat templating and tokenizing run on
a small thread pool (`ServerState.parse_pool`), so a multi-megabyte prompt holds up nobody, and
/health keeps answering. A request the engine could not run answers 500 `request_failed` (or
an error event, when streaming) while its batch-mates go on; /health answers 503 when a lane
has had work waiting and got nothing done for `stall_after_s` seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import json
import logging

from aiohttp import web

from laps_jax.server import loop_lag
from laps_jax.server.metrics import ServerMetrics
from laps_jax.server.output import (ResponseBuilder, TextStream, chat_logprobs,
                                    completion_logprobs, usage)
from laps_jax.server.protocol import APIError, GenerationRequest, parse_request
from laps_jax.server.resume import TOKEN_IDS_HEADER, ended, id_line, replay

log = logging.getLogger("laps_jax.server")
DISCONNECT_POLL_S = 0.25
PD_HEADER = "X-Laps-PD"  # "prefill" or "decode": a leg of a prefill/decode split (pd.py)
PARSE_THREADS = 4  # requests decoded and tokenized at once, off the event loop
GUARDED = ("/v1/", "/pd/", "/generate", "/flush_cache")  # what --api-key guards


@dataclasses.dataclass
class ServerState:
    dispatcher: object
    engines: list
    tokenizer: object | None
    vocab_size: int
    max_model_len: int
    served_names: tuple[str, ...]
    api_key: str | None = None
    max_queue: int = 256
    draining: bool = False
    live: int = 0
    metrics: ServerMetrics | None = None
    read_timeout_s: float | None = 30.0  # longest wait for a request body (None: no limit)
    stall_after_s: float = 60.0  # /health turns 503 after a lane is stuck this long
    parse_pool: concurrent.futures.ThreadPoolExecutor | None = None
    pd: object | None = None  # server/pd.py's PDServer on a prefill or decode instance
    guarded: tuple[str, ...] = GUARDED  # path prefixes --api-key guards (the router adds its own)


STATE = web.AppKey("state", ServerState)


def _error(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    state = request.app[STATE]
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unknown"  # bounded label values
    try:
        if state.api_key and request.path.startswith(state.guarded) and not _authorized(
                request.headers.get("Authorization", ""), state.api_key):
            raise APIError("missing or invalid API key (send 'Authorization: Bearer KEY')",
                           status=401, code="invalid_api_key")
        resp = await handler(request)
    except asyncio.CancelledError:  # aiohttp cancels the handler of a client that left
        if state.metrics is not None:
            state.metrics.requests.labels(endpoint, "499").inc()
        raise
    except ConnectionResetError:  # the client went away mid-response: nobody to answer
        # (aiohttp fails to send this on the closed connection and drops it quietly; 499 is
        # what the request counter records, as nginx logs a client that closed the request)
        resp = web.Response(status=499)
    except APIError as e:
        resp = _error(e)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app._client_max_size
        resp = _error(APIError(f"request body too large (limit {limit} bytes)", 413,
                               "request_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _error(APIError(e.reason or "error", e.status, "http_error"))
    except Exception:  # a bug: say so without leaking internals, keep serving
        log.exception("unhandled error on %s", request.path)
        resp = _error(APIError("internal server error", 500, "internal_error"))
    if state.metrics is not None:
        state.metrics.requests.labels(endpoint, str(resp.status)).inc()
    return resp


def _authorized(header: str, key: str) -> bool:
    """Bearer-token check on bytes: a header of non-ASCII bytes (which aiohttp hands over with
    surrogate escapes) is a wrong key, not a UnicodeEncodeError."""
    token = header[7:] if header.startswith("Bearer ") else ""
    got = token.encode("utf-8", "surrogateescape") if token else b""
    return bool(got) and hmac.compare_digest(got, key.encode("utf-8"))


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def decode_json(raw: bytes):
    """The body as JSON, or a 400 naming what is wrong (never a 500: not for 100,000 nested
    brackets, a 5,000-digit number, NaN, nor bytes that are not UTF-8)."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError("invalid JSON body: nested too deeply", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(f"invalid JSON body: {e}", code="invalid_json") from None
    except UnicodeDecodeError:
        raise APIError("invalid JSON body: not UTF-8 text", code="invalid_json") from None
    except ValueError as e:  # int(): more digits than Python reads (4300), or NaN/Infinity
        why = "a number has too many digits" if "digits" in str(e) else str(e)
        raise APIError(f"invalid JSON body: {why}", code="invalid_json") from None


async def _read_body(request: web.Request, timeout: float | None) -> bytes:
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout:g} s", 408,
                       "request_timeout") from None


def _parse(raw: bytes, kind: str, state: ServerState) -> GenerationRequest:
    """Runs on the parse pool: decoding, templating and tokenizing are CPU work."""
    return parse_request(decode_json(raw), kind, vocab_size=state.vocab_size,
                         tokenizer=state.tokenizer, max_model_len=state.max_model_len,
                         served_names=state.served_names)


def check_room(state: ServerState) -> None:
    """503 while draining or at the request limit."""
    if state.draining:
        raise APIError("the server is shutting down", 503, "unavailable",
                       headers={"Retry-After": "5"})
    if state.live >= state.max_queue:
        raise APIError(f"the server is at its request limit ({state.max_queue}); retry shortly",
                       503, "overloaded", headers={"Retry-After": "1"})


def submit(state: ServerState, req: GenerationRequest, **kw):
    check_room(state)
    try:
        return state.dispatcher.submit(req.prompt_ids, req.params, **kw)
    except ValueError as e:
        raise APIError(str(e), code="context_length_exceeded") from None


def _closed(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def _events(handle, request: web.Request):
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


async def generate(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    hand = pd = None
    if PD_HEADER in request.headers:  # one half of a prefill/decode split (server/pd.py):
        from laps_jax.server import pd  # role, secret, hand-off checked before the body
        hand = pd.pd_leg(request, state)
    raw = await _read_body(request, state.read_timeout_s)
    req = await asyncio.get_running_loop().run_in_executor(
        state.parse_pool, functools.partial(_parse, raw, kind, state))
    if pd is not None:
        return await pd.pd_generate(request, state, req, hand)
    handle = ended(req, state.tokenizer, state.max_model_len) or submit(state, req)
    return await respond(request, state, req, handle)


async def respond(request: web.Request, state: ServerState, req: GenerationRequest,
                  handle, whole=None, stream=None) -> web.StreamResponse:
    """The answer (JSON or a stream) of a submitted request: OpenAI's, or another API's
    `whole` / `stream` formats; however it ends, the request is aborted (pages freed)."""
    whole, stream = whole or _whole, stream or _stream
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


def _failure(handle) -> APIError | None:
    """The error of a request the engine could not run (its batch-mates went on)."""
    if handle.stats.finish_reason != "error":
        return None
    return APIError(f"the request failed while it ran: {handle.error or 'engine error'}", 500,
                    "request_failed")


def _finish_reason(stats, text: TextStream) -> str:
    if text.stopped:
        return "stop"
    return stats.finish_reason if stats.finish_reason in ("stop", "length") else "abort"


async def collect(request, state, req: GenerationRequest, handle):
    """(token events, text up to a stop string, stats) of a whole answer; the engine's failure
    raised as its APIError."""
    text = TextStream(state.tokenizer, req.stop)
    events = []
    async for ev in _events(handle, request):
        events.append(ev)
        text.push(ev.token_id)
        if text.stopped:
            handle.abort()
            break
    text.finish()
    stats = await handle.result()
    if (err := _failure(handle)) is not None:
        raise err
    return events, text, stats


async def _whole(request, state, req: GenerationRequest, handle) -> web.Response:
    events, text, stats = await collect(request, state, req, handle)
    out = ResponseBuilder(req.kind, req.model)
    lp = None
    if req.logprobs is not None:
        lp = (completion_logprobs(state.tokenizer, events) if req.kind == "completion"
              else chat_logprobs(state.tokenizer, events))
    body = out.whole(text.text, _finish_reason(stats, text), lp,
                     usage(len(req.prompt_ids), len(events), stats.cached_tokens))
    if req.return_token_ids:
        body["choices"][0]["token_ids"] = [ev.token_id for ev in events]
    return web.json_response(body)


async def _stream(request, state, req: GenerationRequest, handle) -> web.StreamResponse:
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
    async for ev in _events(handle, request):
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
    if (err := _failure(handle)) is not None:  # the status line went out long ago
        await send(err.body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    await send(out.chunk(out.choice(tail, _finish_reason(stats, text), None, True, first)))
    if req.include_usage:
        p = req.prompt_tokens
        await send(out.chunk(None, usage(p, n, min(stats.cached_tokens, p))))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request: web.Request):
    return await generate(request, "completion")


async def chat_completions(request: web.Request):
    return await generate(request, "chat")


async def models(request: web.Request):
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "laps_jax",
         "max_model_len": state.max_model_len} for name in state.served_names]})


async def health(request: web.Request):
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    stalled = state.dispatcher.stalled(state.stall_after_s)
    if stalled:  # the watchdog: requests wait and nothing moves
        return web.json_response({"status": "stalled", "lanes": stalled, "message": (
            f"lane {', '.join(stalled)} got nothing done for over {state.stall_after_s:g} s "
            f"while requests wait")}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request):
    return web.Response(body=request.app[STATE].metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def create_app(state: ServerState, max_request_bytes: int = 4 << 20) -> web.Application:
    app = web.Application(client_max_size=max_request_bytes, middlewares=[errors_and_auth])
    state.metrics = state.metrics or ServerMetrics(state.dispatcher, state.engines)
    if state.parse_pool is None:
        state.parse_pool = concurrent.futures.ThreadPoolExecutor(
            PARSE_THREADS, thread_name_prefix="laps-parse")
    app[STATE] = state

    async def close_pool(_app) -> None:
        state.parse_pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(close_pool)
    loop_lag.watch(app, log, getattr(state.metrics, "registry", None))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if state.pd is not None:
        app.router.add_post("/pd/release", state.pd.release_route)
        if hasattr(state.metrics, "registry"):
            state.metrics.registry.register(state.pd)  # its pinned pages, beside the pool's
    from laps_jax.server.sglang_api import add_sglang_routes  # (it imports this module)
    add_sglang_routes(app)
    return app
