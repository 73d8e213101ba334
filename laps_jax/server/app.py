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
import functools
import hmac
import logging

from aiohttp import web

from laps_jax.server import loop_lag, pd
from laps_jax.server.metrics import ServerMetrics
from laps_jax.server.openai_api import answer
from laps_jax.server.protocol import APIError, GenerationRequest, parse_request
from laps_jax.server.resume import ended
from laps_jax.server.sglang_api import add_sglang_routes
from laps_jax.server.state import STATE, ServerState, decode_json, read_body, submit

log = logging.getLogger("laps_jax.server")
PARSE_THREADS = 4  # requests decoded and tokenized at once, off the event loop


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


def _parse(raw: bytes, kind: str, state: ServerState) -> GenerationRequest:
    """Runs on the parse pool: decoding, templating and tokenizing are CPU work."""
    return parse_request(decode_json(raw), kind, vocab_size=state.vocab_size,
                         tokenizer=state.tokenizer, max_model_len=state.max_model_len,
                         served_names=state.served_names)


async def generate(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    leg = pd.PD_HEADER in request.headers  # one half of a prefill/decode split (server/pd.py):
    hand = pd.pd_leg(request, state) if leg else None  # role, secret, hand-off before the body
    raw = await read_body(request, state.read_timeout_s)
    req = await asyncio.get_running_loop().run_in_executor(
        state.parse_pool, functools.partial(_parse, raw, kind, state))
    if leg:
        return await pd.pd_generate(request, state, req, hand)
    handle = ended(req, state.tokenizer, state.max_model_len) or submit(state, req)
    return await answer(request, state, req, handle)


async def completions(request: web.Request):
    return await generate(request, "completion")


async def chat_completions(request: web.Request):
    return await generate(request, "chat")


async def models(request: web.Request):
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "laps_jax",
         "max_model_len": state.max_model_len} for name in state.served_names]})


def _health(state: ServerState) -> tuple[dict, int]:
    """/health's answer: ok, or 503 with why (draining, or a lane stuck with work waiting)."""
    if state.draining:
        return {"status": "draining"}, 503
    stalled = state.dispatcher.stalled(state.stall_after_s)
    if stalled:  # the watchdog: requests wait and nothing moves
        return {"status": "stalled", "lanes": stalled, "message": (
            f"lane {', '.join(stalled)} got nothing done for over {state.stall_after_s:g} s "
            f"while requests wait")}, 503
    return {"status": "ok"}, 200


async def health(request: web.Request):
    body, status = _health(request.app[STATE])
    return web.json_response(body, status=status)


async def load(request: web.Request):
    """A router's poll in one small read: /health's answer and, when healthy, the load gauges
    /metrics exports for routers (`ServerMetrics.load_gauges`) as [name, labels, value]. The
    network router polls each instance twice a second; /health plus /metrics took two HTTP
    reads and a Prometheus render and parse each time."""
    state = request.app[STATE]
    body, status = _health(state)
    if status == 200:
        body["gauges"] = state.metrics.load_gauges()
    return web.json_response(body, status=status)


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
    app.router.add_get("/load", load)
    if state.pd is not None:
        app.router.add_post("/pd/release", state.pd.release_route)
        if hasattr(state.metrics, "registry"):
            state.metrics.registry.register(state.pd)  # its pinned pages, beside the pool's
    add_sglang_routes(app)
    return app
