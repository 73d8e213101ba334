"""The network router's view of its instances and the polling that keeps it current.

Each instance is polled every `POLL_INTERVAL_S` (GET /load, serve.py's health and load gauges
in one small JSON answer; GET /health, then GET /metrics, from an instance without /load;
/v1/models when it comes up), each poll bounded by `POLL_TIMEOUT_S` and `MAX_POLL_BYTES`:

- refused, reset, an answer unreadable or over `MAX_POLL_BYTES`, or silent for `DEAD_S` (no
  poll answered and no byte of an answer relayed from it for that long; for one that has
  answered nothing yet, counted from when the router began watching it): the instance is
  **down**: it leaves the rotation, the requests in flight on it end there at once
  (`fail_inflight`; failover.py sends them again or resumes them elsewhere), and what the
  router knew of its cache and load is dropped (a restarted process has an empty cache);
- a poll timed out, but not yet silent that long: **slow**. It takes no new requests (as
  unavailable); those in flight go on, its cache and load are kept. Seen live: three
  instances on two cores, one stalled past a 1 s poll now and then (once in 18 replays on
  2026-12-02, twice in one later that day) and came back within half a second, and each time a
  router that took one missed poll for death cut every stream on it (15, then 32). A busy
  instance whose streams flow is never silent, so it stays slow until a poll gets through;
- /load or /health answering anything but 200 (draining, stalled): **unavailable**: no new
  requests, those in flight go on (a draining instance finishes its work);
- /load (or /health) 200 and its gauges read: **ok**, in the rotation; its load report is taken.

A hung instance leaves the rotation within POLL_INTERVAL_S + POLL_TIMEOUT_S (1.5 s): the first
poll sent after it stopped times out by then. While it is slow, each poll waits only until the
instance has been silent `DEAD_S`, so it is down, and its requests end, `DEAD_S` (1.7 s) after
its last sign of life at the latest. One whose process is gone fails its next poll at once
(connection refused), and its streams fail sooner still, when their connections break. Every
change of state is logged (logger `laps_jax.router`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import aiohttp

from laps_jax.cluster.pace import Pace
from laps_jax.cluster.upstream import (BlockIndex, LoadBook, MetricsReport, parse_load,
                                       parse_metrics)

POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 1.0
TEXT_BLOCK_BYTES = 64  # a text block (~16 tokens at 4 bytes per token: a KV block or so)
TEXT_BLOCKS = 1 << 16  # text blocks indexed per instance until it reports its block count
MAX_POLL_BYTES = 1 << 20  # a poll's answer (/load, /health, /metrics, /v1/models) past this: down
NO_LOAD_ROUTE = (404, 405, 501)  # /load answered so: the instance has none (not serve.py's)
DEAD_S = 1.7  # silent this long (no poll answered, no byte relayed): down (#24: within 2 s)

log = logging.getLogger("laps_jax.router")


@dataclasses.dataclass(eq=False)
class Instance:
    url: str
    slot: int = -1                  # its place in the router's instances (/router/status order)
    state: str = "unknown"          # unknown | ok | unavailable | slow | down
    last_error: str | None = None
    last_ok: float | None = None
    report: MetricsReport | None = None
    models: dict | None = None      # its /v1/models answer
    max_model_len: int | None = None
    blocks: BlockIndex | None = None
    texts: BlockIndex | None = None  # the text blocks routed here (prompts not tokenized)
    routed: int = 0
    load: LoadBook = dataclasses.field(default_factory=LoadBook)
    inflight: set = dataclasses.field(default_factory=set)  # futures set when it goes down
    last_data: float = -1e9         # monotonic time of the last byte relayed from it
    since: float = dataclasses.field(default_factory=time.monotonic)  # watched from (monotonic)
    pace: Pace | None = None        # how fast it has lately prefilled (laps; pace.py)
    has_load: bool | None = None    # answers GET /load (None: not asked since it came up)

    @property
    def healthy(self) -> bool:
        return self.state == "ok"

    @property
    def decoding(self) -> int:
        """The router's requests here past their first token, still streaming."""
        return max(len(self.inflight) - self.load.open_requests, 0)

    def silent_s(self, now: float) -> float:
        """Seconds since its last sign of life: a poll answered or a byte of an answer relayed;
        for one that has shown none, since the router began watching it (a router whose first
        poll of a starting instance timed out counted it silent for 10^9 s, down at once)."""
        return now - max(self.last_ok if self.last_ok is not None else self.since,
                         self.last_data)

    @property
    def never_answered(self) -> bool:
        """No poll answered and no byte relayed since the router began watching it."""
        return self.last_ok is None and self.last_data < self.since

    def fail_inflight(self) -> None:
        """Ends every request in flight here: each proxy's wait for its answer races its
        future, and the future closes an answer already under way (proxy.py); the request
        goes on at another instance (failover.py)."""
        for fut in list(self.inflight):
            if not fut.done():
                fut.set_result(None)

    def _enter(self, state: str, why: str | None) -> None:
        if state != self.state:
            (log.info if state == "ok" else log.warning)(
                "instance %s: %s%s", self.url, state, f" ({why})" if why else "")
        self.state, self.last_error = state, why

    def mark_down(self, why: str) -> None:
        self._enter("down", why)
        self.fail_inflight()
        self.load.clear()
        if self.pace is not None:
            self.pace.clear()
        for index in (self.blocks, self.texts):
            if index is not None:
                index.clear()
        self.models = None  # read again when it comes back (it may serve another model)
        self.has_load = None  # ... and another server

    def mark_unavailable(self, why: str) -> None:
        self._enter("unavailable", why)

    def mark_slow(self, why: str) -> None:
        """As unavailable (no new work, in-flight work goes on); said apart in status and log."""
        self._enter("slow", why)

    def mark_ok(self, report: MetricsReport, poll_started: float) -> None:
        self._enter("ok", None)
        self.last_ok = time.monotonic()
        self.report = report
        self.load.report(report.pending_tokens or 0.0, poll_started, report.pending_short)
        if report.block_size and (self.blocks is None or
                                  self.blocks.block_size != report.block_size):
            self.blocks = BlockIndex(report.block_size, report.num_blocks)
        if self.texts is None:  # about one KV block per text block: as many as it holds
            self.texts = BlockIndex(TEXT_BLOCK_BYTES, report.num_blocks or TEXT_BLOCKS)

    def status(self, group: str | None, draining: bool = False) -> dict:
        r = self.report
        return {"url": self.url, "group": group, "draining": draining,
                "healthy": self.healthy, "state": self.state,
                "last_error": self.last_error, "load": self.load.load,
                "reported_pending_tokens": self.load.reported,
                "sent_since_poll_tokens": self.load.since_poll,
                "short_load": self.load.short_load,
                "threshold": r.threshold if r else None,
                "long_chunk": r.long_chunk if r else None,
                "inflight": len(self.inflight), "decoding": self.decoding,
                "routed": self.routed,
                "block_size": r.block_size if r else None,
                "indexed_blocks": len(self.blocks) if self.blocks is not None else 0,
                "indexed_text_blocks": len(self.texts) if self.texts is not None else 0,
                "waiting": r.waiting if r else None, "running": r.running if r else None,
                "kv_cache_usage": r.kv_usage if r else None}


class TooLong(Exception):
    """An answer longer than the reader's limit."""


async def read_at_most(up: aiohttp.ClientResponse, limit: int) -> bytes:
    """The answer's body, or TooLong as soon as it passes `limit` bytes (nothing more read):
    an instance's answer is input, and an endless one must not fill the router's memory."""
    if (up.content_length or 0) > limit:
        raise TooLong
    out = bytearray()
    async for chunk in up.content.iter_chunked(1 << 16):
        out += chunk
        if len(out) > limit:
            raise TooLong
    return bytes(out)


async def poll_once(inst: Instance, session: aiohttp.ClientSession,
                    headers: dict | None = None, timeout: float = POLL_TIMEOUT_S) -> None:
    started = time.monotonic()
    if inst.state == "slow":  # a missed poll: wait no longer than until it counts as dead
        timeout = min(timeout, max(DEAD_S - inst.silent_s(started), 0.01))
    try:
        async with asyncio.timeout(timeout):
            report = await _read_load(inst, session)
            if report is None:
                return
            if inst.models is None:
                async with session.get(inst.url + "/v1/models", headers=headers) as r:
                    r.raise_for_status()
                    models = json.loads(await read_at_most(r, MAX_POLL_BYTES))
                inst.max_model_len = _max_model_len(models)
                inst.models = models
    except TimeoutError:
        silent = inst.silent_s(time.monotonic())
        if silent < DEAD_S:
            sign = ("none since the router began watching it" if inst.never_answered
                    else "last sign of life")
            inst.mark_slow(f"no answer to its health check in {timeout:.2g} s; "
                           f"{sign} {silent:.2f} s ago")
        else:
            inst.mark_down(f"silent for {silent:.1f} s: no answer to its health checks, "
                           "nothing relayed" + (", never answered" if inst.never_answered
                                                else ""))
        return
    except TooLong:
        inst.mark_down(f"a poll answered over {MAX_POLL_BYTES >> 10} KiB")
        return
    except (aiohttp.ClientError, OSError, ValueError, RecursionError) as e:
        inst.mark_down(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        return
    inst.mark_ok(report, started)


async def _read_load(inst: Instance, session: aiohttp.ClientSession) -> MetricsReport | None:
    """Its health and load report: one GET /load from a serve.py instance; GET /health, then
    /metrics, from one without it (404/405/501 to /load: another server, or an older one).
    None when it answered unhealthy (marked unavailable here); raises on an unreadable one."""
    if inst.has_load is not False:
        async with session.get(inst.url + "/load") as r:
            status, body = r.status, await read_at_most(r, MAX_POLL_BYTES)
        if status not in NO_LOAD_ROUTE:
            inst.has_load = True
            return parse_load(body) if _healthy(inst, "/load", status, body) else None
        inst.has_load = False
        log.info("instance %s: no /load (it answered %d); polling /health and /metrics",
                 inst.url, status)
    async with session.get(inst.url + "/health") as r:
        status, body = r.status, await read_at_most(r, MAX_POLL_BYTES)
    if not _healthy(inst, "/health", status, body):
        return None
    async with session.get(inst.url + "/metrics") as r:
        r.raise_for_status()
        return parse_metrics((await read_at_most(r, MAX_POLL_BYTES)).decode())


def _max_model_len(models) -> int | None:
    """The least max_model_len an OpenAI /v1/models answer lists; ValueError on one that is
    not {"data": [...]} (a forged answer fails its instance alone, not the poller)."""
    data = models.get("data", []) if isinstance(models, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models answered no list of models")
    lens = [m.get("max_model_len") for m in data if isinstance(m, dict)]
    return min((n for n in lens if type(n) is int and n >= 1), default=None)


def _healthy(inst: Instance, path: str, status: int, body: bytes) -> bool:
    """A health answer of 200; else the instance is marked unavailable with its reason."""
    if status == 200:
        return True
    try:
        why = json.loads(body).get("status", "unhealthy")
    except (ValueError, AttributeError, RecursionError):
        why = "unhealthy"
    inst.mark_unavailable(f"{path} answered {status} ({str(why)[:80]})")
    return False


async def poll_forever(inst: Instance, session: aiohttp.ClientSession,
                       headers: dict | None = None, interval: float = POLL_INTERVAL_S,
                       timeout: float = POLL_TIMEOUT_S) -> None:
    while True:
        t = time.monotonic()
        try:
            await poll_once(inst, session, headers, timeout)
        except Exception as e:  # a poll must not end: the instance would never be seen again
            log.exception("instance %s: poll failed", inst.url)
            inst.mark_down(f"poll failed: {type(e).__name__}: {e}")
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - t)))
