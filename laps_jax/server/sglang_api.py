"""SGLang's native endpoints, so gateways built for SGLang workers (the SGLang Model Gateway,
`smg`) run laps_jax instances unchanged:

- `POST /generate` — SGLang's own generation API (`text` or `input_ids`, `sampling_params`,
  `stream`). smg forwards it as is; it is the way to send token-id prompts through smg, whose
  `/v1/completions` accepts only string prompts. Streamed chunks carry the text and
  `output_ids` so far (SGLang's default, non-incremental output), then `data: [DONE]`.
- `GET /v1/loads` — SGLang's load report (`{"loads": [{"num_running_reqs", ...}]}`), which smg
  polls for its load-aware policies (least_load, power_of_two) on a worker it cannot identify
  as vLLM or SGLang: waiting and running requests, KV tokens used, and the prompt tokens still
  to prefill as `num_waiting_uncached_tokens`.
- `POST /flush_cache` — drops the prefix cache (smg's `/flush_cache` fans out to it). As in
  SGLang it refuses (400) while requests are live: benchmarks flush idle instances so every
  router starts from equal caches.

Every route the OpenAI API has stays as it was; these only add paths.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json

from aiohttp import web

from laps_jax.server.handling import collect, events, failure, finish_reason, respond
from laps_jax.server.output import TextStream
from laps_jax.server.protocol import APIError, GenerationRequest, parse_request
from laps_jax.server.state import STATE, ServerState, decode_json, read_body, submit

# sampling_params keys served, and the OpenAI field each one becomes
SAMPLING_KEYS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                 "top_k": "top_k", "stop": "stop", "sampling_seed": "seed"}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


def to_completion_body(body) -> dict:
    """An SGLang `/generate` body as the equivalent `/v1/completions` body (a 400 naming the
    field for anything it cannot serve)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise APIError("give exactly one of 'text' and 'input_ids'", param="input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise APIError("batched /generate requests are not supported: send one prompt per "
                       "request", param="input_ids" if text is None else "text")
    for flag in ("return_logprob", "return_hidden_states"):
        if body.get(flag):
            raise APIError(f"'{flag}' is not supported by this server", param=flag)
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise APIError("'sampling_params' must be an object", param="sampling_params")
    unknown = sorted(k for k, v in sp.items() if k not in SAMPLING_KEYS and v not in (None, False))
    if unknown:
        raise APIError(f"sampling_params {', '.join(unknown)} not supported (supported: "
                       f"{', '.join(SAMPLING_KEYS)})", param="sampling_params")
    out = {"prompt": ids if text is None else text, "max_tokens": DEFAULT_MAX_NEW_TOKENS,
           "stream": body.get("stream", False), "return_token_ids": True}
    for key, name in SAMPLING_KEYS.items():
        if sp.get(key) is not None:
            out[name] = sp[key]
    if out.get("top_k") == -1:  # SGLang's "no top-k"
        out["top_k"] = 0
    return out


def _parse(raw: bytes, state: ServerState) -> GenerationRequest:
    return parse_request(to_completion_body(decode_json(raw)), "completion",
                         vocab_size=state.vocab_size, tokenizer=state.tokenizer,
                         max_model_len=state.max_model_len, served_names=state.served_names)


def _reply(handle, req: GenerationRequest, text: str, ids: list[int], reason=None) -> dict:
    finish = None if reason is None else {"type": reason, **(
        {"length": len(ids)} if reason == "length" else {})}
    return {"text": text, "output_ids": list(ids), "meta_info": {
        "id": handle.request_id, "finish_reason": finish, "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(ids), "cached_tokens": handle.stats.cached_tokens}}


async def _whole(request, state, req: GenerationRequest, handle) -> web.Response:
    got, text, stats = await collect(request, state, req, handle)
    return web.json_response(_reply(handle, req, text.text, [ev.token_id for ev in got],
                                    finish_reason(stats, text)))


async def _stream(request, state, req: GenerationRequest, handle) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    text, ids, sent = TextStream(state.tokenizer, req.stop), [], ""
    async for ev in events(handle, request):
        ids.append(ev.token_id)
        sent += text.push(ev.token_id)
        await send(_reply(handle, req, sent, ids))
        if text.stopped:
            handle.abort()
            break
    sent += text.finish()
    stats = await handle.result()
    if (err := failure(handle)) is not None:
        await send(err.body())
    else:
        await send(_reply(handle, req, sent, ids, finish_reason(stats, text)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await read_body(request, state.read_timeout_s)
    req = await asyncio.get_running_loop().run_in_executor(
        state.parse_pool, functools.partial(_parse, raw, state))
    return await respond(request, state, req, submit(state, req), _whole, _stream)


def load_report(state: ServerState) -> dict:
    """SGLang's `/v1/loads` body from the dispatcher's snapshot and the engines' pages."""
    m = state.dispatcher.metrics()
    pools = {p for lane in m.lanes for p in lane.pending_prefill_tokens}
    kvs = [e.kv for e in state.engines]
    used = sum(kv.num_used for kv in kvs) * kvs[0].page_size
    total = sum(kv.num_pages - 1 for kv in kvs) * kvs[0].page_size
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "dp_rank_count": 1, "loads": [{
                "dp_rank": 0, "num_running_reqs": max(m.running - m.waiting, 0),
                "num_waiting_reqs": m.waiting, "num_total_reqs": m.running,
                "num_waiting_uncached_tokens": sum(m.pending_tokens(p) for p in pools),
                "num_used_tokens": used, "max_total_num_tokens": total,
                "token_usage": used / total if total else 0.0}]}


async def loads(request: web.Request) -> web.Response:
    return web.json_response(load_report(request.app[STATE]))


async def flush_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.live or not await state.dispatcher.flush_prefix_cache():
        raise APIError("the prefix cache was not flushed: requests are running; retry when idle",
                       400, "busy")
    return web.json_response({"status": "ok", "message": "Cache flushed."})


def add_sglang_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/flush_cache", flush_cache)
