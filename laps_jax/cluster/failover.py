"""A request through the router, sent again or resumed elsewhere when its instance fails.

- Nothing reached the client yet (the connection was refused or reset, the instance went down
  while it waited, or a stream broke before its first event): the request goes to another
  instance as it came (`laps_router_retries_total`). A refused instance is marked down at once.
- A stream broke after some of its events reached the client: it resumes on another instance
  (`laps_router_resumes_total`). The router asked its instance for every token's id
  (server/resume.py), so it knows the tokens the client has; the new instance gets the same
  body plus `laps_resume` (those ids, the response's id and time) and continues from the prompt
  plus those tokens, with max_tokens reduced by them; its events carry the same response id, its
  first one no second role, its usage the whole answer's. Greedy and seeded requests continue
  exactly as the uninterrupted one would have (sampling is keyed by position,
  engine/sampling.py); unseeded ones continue with a fresh seed, still a sample of the model's
  distribution given the text so far, not the one the first instance would have drawn.
- A stream whose finish chunk had already gone out ends with `data: [DONE]` (a usage chunk not
  sent yet is lost); one from an instance that sends no token ids (not serve.py) ends with an
  error event, as before.

Each failed instance is tried no more for this request; when none is left the client gets 503
(before any byte) or an error event. Each retry and resume is one line in the router's log.
"""

from __future__ import annotations

import json
import time

from aiohttp import web

from laps_jax.cluster.hold import HoldFull
from laps_jax.cluster.instances import log
from laps_jax.cluster.proxy import Broken, Passage, Unsent, gone_error, pass_through
from laps_jax.server.state import STATE
from laps_jax.server.protocol import APIError
from laps_jax.server.resume import TOKEN_IDS_HEADER


def resume_body(raw: bytes, passage: Passage) -> bytes:
    """The client's body, continued from what the client has (`laps_resume`)."""
    body = json.loads(raw)
    body["laps_resume"] = {"token_ids": passage.ids, "id": passage.id,
                           "created": passage.created}
    return json.dumps(body).encode()


async def route(request: web.Request, router, path: str, raw: bytes, est) -> web.StreamResponse:
    metrics = request.app[STATE].metrics
    headers = dict(router.upstream_headers)
    if est.stream:
        headers[TOKEN_IDS_HEADER] = "1"
    passage, body, tried = Passage(), raw, set()
    held = router.held_tokens(est)  # None: never held (no hold, or a short request)
    holding = held is not None
    if holding:  # wait in the router until an instance has room for it (cluster/hold.py)
        try:
            if not await router.hold.turn(held):
                held = None  # room on arrival: the policy picks among every instance
        except HoldFull as e:
            raise APIError(str(e), 503, "unavailable", headers={"Retry-After": "1"}) from None
    while True:
        try:
            choice = router.choose(est, tried | router.held_back(held))
            k, new, short = router.placed(est, choice)
            inst = router.instances[k]
            inst.routed += 1
            t0, ahead = time.monotonic(), inst.load.load
            ticket = inst.load.sent(new + len(passage.ids), t0, short)
        except APIError as e:
            if passage.resp is None:
                raise
            return await passage.fail(e)  # a stream under way: nowhere left to resume it
        finally:  # counted on its instance (or refused): the next held request may go
            if holding:
                holding = False
                router.hold.sent()
        router.remember(inst, est)

        def prefilled() -> None:
            inst.load.prefilled(ticket, time.monotonic())
            if router.hold is not None:  # its instance may be below the hold now
                router.hold.kick()

        def first_token() -> None:
            if inst.pace is not None and est.stream and body is raw:  # (not a whole answer's
                now = time.monotonic()                                 # time, nor a resume's)
                inst.pace.observe(now - t0, ahead, new, now)
            prefilled()
        try:
            return await pass_through(request, router.session, inst, path, body, est.stream,
                                      headers, passage, first_token)
        except Unsent as e:
            if e.refused:
                inst.mark_down(e.why)
            tried.add(k)
            router.policy.withdraw(choice)  # it goes elsewhere
            metrics.retries.inc()
            log.warning("request sent again: %s failed before any byte reached the client "
                        "(%s)", inst.url, e.why)
        except Broken as e:
            tried.add(k)
            if passage.finished:
                return await passage.close()
            if not passage.marked:  # no token ids: it cannot be resumed
                return await passage.fail(gone_error(inst, e.why))
            router.policy.withdraw(choice)  # it goes on elsewhere
            metrics.resumes.inc()
            log.warning("stream %s resumed: %s failed after %d tokens (%s)", passage.id,
                        inst.url, len(passage.ids), e.why)
            body = resume_body(raw, passage)
        finally:
            prefilled()
