"""Passing one request through to an instance, and its answer back, as it comes.

Each request has an "instance down" future (`Instance.inflight`, set by the poller when the
instance stops answering). Until the instance's answer starts, the wait for it races that
future; from then on the future closes the answer's connection, which ends whatever read is
pending (cheaper than a race per stream chunk). So a request on a dead or hung instance ends
at once. `pass_through` says how: `Unsent` when nothing reached the client yet (refused,
reset, hung, or a stream that broke before its first event: the caller sends it elsewhere),
`Broken` when a stream broke after events reached the client (the `Passage` holds what they
were: the caller resumes it elsewhere, cluster/failover.py). A stream that ends without
`data: [DONE]` is broken too. `relay` is one attempt that answers such failures itself (502
JSON, or an error event and `data: [DONE]`): the prefill/decode split's. A client that goes
away closes the connection to the instance, which aborts the request there and frees its pages.

A stream is passed on whole events (the instance's SSE `\n\n`-separated blocks), never a
part of one, so a stream resumed elsewhere continues at an event boundary. The token-id
comment lines an instance adds on the router's request (server/resume.py) are read and
dropped; an event is bounded (`MAX_EVENT_BYTES`), a token id must be digits.

Every answer an instance gives carries `X-Laps-Routed-Instance`: the place of the instance that
started it in the router's list (/router/status order; its address is not exposed), as the
SGLang gateway's `x-smg-routed-worker-id` does, so a client or benchmark can see where each
request went. A resumed stream keeps the first instance's; an instance's own headers other
than `PASS_HEADERS` never reach the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from laps_jax.cluster.instances import Instance, TooLong, read_at_most
from laps_jax.server.protocol import APIError

DONE = b"data: [DONE]\n\n"
PASS_HEADERS = ("Content-Type", "Retry-After", "Cache-Control")
ROUTED_HEADER = "X-Laps-Routed-Instance"
HUNG = "it stopped answering the router's health checks"


MAX_EVENT_BYTES = 4 << 20  # an SSE event from an instance may not be longer
MAX_ANSWER_BYTES = 256 << 20  # nor a whole (not streamed) answer, which the router holds
# whole: a genuine one is at most ~1.5 KB a token (a chat token with 20 top logprobs, each
# with its bytes), so 128k tokens fit
MAX_TOKENS = 1 << 20  # token ids a passage records, at most


class InstanceDown(Exception):
    """The instance refused the connection: nothing was sent, another one may take it."""


class Unsent(Exception):
    """The instance failed before any byte of its answer reached the client."""

    def __init__(self, why: str, refused: bool = False):
        super().__init__(why)
        self.why, self.refused = why, refused


class Broken(Exception):
    """A stream's instance failed after some of its events reached the client."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class BadStream(Exception):
    """An instance's stream is not the SSE it should be."""


class Gone(Exception):
    """The instance stopped answering after the request was sent."""


async def race(aw, down: asyncio.Future):
    """`aw`'s result, or Gone when the instance goes down first."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    raise Gone(HUNG)


async def _read(aw, down: asyncio.Future):
    """`aw`'s result, a read of an answer whose connection `down` closes: Gone when it did."""
    try:
        out = await aw
    except aiohttp.ClientError:
        if down.done():
            raise Gone(HUNG) from None
        raise
    if down.done():
        raise Gone(HUNG)
    return out


def gone_error(inst: Instance, why: str) -> APIError:
    return APIError(f"the instance serving this request ({inst.url}) failed: {why}", 502,
                    "upstream_failed")


@dataclasses.dataclass
class Passage:
    """One client's streamed answer as it reached the client, across the instances serving it."""

    resp: web.StreamResponse | None = None  # the client's, prepared with the first event
    ids: list[int] = dataclasses.field(default_factory=list)  # generated tokens it has
    id: str | None = None       # the response's id and creation time (its first event's)
    created: int | None = None
    marked: bool = False        # its first event came with a token id (resumable)
    finished: bool = False      # a chunk with a finish reason went out
    done: bool = False          # `data: [DONE]` went out

    def take(self, event: bytes) -> bytes:
        """What of one instance event goes to the client (b"": nothing), noting what it says."""
        marked = event.startswith(b": id ")
        if marked:
            nl = event.find(b"\n")
            num = event[5:] if nl < 0 else event[5:nl]
            if not (0 < len(num) <= 10 and num.isdigit()) or len(self.ids) >= MAX_TOKENS:
                raise BadStream(f"a bad token id line {event[:40]!r}")
            self.ids.append(int(num))
            event = b"" if nl < 0 else event[nl + 1:]
            if not event:
                return b""
        if event == b"data: [DONE]":
            self.done = True
        elif event.startswith(b"data: {"):
            if self.id is None:  # the first: its id and time, kept on a resumed stream
                self.marked = marked
                try:
                    first = json.loads(event[6:])
                    self.id, self.created = str(first["id"]), int(first["created"])
                except (ValueError, KeyError, TypeError):
                    self.id, self.marked = "", False  # an error event: nothing to resume
            # (JSON escapes a quote inside a string: this key is never text)
            if b'"finish_reason": "' in event:
                self.finished = True
        return event + b"\n\n"

    async def fail(self, err: APIError) -> web.StreamResponse:
        """Ends the client's stream with `err` as an error event (and [DONE])."""
        await self.resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n" + DONE)
        await self.resp.write_eof()
        return self.resp

    async def close(self) -> web.StreamResponse:
        """Ends the client's stream whose answer was complete but for its end."""
        if not self.done:
            await self.resp.write(DONE)
        await self.resp.write_eof()
        return self.resp


async def relay(request: web.Request, session: aiohttp.ClientSession, inst: Instance,
                path: str, raw: bytes, stream: bool, headers: dict,
                on_first: Callable[[], None] | None = None) -> web.StreamResponse:
    """One attempt whose failure is the client's answer: 502 JSON, or an error event on a
    stream under way; InstanceDown when the connection was refused (nothing was sent)."""
    passage = Passage()
    try:
        return await pass_through(request, session, inst, path, raw, stream, headers,
                                  passage, on_first)
    except Unsent as e:
        if e.refused:
            raise InstanceDown(e.why) from None
        raise gone_error(inst, e.why) from None
    except Broken as e:
        return await passage.fail(gone_error(inst, e.why))


async def pass_through(request: web.Request, session: aiohttp.ClientSession, inst: Instance,
                       path: str, raw: bytes, stream: bool, headers: dict, passage: Passage,
                       on_first: Callable[[], None] | None = None) -> web.StreamResponse:
    """`on_first` is called once the first token is back (the first event of a stream, or
    the whole answer): the router's load book stops counting the request's prefill. A stream
    goes on in `passage.resp` when an earlier instance started it (a resumed stream)."""
    on_first = on_first or (lambda: None)
    down = asyncio.get_running_loop().create_future()
    inst.inflight.add(down)
    up = None
    try:
        try:
            up = await race(session.post(inst.url + path, data=raw, headers={
                "Content-Type": "application/json", **headers}), down)
        except aiohttp.ClientConnectorError as e:
            raise Unsent(f"{type(e).__name__}: {e}", refused=True) from None
        down.add_done_callback(lambda _: up.close())  # ends any read of the answer below
        out_headers = {h: up.headers[h] for h in PASS_HEADERS if h in up.headers}
        out_headers[ROUTED_HEADER] = str(inst.slot)
        if not (stream and up.status == 200
                and up.headers.get("Content-Type", "").startswith("text/event-stream")):
            try:
                body = await _read(read_at_most(up, MAX_ANSWER_BYTES), down)
            except TooLong:
                raise BadStream(f"an answer over {MAX_ANSWER_BYTES >> 20} MiB") from None
            if passage.resp is not None:  # resuming: any answer but a stream is a failure
                raise BadStream(f"it answered {up.status} to the resumed stream")
            on_first()
            return web.Response(body=body, status=up.status, headers=out_headers)
        buf = b""
        while True:
            chunk = await _read(up.content.readany(), down)
            if not chunk:
                break
            inst.last_data = time.monotonic()  # alive, however slow its polls (instances.py)
            buf += chunk
            if b"\n\n" not in buf:
                if len(buf) > MAX_EVENT_BYTES:
                    raise BadStream(f"an event over {MAX_EVENT_BYTES} bytes")
                continue
            *events, buf = buf.split(b"\n\n")
            out = b"".join([passage.take(e) for e in events if e])
            if not out:
                continue
            if passage.resp is None:  # the first event: the client's answer starts
                on_first()
                passage.resp = web.StreamResponse(status=200, headers=out_headers)
                await passage.resp.prepare(request)
            await passage.resp.write(out)
        if not passage.done:
            raise BadStream("the stream ended before its end")
        await passage.resp.write_eof()
        return passage.resp
    except (Gone, aiohttp.ClientError, BadStream) as e:
        why = str(e) or type(e).__name__
        if isinstance(e, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
            why = f"the connection broke ({type(e).__name__})"
        if passage.resp is None:
            raise Unsent(why) from None
        raise Broken(why) from None
    finally:
        inst.inflight.discard(down)
        if up is not None:
            up.close()  # unread (client gone, error): the connection closes, the instance aborts
