"""An instance that answers at once, for timing what a router itself adds to a request.

It speaks what a router reads from serve.py (`GET /load`, `/health`, `/v1/models`, SGLang's
`/v1/loads`) and answers `POST /v1/completions` (streamed, with the token-id comment
lines serve.py sends a router that asks for them) and SGLang's `POST /generate` with
`max_tokens` tokens at once, without a model. In front of it the time to the first token is the
client's, the router's and the loopback's, none of it an engine's: `bench_router_hop.py
--instant` measures a router's own cost by prompt size, which a real instance's prefill (2 s
for 3,000 tokens on this CPU) buries in its noise.

    python -m laps_jax.bench.instant_instance --port 8001
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

from laps_jax.server.resume import TOKEN_IDS_HEADER, id_line

MODEL = "instant"
MAX_MODEL_LEN = 1 << 20
TOKEN_ID = 7  # every answer's tokens
GAUGES = [["vllm:num_requests_waiting", {}, 0], ["vllm:num_requests_running", {}, 0],
          ["vllm:kv_cache_usage_perc", {}, 0.0],
          ["vllm:cache_config_info", {"block_size": "16", "num_gpu_blocks": "65536"}, 1.0],
          ["laps_pending_prefill_tokens", {"pool": "short"}, 0],
          ["laps_short_threshold_tokens", {}, 256], ["laps_long_chunk_tokens", {}, 256]]


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text='{"error": {"message": "invalid JSON"}}',
                                 content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text='{"error": {"message": "a JSON object"}}',
                                 content_type="application/json")
    return body


def _count(value, default: int) -> int:
    return value if type(value) is int and 1 <= value <= 4096 else default


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    n = _count(body.get("max_tokens"), 16)
    marked = request.headers.get(TOKEN_IDS_HEADER) == "1"
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        last = i == n - 1
        choice = {"index": 0, "text": "a", "token_ids": [TOKEN_ID],
                  "finish_reason": "length" if last else None}
        chunk = {"id": "cmpl-instant", "object": "text_completion", "created": 0,
                 "model": MODEL, "choices": [choice]}
        if last:
            chunk["usage"] = {"prompt_tokens": 0, "completion_tokens": n}
        await resp.write((id_line(TOKEN_ID) if marked else b"") + _event(chunk))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang's /generate: each chunk carries the whole answer so far."""
    body = await _body(request)
    params = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}
    n = _count(params.get("max_new_tokens"), 16)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(1, n + 1):
        meta = {"completion_tokens": i, "cached_tokens": 0,
                "finish_reason": {"type": "length"} if i == n else None}
        await resp.write(_event({"text": "a" * i, "output_ids": [TOKEN_ID] * i,
                                 "meta_info": meta}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def load(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "gauges": GAUGES})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": MODEL, "object": "model", "owned_by": "laps_jax", "max_model_len": MAX_MODEL_LEN}]})


async def sglang_loads(request: web.Request) -> web.Response:
    return web.json_response({"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0,
                                         "num_used_tokens": 0,
                                         "num_waiting_uncached_tokens": 0}]})


def make_app() -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/generate", generate)
    for path, handler in (("/load", load), ("/health", health), ("/v1/models", models),
                          ("/v1/loads", sglang_loads)):
        app.router.add_get(path, handler)
    return app


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                    "127.0.0.1: loopback only)")
    ap.add_argument("--port", type=int, required=True, help="port to listen on")
    a = ap.parse_args(argv)
    web.run_app(make_app(), host=a.host, port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
