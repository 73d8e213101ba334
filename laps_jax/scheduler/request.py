"""A request as the scheduler sees it, and the handle its submitter holds.

The handle streams generated tokens (an async iterator of `TokenEvent`), ends with the request's
`RequestStats` (TTFT, cached tokens, pool), and can abort the request. Everything here lives on
the event loop; the device side only ever touches the `Sequence` inside.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
from typing import AsyncIterator, Callable, Protocol

from laps_jax.engine.sequence import Sequence, TokenLogprobs
from laps_jax.scheduler.executor import StepExecutor

_ids = itertools.count()
SHORT, LONG = "short", "long"


@dataclasses.dataclass
class TokenEvent:
    """One generated token: id, its log-prob and the top alternatives asked for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    index: int  # position in the output (0 = first token)


@dataclasses.dataclass
class RequestStats:
    """What a request went through. Times are on the dispatcher's clock (seconds)."""

    request_id: str
    arrival: float
    prompt_tokens: int
    new_tokens: int = 0       # prompt tokens to compute after the prefix-cache match
    cached_tokens: int = 0
    pool: str = ""            # "short" or "long" by the threshold (in every mode)
    lane: str = ""
    submitted: float | None = None  # when submit() ran (later than arrival if the caller's
                                    # loop was late: a replay's timer, a busy event loop)
    admitted: float | None = None
    prefill_done: float | None = None
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    slo_s: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def prefill_latency(self) -> float | None:
        return None if self.prefill_done is None else self.prefill_done - self.arrival

    @property
    def slo_violated(self) -> bool | None:
        if self.slo_s is None:
            return None
        return self.ttft is None or self.ttft > self.slo_s

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(ttft=self.ttft, prefill_latency=self.prefill_latency)
        return d


class Placement(Protocol):
    """The lane a request was placed on, as far as the request's holders use it: the dispatcher
    aborts through it, the simulator reads its executor. Named here, not imported from lane.py,
    so that lane.py (which runs requests) depends on this module and not the other way."""

    executor: StepExecutor

    def abort(self, r: Request) -> None: ...


@dataclasses.dataclass(eq=False)
class Request:
    """Scheduler state of one request. Ordered fields are read by pools and the window."""

    seq: Sequence
    stats: RequestStats
    deadline: float = math.inf   # arrival + TTFT SLO
    enqueued: float = 0.0        # entered its pool
    last_served: float = 0.0     # last prefill chunk (the starvation clock)
    delivered: int = 0           # output tokens already handed to the handle
    aborted: bool = False
    error: str | None = None     # why it failed (finish_reason "error"), for its client
    lane: Placement | None = None
    handle: "RequestHandle | None" = None
    pd_offer: bool = False       # prefill/decode split: offer the K/V after prefill (pd.py)
    handoff: dict | None = None  # ... and the offer's descriptor, once made

    @property
    def remaining(self) -> int:
        return self.seq.remaining_prefill

    @property
    def done(self) -> bool:
        return self.stats.finished is not None


class RequestHandle:
    """What `Dispatcher.submit` returns.

    `async for ev in handle` yields `TokenEvent`s until the request finishes; `await
    handle.result()` waits for the end and returns the `RequestStats`; `handle.abort()` removes
    the request from its pool at once and frees its pages.
    """

    def __init__(self, request: Request, abort: Callable[[Request], None]):
        self.request = request
        self._abort = abort
        self._queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._done = asyncio.Event()

    @property
    def request_id(self) -> str:
        return self.request.stats.request_id

    @property
    def stats(self) -> RequestStats:
        return self.request.stats

    @property
    def tokens(self) -> list[int]:
        return list(self.request.seq.output)

    @property
    def error(self) -> str | None:
        """Why the request failed (its stats' finish_reason is then "error"), else None."""
        return self.request.error

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def abort(self) -> None:
        if not self.finished:
            self._abort(self.request)

    async def result(self) -> RequestStats:
        await self._done.wait()
        return self.stats

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        while True:
            ev = await self._queue.get()
            if ev is None:
                return
            yield ev

    # -- called by the lane on the event loop ----------------------------------------------
    def _push(self, ev: TokenEvent) -> None:
        self._queue.put_nowait(ev)

    def _close(self) -> None:
        if not self._done.is_set():
            self._queue.put_nowait(None)
            self._done.set()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


def token_event(lp: TokenLogprobs, index: int) -> TokenEvent:
    return TokenEvent(lp.token_id, lp.logprob, lp.top, index)
