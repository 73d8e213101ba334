"""The HTTP side of prefill/decode disaggregation: the wire protocol between the router and
a prefill and a decode instance.

Both legs are the ordinary OpenAI request (`/v1/completions` or `/v1/chat/completions`, the
client's own body, so prompts are parsed and tokenized the same way on both sides and the API
key applies) with a header `X-Laps-PD`:

1. `X-Laps-PD: prefill` to a `--role prefill` instance: it prefills (LAPS pools), samples the
   first token and answers JSON `{"handoff": {address, uuid, num_pages, num_tokens, shape,
   dtype} | null, "first": {token_id, logprob, top}, "finish_reason": null | "stop" |
   "length"}` (`handoff` is null when the first token ended the request). Its pages stay
   pinned until step 3 or `--pd-timeout`.
2. `X-Laps-PD: decode` plus `X-Laps-PD-Handoff: <that JSON>` to a `--role decode` instance: it
   pulls the pages from the prefill's transfer server into pages it reserved, then answers the
   client's request as serve.py does (JSON or a stream, every token, the first included). A
   failed pull is a JSON 502 `kv_transfer_failed` before anything is streamed.
3. `POST /pd/release {"uuid": ...}` to the prefill instance (the router sends it once step 2
   answered or failed): its pages go back to its prefix cache. Idempotent.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from laps_jax.engine.sequence import TokenLogprobs
from laps_jax.scheduler.pd import Adopter, Offers, PDConfig
from laps_jax.server.app import ServerState, check_room, decode_json, respond, submit
from laps_jax.server.protocol import APIError, GenerationRequest

log = logging.getLogger("laps_jax.server")
HANDOFF_HEADER = "X-Laps-PD-Handoff"


class PDServer:
    """One instance's part in the split: its transfer server and its offers or adoptions."""

    def __init__(self, cfg: PDConfig, dispatcher):
        from laps_jax.engine.kv_remote import RemoteKV
        self.cfg = cfg
        self.remote = RemoteKV(cfg.transfer_address)
        self.offers = Offers(dispatcher, self.remote, cfg.timeout_s) \
            if cfg.role == "prefill" else None
        self.adopter = Adopter(dispatcher, self.remote, cfg.timeout_s) \
            if cfg.role == "decode" else None

    async def release_route(self, request: web.Request) -> web.Response:
        body = decode_json(await request.read())
        uuid = body.get("uuid") if isinstance(body, dict) else None
        if not isinstance(uuid, int) or self.offers is None:
            raise APIError("POST /pd/release takes {\"uuid\": <int>} on a --role prefill "
                           "instance", code="invalid_request")
        return web.json_response({"released": await self.offers.release(uuid)})

    async def close(self) -> None:
        if self.offers is not None:
            await self.offers.close()
        if self.adopter is not None:
            await self.adopter.close()


def _pd(state: ServerState, leg: str) -> PDServer:
    pd = state.pd
    role = pd.cfg.role if pd is not None else "both"
    if leg not in ("prefill", "decode") or role != leg:
        raise APIError(f"this instance's --role is {role}: it does not take X-Laps-PD: {leg}",
                       code="invalid_request")
    return pd


async def pd_generate(request: web.Request, state: ServerState,
                      req: GenerationRequest) -> web.StreamResponse:
    leg = request.headers.get("X-Laps-PD", "")
    pd = _pd(state, leg)
    if leg == "prefill":
        return await _prefill(request, state, req)
    return await _decode(request, state, req, pd)


async def _prefill(request: web.Request, state: ServerState,
                   req: GenerationRequest) -> web.Response:
    handle = submit(state, req, offer_kv=True)
    state.live += 1
    try:
        events = [ev async for ev in handle]  # one: the first token
        stats = await handle.result()
    finally:
        handle.abort()  # cancelled (the router left): free its pages (no-op if handed off)
        state.live -= 1
    r = handle.request
    if stats.finish_reason not in ("handoff", "stop", "length") or not events:
        raise APIError(f"prefill failed: {handle.error or stats.finish_reason}", 500,
                       "request_failed")
    ev = events[0]
    first = {"token_id": ev.token_id, "logprob": ev.logprob, "top": ev.top}
    reason = None if stats.finish_reason == "handoff" else stats.finish_reason
    return web.json_response({"handoff": r.handoff, "first": first, "finish_reason": reason,
                              "cached_tokens": stats.cached_tokens})


def _read_handoff(request: web.Request) -> tuple[dict | None, TokenLogprobs, str | None]:
    from laps_jax.engine.kv_remote import Offer
    try:
        d = json.loads(request.headers.get(HANDOFF_HEADER, ""))
        f = d["first"]
        first = TokenLogprobs(int(f["token_id"]), float(f["logprob"]),
                              [(int(t), float(p)) for t, p in f.get("top") or []])
        offer = Offer.from_json(d["handoff"]) if d.get("handoff") is not None else None
        reason = d.get("finish_reason")
    except (ValueError, KeyError, TypeError) as e:
        raise APIError(f"bad {HANDOFF_HEADER} header: {type(e).__name__}: {e}",
                       code="invalid_request") from None
    if offer is None and reason not in ("stop", "length"):
        raise APIError(f"{HANDOFF_HEADER}: no handoff and no finish_reason",
                       code="invalid_request")
    return offer, first, reason


async def _decode(request: web.Request, state: ServerState, req: GenerationRequest,
                  pd: PDServer) -> web.StreamResponse:
    offer, first, reason = _read_handoff(request)
    if offer is not None and offer.num_tokens != len(req.prompt_ids):
        raise APIError(f"the hand-off holds {offer.num_tokens} tokens, the prompt here is "
                       f"{len(req.prompt_ids)}: both instances need the same tokenizer",
                       code="invalid_request")
    check_room(state)
    handle = await pd.adopter.adopt(req.prompt_ids, req.params, first, offer, reason)
    if handle.finished and handle.stats.finish_reason == "error":
        raise APIError(handle.error or "KV transfer failed", 502, "kv_transfer_failed")
    return await respond(request, state, req, handle)


__all__ = ["HANDOFF_HEADER", "PDServer", "pd_generate"]
