"""The router's prefill/decode split (`scripts/router.py --prefill URL ... --decode URL ...`).

Each request makes two legs (the wire protocol is in `server/pd.py`): the client's body goes to
a prefill instance with `X-Laps-PD: prefill`, which answers the hand-off descriptor (its K/V
offered on its transfer server, the first token sampled); then the same body goes to a decode
instance with `X-Laps-PD: decode` and the descriptor, which pulls the K/V and answers the client
as serve.py does, first token included: the client sees one ordinary OpenAI response or
stream, passed through by `proxy.relay` (so a decode instance that dies mid-stream ends it with
an error event, before it a JSON 502). The decode instance releases the prefill's pages as
soon as it has pulled them (`X-Laps-PD-Release` names the prefill instance); once the decode
leg has ended, however it ended, the router releases them too (`POST /pd/release`,
idempotent); the prefill's `--pd-timeout` frees them if both messages are lost. A decode
instance that refuses the connection is skipped for another (the offer is still there).
Every leg and release carries the split's secret (`server/pd_secret.py`).

Prefill instances are picked by least load (pending prefill tokens, as the router polls them);
decode instances by the longest cached prefix of the prompt (a follow-up turn goes where its
history is, as the decode side registers the pulled pages in its prefix cache), then load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web

from laps_jax.cluster.instances import Instance
from laps_jax.cluster.proxy import Gone, InstanceDown, gone_error, race, relay
from laps_jax.cluster.upstream import cached_prefixes
from laps_jax.server import pd_secret
from laps_jax.server.protocol import APIError

log = logging.getLogger("laps_jax.router")
PD_HEADER, HANDOFF_HEADER = "X-Laps-PD", "X-Laps-PD-Handoff"
RELEASE_HEADER = "X-Laps-PD-Release"


def _least(cands: list[tuple[int, Instance]], score) -> tuple[int, Instance]:
    if not cands:
        raise APIError("no instance of the split can take the request now; retry shortly",
                       503, "unavailable", headers={"Retry-After": "1"})
    return min(cands, key=score)


class PDSplit:
    """Which of the router's instances prefill and which decode, and the two legs."""

    def __init__(self, router, num_prefill: int, secret: str):
        self.router = router
        # every leg and release carries the split's secret (server/pd_secret.py)
        self.headers = {**router.upstream_headers, pd_secret.HEADER: secret}
        self.prefill = list(range(num_prefill))
        self.decode = list(range(num_prefill, len(router.instances)))
        if not self.prefill or not self.decode:
            raise ValueError("a prefill/decode split needs --prefill and --decode instances")
        self.released = 0

    def _ok(self, ks: list[int], exclude: set[int] = frozenset()) -> list[tuple[int, Instance]]:
        r = self.router
        return [(k, r.instances[k]) for k in ks if k not in exclude and r.instances[k].healthy
                and len(r.instances[k].inflight) < r.max_inflight]

    async def generate(self, request: web.Request, kind: str, raw: bytes, est) -> web.StreamResponse:
        r = self.router
        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        k, p = _least(self._ok(self.prefill), lambda c: (c[1].load.load, len(c[1].inflight)))
        p.routed += 1
        ticket = p.load.sent(est.tokens, time.monotonic())
        try:
            status, body = await self._prefill(p, path, raw)
        finally:  # the prefill leg's answer is its prefill done
            p.load.prefilled(ticket, time.monotonic())
        if status != 200:  # the instance's own answer (a 4xx for bad input reads the same)
            return web.Response(body=body, status=status, content_type="application/json",
                                headers={"Retry-After": "1"} if status == 503 else None)
        hand = json.loads(body)
        uuid = (hand.get("handoff") or {}).get("uuid")
        headers = {**self.headers, PD_HEADER: "decode", HANDOFF_HEADER: json.dumps(hand),
                   RELEASE_HEADER: p.url}  # the decode side frees the offer once pulled
        tried: set[int] = set()
        try:
            while True:
                cands = self._ok(self.decode, tried)
                cached = (cached_prefixes(est.ids, [c[1].blocks for c in cands])
                          if est.ids else [0] * len(cands))
                pick = dict(zip((c[0] for c in cands), cached))
                kd, d = _least(cands, lambda c: (-pick[c[0]], len(c[1].inflight)))
                d.routed += 1
                if est.ids and d.blocks is not None:
                    d.blocks.add(est.ids)
                try:
                    return await relay(request, r.session, d, path, raw, est.stream, headers)
                except InstanceDown as e:
                    d.mark_down(str(e))
                    tried.add(kd)
        finally:
            if uuid is not None:
                asyncio.ensure_future(self._release(p, uuid))

    async def _prefill(self, p: Instance, path: str, raw: bytes) -> tuple[int, bytes]:
        r = self.router
        down = asyncio.get_running_loop().create_future()
        p.inflight.add(down)
        try:
            async with await race(r.session.post(p.url + path, data=raw, headers={
                    "Content-Type": "application/json", **self.headers,
                    PD_HEADER: "prefill"}), down) as up:
                return up.status, await race(up.read(), down)
        except (Gone, aiohttp.ClientError) as e:
            raise gone_error(p, str(e) or type(e).__name__) from None
        finally:
            p.inflight.discard(down)

    async def _release(self, p: Instance, uuid: int) -> None:
        try:
            async with self.router.session.post(
                    p.url + "/pd/release", json={"uuid": uuid}, headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=5)) as up:
                await up.read()
            self.released += 1
        except (aiohttp.ClientError, TimeoutError) as e:  # its --pd-timeout frees them
            log.warning("could not release KV offer %d on %s: %s", uuid, p.url, e)


__all__ = ["PDSplit"]
