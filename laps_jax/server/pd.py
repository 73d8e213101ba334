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
3. `POST /pd/release {"uuid": ...}` to the prefill instance: its pages go back to its prefix
   cache. The decode instance sends it as soon as its pull is done, to the prefill instance
   the router names in `X-Laps-PD-Release` (so an offer pins pages for the pull, not for the
   whole decode); the router sends it again once step 2 ended, however it ended. Idempotent.

Every leg and release carries `X-Laps-PD-Secret` (`pd_secret.py`), checked with the role
before the body is read: a leg without it is a 401, and nothing was spent on it. A hand-off is
then checked field by field (`handoff_check.py`) before a page is reserved or a pull thread
taken: a bad one is a 400. A prefill leg beyond the split's pin limit, and a decode leg whose
pages stay taken, are 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily

from laps_jax.scheduler.pd import NoRoom, Offers, PDConfig
from laps_jax.scheduler.pd_adopt import Adopter
from laps_jax.server import pd_secret
from laps_jax.server.handoff_check import (HANDOFF_HEADER, PD_HEADER, RELEASE_HEADER, Handoff,
                                           check_offer, read_handoff)
from laps_jax.server.openai_api import answer
from laps_jax.server.protocol import APIError, GenerationRequest
from laps_jax.server.state import ServerState, check_room, decode_json, submit

log = logging.getLogger("laps_jax.server")


class PDServer:
    """One instance's part in the split: its secret, its transfer server and its offers or
    adoptions."""

    def __init__(self, cfg: PDConfig, dispatcher, secret: str):
        from laps_jax.engine.kv_remote import RemoteKV
        self.cfg, self.secret = cfg, secret
        self.remote = RemoteKV(cfg.transfer_address)
        self.offers = Offers(dispatcher, self.remote, cfg.timeout_s, cfg.max_pinned) \
            if cfg.role == "prefill" else None
        self.adopter = Adopter(dispatcher, self.remote, cfg.timeout_s) \
            if cfg.role == "decode" else None
        self._session = None  # aiohttp client for early releases (decode side)
        self._releases: set[asyncio.Task] = set()

    def release_early(self, base_url: str, uuid: int, api_key: str | None) -> None:
        """Tells the prefill instance its offer was pulled (fire and forget: the router's own
        release, and the offer's timeout, stand behind it)."""
        if not base_url.startswith(("http://", "https://")) or len(base_url) > 2048:
            return
        task = asyncio.ensure_future(self._release(base_url.rstrip("/"), uuid, api_key))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, base_url: str, uuid: int, api_key: str | None) -> None:
        import aiohttp
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        headers = {pd_secret.HEADER: self.secret}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        try:
            async with self._session.post(base_url + "/pd/release", json={"uuid": uuid},
                                          headers=headers) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.debug("early release of KV offer %d at %s failed: %s", uuid, base_url, e)

    def authorize(self, request: web.Request) -> None:
        if not pd_secret.matches(request.headers.get(pd_secret.HEADER), self.secret):
            raise APIError(f"missing or wrong {pd_secret.HEADER}: prefill/decode legs are the "
                           f"router's", 401, "invalid_pd_secret")

    async def release_route(self, request: web.Request) -> web.Response:
        self.authorize(request)
        body = decode_json(await request.read())
        uuid = body.get("uuid") if isinstance(body, dict) else None
        if not isinstance(uuid, int) or self.offers is None:
            raise APIError("POST /pd/release takes {\"uuid\": <int>} on a --role prefill "
                           "instance", code="invalid_request")
        return web.json_response({"released": await self.offers.release(uuid)})

    def collect(self):
        """/metrics gauges (a prometheus collector): what the split pins here."""
        if self.offers is None:
            return
        yield GaugeMetricFamily("laps_pd_pinned_pages", "KV pages held by prefill legs and "
                                "their offers (in laps_kv_pages_used too)",
                                value=self.offers.pinned_pages())
        yield GaugeMetricFamily("laps_pd_pin_limit_pages", "Most KV pages prefill legs and "
                                "their offers may hold (--pd-max-pinned)",
                                value=self.offers.limit)
        yield GaugeMetricFamily("laps_pd_offers_held", "Offers waiting for their pull",
                                value=len(self.offers.held))

    async def close(self) -> None:
        if self.offers is not None:
            await self.offers.close()
        if self.adopter is not None:
            await self.adopter.close()
        if self._session is not None:
            await self._session.close()


def pd_leg(request: web.Request, state: ServerState) -> Handoff | None:
    """Before the body is read: the leg's role and secret, and a decode leg's hand-off header
    (anything wrong is a 4xx now, nothing spent). None for a prefill leg."""
    pd = state.pd
    leg = request.headers.get(PD_HEADER, "")
    role = pd.cfg.role if pd is not None else "both"
    if leg not in ("prefill", "decode") or role != leg:
        raise APIError(f"this instance's --role is {role}: it does not take X-Laps-PD: {leg}",
                       code="invalid_request")
    pd.authorize(request)
    if leg == "prefill":
        return None
    hand = read_handoff(request.headers.get(HANDOFF_HEADER, ""), state.vocab_size)
    if hand.offer is not None:
        check_offer(hand.offer, state.engines[0])
    return hand


async def pd_generate(request: web.Request, state: ServerState, req: GenerationRequest,
                      hand: Handoff | None) -> web.StreamResponse:
    if hand is None:
        return await _prefill(request, state, req)
    return await _decode(request, state, req, hand)


def _no_room(e: NoRoom) -> APIError:
    return APIError(str(e), 503, "overloaded", headers={"Retry-After": "1"})


async def _prefill(request: web.Request, state: ServerState,
                   req: GenerationRequest) -> web.Response:
    offers = state.pd.offers
    check_room(state)
    try:
        pages = await offers.wait_room(len(req.prompt_ids))
    except NoRoom as e:
        raise _no_room(e) from None
    handle = submit(state, req, offer_kv=True)
    offers.track(handle.request, pages)  # no await since wait_room: the room is still there
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


async def _decode(request: web.Request, state: ServerState, req: GenerationRequest,
                  hand: Handoff) -> web.StreamResponse:
    offer = hand.offer
    if offer is not None and offer.num_tokens != len(req.prompt_ids):
        raise APIError(f"the hand-off holds {offer.num_tokens} tokens, the prompt here is "
                       f"{len(req.prompt_ids)}: both instances need the same tokenizer",
                       code="invalid_request")
    check_room(state)
    try:
        handle = await state.pd.adopter.adopt(req.prompt_ids, req.params, hand.first, offer,
                                              hand.finish_reason)
    except NoRoom as e:
        raise _no_room(e) from None
    if handle.finished and handle.stats.finish_reason == "error":
        raise APIError(handle.error or "KV transfer failed", 502, "kv_transfer_failed")
    if offer is not None and RELEASE_HEADER in request.headers:  # pulled: free it there now
        state.pd.release_early(request.headers[RELEASE_HEADER], offer.uuid, state.api_key)
    return await answer(request, state, req, handle)


__all__ = ["HANDOFF_HEADER", "PDServer", "pd_generate", "pd_leg"]
