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
idempotent); the prefill's `--pd-timeout` frees them if both messages are lost. An instance
of either side that refuses the connection is skipped for another (nothing was sent; on the
decode side the offer is still there). Every leg and release carries the split's secret
(`server/pd_secret.py`).

The prefill instance's answer is input from another process: it becomes the decode leg's
header, so it is read up to `MAX_HANDOFF` bytes (the decode side's own cap,
`handoff_check.MAX_HEADER`, under aiohttp's 8,190 per header field) and must be a JSON
object whose `handoff` is null or carries an integer `uuid`. Anything else ends that request
alone with a 502 naming the instance, before a decode instance is asked for anything. Its
error answers pass through when they are JSON errors; other bodies read as the same 502. The
decode side checks every field again (`server/handoff_check.py`); its 400 `invalid_handoff`
also reaches the client as that 502, since the client sent nothing wrong.

Prefill instances are picked by least load (pending prefill tokens, as the router polls them);
decode instances by the longest cached prefix of the prompt (a follow-up turn goes where its
history is, as the decode side registers the pulled pages in its prefix cache), then load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import aiohttp
from aiohttp import web

from laps_jax.cluster.instances import Instance, TooLong, read_at_most
from laps_jax.cluster.proxy import Gone, InstanceDown, gone_error, race, relay
from laps_jax.cluster.upstream import cached_prefixes
from laps_jax.server import pd_secret
from laps_jax.server.handoff_check import HANDOFF_HEADER, PD_HEADER, RELEASE_HEADER
from laps_jax.server.handoff_check import MAX_HEADER as MAX_HANDOFF
from laps_jax.server.protocol import APIError

log = logging.getLogger("laps_jax.router")


@dataclasses.dataclass
class PrefillAnswer:
    """A prefill leg's answer, checked: the decode leg's header and the offer's uuid (None:
    the first token ended the request), or the instance's own JSON error for the client."""

    header: str | None = None
    uuid: int | None = None
    error: web.Response | None = None


def read_prefill_answer(url: str, status: int, body: bytes) -> PrefillAnswer:
    """`body` of a prefill leg's answer with `status`, checked; a 502 APIError naming the
    instance when it is neither a hand-off nor a JSON error."""
    def bad(why: str) -> APIError:
        return APIError(f"the prefill instance {url} answered {why}", 502, "upstream_failed")
    try:
        ans = json.loads(body)
    except ValueError:  # (UnicodeDecodeError is one)
        ans = None
    if status != 200:
        if isinstance(ans, dict) and isinstance(ans.get("error"), dict) and 400 <= status < 600:
            return PrefillAnswer(error=web.Response(
                body=body, status=status, content_type="application/json",
                headers={"Retry-After": "1"} if status == 503 else None))
        raise bad(f"HTTP {status} without a JSON error")
    if not isinstance(ans, dict):
        raise bad("a hand-off that is not a JSON object")
    hand, uuid = ans.get("handoff"), None
    if hand is not None:
        uuid = hand.get("uuid") if isinstance(hand, dict) else None
        if type(uuid) is not int or not 0 <= uuid < 1 << 64:
            raise bad("a hand-off without an integer 'uuid'")
    header = json.dumps(ans)  # (ASCII: any other character is escaped)
    if len(header) > MAX_HANDOFF:
        raise bad(f"a hand-off of more than {MAX_HANDOFF} bytes")
    return PrefillAnswer(header, uuid)


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
        p, status, body = await self._prefill_leg(path, raw, est.tokens)
        ans = read_prefill_answer(p.url, status, body)
        if ans.error is not None:  # the instance's own (a 4xx for bad input reads the same)
            return ans.error
        uuid = ans.uuid
        headers = {**self.headers, PD_HEADER: "decode", HANDOFF_HEADER: ans.header,
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
                    resp = await relay(request, r.session, d, path, raw, est.stream, headers)
                    return _blame_prefill(resp, p.url)
                except InstanceDown as e:
                    d.mark_down(str(e))
                    tried.add(kd)
        finally:
            if uuid is not None:
                asyncio.ensure_future(self._release(p, uuid))

    async def _prefill_leg(self, path: str, raw: bytes, tokens: int
                           ) -> tuple[Instance, int, bytes]:
        """The prefill leg on the least loaded prefill instance, skipping any that refuses the
        connection for the next: (instance, status, body)."""
        tried: set[int] = set()
        while True:
            k, p = _least(self._ok(self.prefill, tried),
                          lambda c: (c[1].load.load, len(c[1].inflight)))
            p.routed += 1
            ticket = p.load.sent(tokens, time.monotonic())
            try:
                status, body = await self._prefill(p, path, raw)
                return p, status, body
            except InstanceDown as e:
                p.mark_down(str(e))
                tried.add(k)
            finally:  # the prefill leg's answer is its prefill done
                p.load.prefilled(ticket, time.monotonic())

    async def _prefill(self, p: Instance, path: str, raw: bytes) -> tuple[int, bytes]:
        r = self.router
        down = asyncio.get_running_loop().create_future()
        p.inflight.add(down)
        try:
            async with await race(r.session.post(p.url + path, data=raw, headers={
                    "Content-Type": "application/json", **self.headers,
                    PD_HEADER: "prefill"}), down) as up:
                return up.status, await race(read_at_most(up, MAX_HANDOFF), down)
        except aiohttp.ClientConnectorError as e:  # nothing sent: another may take it
            raise InstanceDown(f"{type(e).__name__}: {e}") from None
        except TooLong:
            raise APIError(f"the prefill instance {p.url} answered a hand-off of more than "
                           f"{MAX_HANDOFF} bytes", 502, "upstream_failed") from None
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


def _blame_prefill(resp: web.StreamResponse, url: str) -> web.StreamResponse:
    """The decode instance's answer, but its 400 `invalid_handoff` (a field of the prefill's
    hand-off it refused: server/handoff_check.py) is the prefill peer's fault, not the
    client's: a 502 naming that instance."""
    if not (isinstance(resp, web.Response) and resp.status == 400 and resp.body):
        return resp
    try:
        err = json.loads(resp.body)["error"]
    except (ValueError, KeyError, TypeError):
        return resp
    if not isinstance(err, dict) or err.get("code") != "invalid_handoff":
        return resp
    raise APIError(f"the prefill instance {url} answered a bad hand-off "
                   f"({err.get('message')})", 502, "upstream_failed")


__all__ = ["PDSplit", "read_prefill_answer"]
