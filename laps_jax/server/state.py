"""What every handler of the server shares, whichever API it speaks: the server's state, the
request body read and decoded, and admission (room, then the dispatcher).

The OpenAI routes (app.py), SGLang's (sglang_api.py), the prefill/decode legs (pd.py) and the
router (cluster/http_router.py) all build on these, so none of them imports another's module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json

from aiohttp import web

from laps_jax.server.metrics import ServerMetrics
from laps_jax.server.protocol import APIError, GenerationRequest

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


async def read_body(request: web.Request, timeout: float | None) -> bytes:
    """The whole body, or a 408 if it does not arrive within `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout:g} s", 408,
                       "request_timeout") from None


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
